"""Write a full-size synthetic Qwen2-57B-A14B-Instruct-GPTQ-Int4 checkpoint for the conversion benchmark.

The real repo cannot be downloaded here, and the converter's speed and memory only depend on tensor
names, shapes, dtypes and sizes, so this writes exactly those (28 layers, 64 experts, 4-bit group 128
symmetric GPTQ v1, about 31 GB in ~4 GB shards with an index) filled with random bits. To stay fast and
bounded in memory on two cores it does no quantization math: qweight words are raw PCG64 output, sym v1
qzeros are all 0x77777777, scales and float weights are fp16 bit patterns with a fixed small exponent
range, g_idx is trivial. Each shard is written with a streaming safetensors writer (header first, then
every tensor in order, in chunks of at most ``CHUNK_BYTES``), so peak memory is a few chunks whatever the
model size.

    python benchmarks/make_synthetic_57b.py OUT                       # full size, ~31 GB
    python benchmarks/make_synthetic_57b.py OUT --layers 1 --scale small   # tiny, same structure
    python benchmarks/make_synthetic_57b.py OUT --scale qwen3-30b --layers 4   # Qwen3-30B-A3B shapes, 4 layers

``--scale qwen3-30b`` writes Qwen3-30B-A3B-GPTQ-Int4's shapes instead (48 layers of 128 experts, top-8, H=2048,
I=768, 32 heads of 128 with 4 KV heads, q/k norms, no shared expert, no attention bias), the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from repack.formats.gptq import GptqScheme
from repack.synthetic import generation_config, gptqmodel_quantization_config, write_tokenizer

CHUNK_BYTES = 32 << 20
DEFAULT_SHARD_BYTES = 4_000_000_000
SYM_V1_QZEROS_WORD = 0x77777777  # true zero 8 stored as 7 in every nibble
FP16_ONE = 0x3C00
SCHEME = GptqScheme(bits=4, group_size=128, sym=True, checkpoint_format="gptq")
SAFETENSORS_DTYPES = {"int32": ("I32", 4), "float16": ("F16", 2)}


@dataclass(frozen=True)
class Qwen2MoeSizes:
    """The Qwen2-MoE sizes that fix every tensor shape."""

    num_layers: int
    hidden_size: int
    num_experts: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    top_k: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int  # dense MLP size in the config (unused by 57B, which has no dense layer)
    family: str = "qwen2_moe"  # or "qwen3_moe": head_dim of its own, q/k norms, no shared expert, no qkv bias
    attention_head_dim: int | None = None  # None: hidden_size // num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads


FULL = Qwen2MoeSizes(
    num_layers=28,
    hidden_size=3584,
    num_experts=64,
    moe_intermediate_size=2560,
    shared_expert_intermediate_size=20480,
    top_k=8,
    vocab_size=151936,
    num_attention_heads=28,
    num_key_value_heads=4,
    intermediate_size=18944,
)
QWEN3_30B = Qwen2MoeSizes(
    num_layers=48,
    hidden_size=2048,
    num_experts=128,
    moe_intermediate_size=768,
    shared_expert_intermediate_size=0,
    top_k=8,
    vocab_size=151936,
    num_attention_heads=32,
    num_key_value_heads=4,
    intermediate_size=6144,
    family="qwen3_moe",
    attention_head_dim=128,
)
SMALL = Qwen2MoeSizes(
    num_layers=28,
    hidden_size=256,
    num_experts=16,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=1024,
    top_k=8,
    vocab_size=1024,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: its name, dtype, shape and how its content is made."""

    name: str
    dtype: str  # "int32" | "float16"
    shape: tuple[int, ...]
    fill: str  # "random_words" | "sym_qzeros" | "scales" | "small_floats" | "ones" | "trivial_g_idx"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * SAFETENSORS_DTYPES[self.dtype][1]


def gptq_linear_specs(name: str, in_features: int, out_features: int, *, bias: bool = False) -> list[TensorSpec]:
    """The four (five with bias) tensors of one 4-bit group-128 GPTQ linear, in GPTQModel's order."""
    groups = SCHEME.groups(in_features)
    pack = SCHEME.pack_factor
    specs = [
        TensorSpec(f"{name}.g_idx", "int32", (in_features,), "trivial_g_idx"),
        TensorSpec(f"{name}.qweight", "int32", (in_features // pack, out_features), "random_words"),
        TensorSpec(f"{name}.qzeros", "int32", (groups, out_features // pack), "sym_qzeros"),
        TensorSpec(f"{name}.scales", "float16", (groups, out_features), "scales"),
    ]
    if bias:
        specs.insert(0, TensorSpec(f"{name}.bias", "float16", (out_features,), "small_floats"))
    return specs


def model_specs(sizes: Qwen2MoeSizes) -> list[TensorSpec]:
    """Every tensor of Qwen2-57B-A14B-Instruct-GPTQ-Int4 (names as the real repo has them), in layer order."""
    h = sizes.hidden_size
    kv = sizes.num_key_value_heads * sizes.head_dim
    specs = [TensorSpec("model.embed_tokens.weight", "float16", (sizes.vocab_size, h), "small_floats")]
    for layer in range(sizes.num_layers):
        prefix = f"model.layers.{layer}"
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        qwen2 = sizes.family == "qwen2_moe"
        q = sizes.num_attention_heads * sizes.head_dim
        specs.append(TensorSpec(f"{prefix}.input_layernorm.weight", "float16", (h,), "ones"))
        specs += gptq_linear_specs(f"{attn}.q_proj", h, q, bias=qwen2)
        specs += gptq_linear_specs(f"{attn}.k_proj", h, kv, bias=qwen2)
        specs += gptq_linear_specs(f"{attn}.v_proj", h, kv, bias=qwen2)
        specs += gptq_linear_specs(f"{attn}.o_proj", q, h)
        if not qwen2:
            specs.append(TensorSpec(f"{attn}.q_norm.weight", "float16", (sizes.head_dim,), "ones"))
            specs.append(TensorSpec(f"{attn}.k_norm.weight", "float16", (sizes.head_dim,), "ones"))
        specs.append(TensorSpec(f"{prefix}.post_attention_layernorm.weight", "float16", (h,), "ones"))
        specs.append(TensorSpec(f"{mlp}.gate.weight", "float16", (sizes.num_experts, h), "small_floats"))
        for expert in range(sizes.num_experts):
            specs += _mlp_specs(f"{mlp}.experts.{expert}", h, sizes.moe_intermediate_size)
        if sizes.shared_expert_intermediate_size:
            specs += _mlp_specs(f"{mlp}.shared_expert", h, sizes.shared_expert_intermediate_size)
            specs.append(TensorSpec(f"{mlp}.shared_expert_gate.weight", "float16", (1, h), "small_floats"))
    specs.append(TensorSpec("model.norm.weight", "float16", (h,), "ones"))
    specs.append(TensorSpec("lm_head.weight", "float16", (sizes.vocab_size, h), "small_floats"))
    return specs


def _mlp_specs(prefix: str, hidden: int, intermediate: int) -> list[TensorSpec]:
    return (
        gptq_linear_specs(f"{prefix}.down_proj", intermediate, hidden)
        + gptq_linear_specs(f"{prefix}.gate_proj", hidden, intermediate)
        + gptq_linear_specs(f"{prefix}.up_proj", hidden, intermediate)
    )


def plan_shards(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """Fill shards in tensor order up to ``shard_bytes`` (a bigger tensor gets a shard of its own)."""
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        if shards[-1] and used + spec.nbytes > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += spec.nbytes
    return shards


def safetensors_header(specs: list[TensorSpec]) -> bytes:
    """The 8-byte length plus JSON header (space-padded to 8 bytes) of a file holding ``specs`` in order."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": SAFETENSORS_DTYPES[spec.dtype][0],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class ContentMaker:
    """Random-looking tensor bytes made chunk by chunk from one PCG64 stream: no float math, no big arrays."""

    def __init__(self, seed: int) -> None:
        self.bits = np.random.PCG64(seed)

    def chunks(self, spec: TensorSpec) -> Iterator[np.ndarray]:
        item = SAFETENSORS_DTYPES[spec.dtype][1]
        if spec.fill == "trivial_g_idx":
            yield np.arange(spec.shape[0], dtype=np.int32) // SCHEME.group_size
            return
        row_bytes = math.prod(spec.shape[1:]) * item
        rows_per_chunk = max(1, CHUNK_BYTES // row_bytes)
        for start in range(0, spec.shape[0], rows_per_chunk):
            rows = min(rows_per_chunk, spec.shape[0] - start)
            yield self._fill(spec.fill, rows * row_bytes)

    def _fill(self, fill: str, nbytes: int) -> np.ndarray:
        if fill == "sym_qzeros":
            return np.full(nbytes // 4, SYM_V1_QZEROS_WORD, dtype=np.uint32)
        if fill == "ones":
            return np.full(nbytes // 2, FP16_ONE, dtype=np.uint16)
        words = self.bits.random_raw(-(-nbytes // 8)).view(np.uint8)[:nbytes]
        if fill == "random_words":
            return words
        halves = words.view(np.uint16)
        if fill == "scales":  # positive fp16 in [2^-9, 2^-8): a 4-bit step for weights of std ~0.02
            return (halves & 0x03FF) | 0x1800
        if fill == "small_floats":  # random sign, magnitude in [2^-7, 2^-5)
            return (halves & 0x87FF) | 0x2000
        raise ValueError(f"unknown fill '{fill}'")


def write_shard(path: Path, specs: list[TensorSpec], maker: ContentMaker, progress: Progress) -> None:
    with path.open("wb") as out:
        out.write(safetensors_header(specs))
        for spec in specs:
            written = 0
            for chunk in maker.chunks(spec):
                out.write(chunk.data)
                written += chunk.nbytes
                progress.advance(chunk.nbytes)
            if written != spec.nbytes:
                raise AssertionError(f"{spec.name}: wrote {written} bytes, expected {spec.nbytes}")


class Progress:
    """Bytes written, throughput and ETA on one stderr line, at most a few times a second."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.start = time.monotonic()
        self.last_print = 0.0

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if now - self.last_print > 0.5 or self.done == self.total:
            self.last_print = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / max(rate, 1)
            print(
                f"\r{self.done / 1e9:7.2f} / {self.total / 1e9:.2f} GB  {rate / 1e9:5.2f} GB/s  ETA {eta:5.0f} s",
                end="",
                file=sys.stderr,
                flush=True,
            )

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def qwen2_57b_config(sizes: Qwen2MoeSizes) -> dict:
    """config.json of Qwen2-57B-A14B-Instruct-GPTQ-Int4 (transformers 5 key names), scaled to ``sizes``."""
    return {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "decoder_sparse_step": 1,
        "dtype": "float16",
        "hidden_act": "silu",
        "hidden_size": sizes.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": sizes.intermediate_size,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "mlp_only_layers": [],
        "moe_intermediate_size": sizes.moe_intermediate_size,
        "norm_topk_prob": False,
        "num_attention_heads": sizes.num_attention_heads,
        "num_experts": sizes.num_experts,
        "num_experts_per_tok": sizes.top_k,
        "num_hidden_layers": sizes.num_layers,
        "num_key_value_heads": sizes.num_key_value_heads,
        "output_router_logits": False,
        "qkv_bias": True,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": sizes.shared_expert_intermediate_size,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "transformers_version": "5.24.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": sizes.vocab_size,
        "quantization_config": gptqmodel_quantization_config(SCHEME, act_order=False),
    }


def qwen3_30b_config(sizes: Qwen2MoeSizes) -> dict:
    """config.json of Qwen3-30B-A3B-GPTQ-Int4 (transformers 5 key names), scaled to ``sizes``."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "decoder_sparse_step": 1,
        "dtype": "float16",
        "head_dim": sizes.head_dim,
        "hidden_act": "silu",
        "hidden_size": sizes.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": sizes.intermediate_size,
        "max_position_embeddings": 40960,
        "max_window_layers": sizes.num_layers,
        "mlp_only_layers": [],
        "moe_intermediate_size": sizes.moe_intermediate_size,
        "norm_topk_prob": True,
        "num_attention_heads": sizes.num_attention_heads,
        "num_experts": sizes.num_experts,
        "num_experts_per_tok": sizes.top_k,
        "num_hidden_layers": sizes.num_layers,
        "num_key_value_heads": sizes.num_key_value_heads,
        "output_router_logits": False,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "transformers_version": "5.24.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": sizes.vocab_size,
        "quantization_config": gptqmodel_quantization_config(SCHEME, act_order=False),
    }


def write_checkpoint(out: Path, sizes: Qwen2MoeSizes, *, shard_bytes: int, seed: int) -> dict:
    """Write the whole folder; return the figures (bytes, shards, seconds, GB/s)."""
    out.mkdir(parents=True, exist_ok=True)
    config = qwen2_57b_config(sizes) if sizes.family == "qwen2_moe" else qwen3_30b_config(sizes)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "quantize_config.json").write_text(json.dumps(config["quantization_config"], indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(), indent=2) + "\n")
    write_tokenizer(out, sizes.vocab_size)
    specs = model_specs(sizes)
    shards = plan_shards(specs, shard_bytes)
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    total = sum(spec.nbytes for spec in specs)
    index = {
        "metadata": {"total_size": total},
        "weight_map": {spec.name: name for name, shard in zip(names, shards, strict=True) for spec in shard},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    maker = ContentMaker(seed)
    progress = Progress(total)
    for name, shard in zip(names, shards, strict=True):
        write_shard(out / name, shard, maker, progress)
    seconds = progress.elapsed()
    print(file=sys.stderr)
    return {"bytes": total, "shards": len(shards), "seconds": seconds, "gb_per_s": total / 1e9 / max(seconds, 1e-9)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="output folder (created)")
    parser.add_argument("--layers", type=int, default=None, help="number of decoder layers (default: 28)")
    parser.add_argument(
        "--scale", choices=("full", "small", "qwen3-30b"), default="full", help="57B, tiny or Qwen3-30B"
    )
    parser.add_argument("--shard-size", type=int, default=None, help="bytes per shard (default 4 GB; small: 4 MB)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = {"full": FULL, "small": SMALL, "qwen3-30b": QWEN3_30B}[args.scale]
    if args.layers is not None:
        sizes = dataclasses.replace(sizes, num_layers=args.layers)
    shard_bytes = args.shard_size or (4 << 20 if args.scale == "small" else DEFAULT_SHARD_BYTES)
    figures = write_checkpoint(args.out, sizes, shard_bytes=shard_bytes, seed=args.seed)
    print(
        f"wrote {figures['bytes'] / 1e9:.3f} GB in {figures['shards']} shards to {args.out} "
        f"in {figures['seconds']:.1f} s ({figures['gb_per_s']:.2f} GB/s)"
    )


if __name__ == "__main__":
    main()
