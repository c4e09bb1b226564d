"""The kernel wing: one module per fused-MoE kernel family, each exporting ``FAMILY`` (a ``family.KernelFamily``:
what it supports, the config it takes a call with, its heuristic, its launches, which top-k sum it does), walked in
order by runtime/fused_moe.py (``FAMILIES``) for the config a runtime/kernel_config.py ``KernelConfig`` names:

- ``decode_mma``: the decode's launches with each K step on Hopper's tensor cores (Gluon, mma.sync; mma128 stacks);
- ``decode``: CUDA cores, one program per (token, expert) pair (few pairs), any stack;
- ``gluon_sm90``: weight_major's GEMMs in Gluon for Hopper, a wgmma in flight while dequantizing (sm_90, mma128);
- ``weight_major``: tensor cores, the dequantized weights as the MMA's register operand (past decode);
- ``gptq_order``: tensor cores, tokens as the A operand (the stacks weight_major cannot read);

with the jit helpers they share in ``common``, ``backend`` (GPU or Triton interpreter), ``split_k`` (the decode's
slices of K meeting in fp32 sums, and their scratch), ``schedule`` (the persistent kernels' work lists), and
``routing`` (softmax top-k), ``align`` (pairs sorted into per-expert row blocks), ``act_order`` (act-order rows
gathered once), ``topk_sum`` (the tensor-core families' per-pair rows summed per token) and ``gptq_linear`` (the dense
GPTQ linear) beside them. A new family is one module here and one place in ``fused_moe.FAMILIES``.

Dimension letters, in every module here: M tokens, T top-k, P = M*T (token, expert) pairs, E experts, H hidden
size, I intermediate size, N and K a GEMM's output channels and inputs, G quantization groups, pack = 32 // bits
inputs per int32 word.
"""
