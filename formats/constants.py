"""The repack-moe format as constants: names, versions and word orders (formats/SPEC.md).

Kept free of torch so that tools that only name files or check versions (the CLI's startup, `repack push`)
do not pay for importing it; formats/stacks.py re-exports every name.
"""

FORMAT_NAME = "repack-moe"
FORMAT_VERSION = 3  # what the converter writes
# What readers accept: v1 is v2 with every stack in the "gptq" word order, v2 is v3 without "mma128_tiles".
SUPPORTED_FORMAT_VERSIONS = (1, 2, 3)
QUANT_METHOD = "repack"
MANIFEST_FILE = "repack_manifest.json"
CARD_FILE = "README.md"  # the model card: written and owned by `repack push`, not a conversion output
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
CONVERSION_ID_KEY = "conversion_id"  # in the manifest, config.json's quantization_config, every shard header

# Activation dtypes the kernels take (scales are fp16 in the files; bf16 activations get bf16 scales at load).
# Names here, so torch-free code (the CLI's option checks) can use them; formats.stacks has the torch dtypes.
ACTIVATION_DTYPE_NAMES = ("float16", "bfloat16")
STACK_TENSORS = ("w13_qweight", "w13_scales", "w13_zeros", "w13_perm", "w2_qweight", "w2_scales", "w2_zeros", "w2_perm")
ROUTED = "routed"
SHARED = "shared"

# Nibble orders of the qweight words along a row. "gptq": field s of word r is input 8r + s. "mma128" (4-bit):
# inside each block of 16 words (128 inputs) field s of word w holds input
# 16 * (4 * (w // 8) + s % 4) + 2 * (w % 8) + s // 4, so one shift and mask of a word gives the fp16x2 pair
# (k, k + 1) one thread of Hopper's wgmma A fragment needs (formats/SPEC.md section 3).
# "mma128_tiles" (version 3): the "mma128" words of each expert cut into tiles of 64 rows x one block, each tile one
# contiguous 4 KB run (a kernel's TMA box), so a qweight is [E, N/64, K/128, 64, 16].
GPTQ_ORDER = "gptq"
MMA128_ORDER = "mma128"
TILES_ORDER = "mma128_tiles"
WORD_ORDERS = (GPTQ_ORDER, MMA128_ORDER, TILES_ORDER)
MMA_ORDERS = (MMA128_ORDER, TILES_ORDER)  # the orders whose blocks hold the mma128 nibble permutation
MMA128_BLOCK = 128  # inputs per permuted block: 16 words of 8 nibbles
TILE_ROWS = 64  # output rows per tile of "mma128_tiles": one warpgroup's wgmma M
