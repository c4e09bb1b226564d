"""The kernel wing: one module per fused-MoE kernel family, each exporting one ``run``, chosen by
runtime/fused_moe.py from a runtime/kernel_config.py ``KernelConfig``:

- ``decode``: CUDA cores, one program per (token, expert) pair (few pairs);
- ``weight_major``: tensor cores, the dequantized weights as the MMA's register operand (past decode);
- ``gptq_order``: tensor cores, tokens as the A operand (the stacks weight_major cannot read);
- ``gluon_sm90``: weight_major's GEMMs in Gluon for Hopper, a wgmma in flight while dequantizing (opt-in);

with the jit helpers they share in ``common``, and ``routing`` (softmax top-k), ``align`` (pairs sorted into
per-expert row blocks), ``topk_sum`` (the tensor-core families' per-pair rows summed per token) and
``gptq_linear`` (the dense GPTQ linear) beside them.

Dimension letters, in every module here: M tokens, T top-k, P = M*T (token, expert) pairs, E experts, H hidden
size, I intermediate size, N and K a GEMM's output channels and inputs, G quantization groups, pack = 32 // bits
inputs per int32 word.
"""
