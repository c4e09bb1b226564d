"""A Triton W4A16 linear that runs a GPTQ linear straight from the copied-through source tensors.

Why: a converted checkpoint keeps attention (and dense MLPs, a quantized lm_head) in the GPTQ layout,
byte for byte (formats/SPEC.md section 4). Serving them must not dequantize the model to fp16 at load, so
this kernel reads ``qweight`` ``[K/pack, N]`` (packed along K), ``qzeros``, ``scales`` and ``g_idx`` as
stored and dequantizes one ``[BLOCK_K, BLOCK_N]`` tile at a time inside the GEMM:

- ``q``: word ``qweight[k // pack, n]``, field ``k % pack`` (shift and mask).
- zero point: word ``qzeros[g, n // pack]``, field ``n % pack``; GPTQ v1 stores ``zero - 1`` and is read
  as GPTQModel reads it, by adding ``0x11111111`` (4-bit) to the whole word (formats.gptq).
- ``W[n, k] = scales[g, n] * (q - zero)``: the difference is exact, the product is rounded once to the
  activation dtype (GPTQModel's TorchLinear; bf16 rounds an fp32 product).
- ``g = g_idx[k]``. Without act-order (``g_idx == k // group``) a K tile lies in one group and loads one
  row of scales and zeros; with act-order each row gathers its own group (no reordering of the weights).

Accumulation is fp32 on the tensor cores; the optional bias is added in fp32 before the final rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from repack.formats.errors import RepackError
from repack.formats.gptq import GptqLinear, GptqScheme, check_linear, trivial_g_idx
from repack.formats.stacks import ACTIVATION_DTYPES
from repack.runtime.kernels.common import TL_DTYPES


@triton.jit
def _gptq_linear_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    g_idx_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    group_len,
    stride_xm,
    stride_om,
    BITS: tl.constexpr,
    V1_ZEROS: tl.constexpr,
    ZERO_WORD_ADD: tl.constexpr,
    GATHER_GROUPS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for one [BLOCK_M, BLOCK_N] tile."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    n64 = offs_n.to(tl.int64)
    zero_cols = n64 // PACK
    zero_shift = (n64 % PACK) * BITS
    num_zero_words = N // PACK
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_idx = k0 + offs_k
        k_mask = k_idx < K
        a = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k_idx[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        tile_mask = k_mask[:, None] & n_mask[None, :]
        words = tl.load(qweight_ptr + (k_idx // PACK)[:, None].to(tl.int64) * N + n64[None, :], mask=tile_mask, other=0)
        q = (words >> ((k_idx % PACK) * BITS)[:, None]) & MASK
        if GATHER_GROUPS:
            groups = tl.load(g_idx_ptr + k_idx, mask=k_mask, other=0).to(tl.int64)
            scale = tl.load(scales_ptr + groups[:, None] * N + n64[None, :], mask=tile_mask, other=0.0)
            zero_words = tl.load(
                qzeros_ptr + groups[:, None] * num_zero_words + zero_cols[None, :], mask=tile_mask, other=0
            )
        else:
            group = k0 // group_len
            scale = tl.load(scales_ptr + group * N + n64, mask=n_mask, other=0.0)[None, :]
            zero_words = tl.load(qzeros_ptr + group * num_zero_words + zero_cols, mask=n_mask, other=0)[None, :]
        zero_words = zero_words.to(tl.int64) & 0xFFFFFFFF
        if V1_ZEROS:
            zero_words = zero_words + ZERO_WORD_ADD  # GPTQModel's word-level +1 (a borrow is undone exactly)
        zero = ((zero_words >> zero_shift[None, :]) & MASK).to(tl.int32)
        diff = q - zero  # exact
        if tl.float16 == ACT_DTYPE:
            w = diff.to(tl.float16) * scale  # one rounding, like fp16(scale * (q - zero))
        else:
            w = (diff.to(tl.float32) * scale.to(tl.float32)).to(ACT_DTYPE)
        acc = tl.dot(a, w, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(ACT_DTYPE), mask=m_mask[:, None] & n_mask[None, :])


def _word_add(bits: int) -> int:
    """+1 in every field of one int32 word: 0x11111111 for 4 bits, 0x01010101 for 8 bits."""
    return sum(1 << (bits * s) for s in range(32 // bits))


def _tile_shape(m: int, group_len: int, gather: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): the smallest M tile that holds the tokens, K tiles inside one group."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_k = 64 if gather else min(64, group_len)
    return block_m, 64, block_k


def is_trivial_g_idx(g_idx: torch.Tensor | None, in_features: int, scheme: GptqScheme) -> bool:
    """True when ``g_idx`` is absent or ``k // group``: then a K tile needs one row of scales and zeros."""
    if g_idx is None:
        return True
    expected = trivial_g_idx(in_features, scheme).to(g_idx.device)
    return bool(torch.equal(g_idx.to(torch.int32), expected))


def gptq_linear(
    x: torch.Tensor,
    linear: GptqLinear,
    scheme: GptqScheme,
    *,
    gather_groups: bool = True,
    name: str = "gptq linear",
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for ``x`` ``[..., K]`` in fp16/bf16, reading the GPTQ tensors as stored.

    ``gather_groups=False`` is the fast path for a trivial ``g_idx`` (see :func:`is_trivial_g_idx`).
    """
    if x.dtype not in ACTIVATION_DTYPES:
        raise RepackError(f"{name}: input dtype {x.dtype} is not supported; use torch.float16 or torch.bfloat16")
    k = linear.in_features(scheme)
    n = linear.out_features
    if x.shape[-1] != k:
        raise RepackError(f"{name}: input has {x.shape[-1]} features, the linear expects {k}; pass [..., {k}]")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    group_len = scheme.group_len(k)
    gather = gather_groups and linear.g_idx is not None
    block_m, block_n, block_k = _tile_shape(m, group_len, gather)
    if m:
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _gptq_linear_kernel[grid](
            rows,
            linear.qweight,
            linear.qzeros,
            linear.scales,
            linear.g_idx if gather else linear.qweight,
            linear.bias if linear.bias is not None else linear.scales,
            out,
            m,
            n,
            k,
            group_len,
            rows.stride(0),
            out.stride(0),
            BITS=scheme.bits,
            V1_ZEROS=scheme.checkpoint_format == "gptq",
            ZERO_WORD_ADD=_word_add(scheme.bits),
            GATHER_GROUPS=gather,
            HAS_BIAS=linear.bias is not None,
            ACT_DTYPE=TL_DTYPES[x.dtype],
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
        )
    return out.reshape(*x.shape[:-1], n)


class GptqW4A16Linear(nn.Module):
    """Drop-in for ``nn.Linear`` holding one GPTQ linear as stored; forward runs :func:`gptq_linear`.

    The tensors are buffers named like the checkpoint's (``qweight``, ``qzeros``, ``scales``, ``g_idx``,
    ``bias``) so ``state_dict`` keys match the file and ``.to(device)`` moves them. Nothing is dequantized.
    """

    def __init__(self, linear: GptqLinear, scheme: GptqScheme, name: str = "gptq linear") -> None:
        super().__init__()
        check_linear(name, linear, scheme)
        self.scheme = scheme
        self.name = name
        self.in_features = linear.in_features(scheme)
        self.out_features = linear.out_features
        self.register_buffer("qweight", linear.qweight)
        self.register_buffer("qzeros", linear.qzeros)
        self.register_buffer("scales", linear.scales)
        self.register_buffer("g_idx", linear.g_idx)
        self.register_buffer("bias", linear.bias)
        self.act_order = not is_trivial_g_idx(linear.g_idx, self.in_features, scheme)

    def stored(self) -> GptqLinear:
        """The buffers as a :class:`GptqLinear` (current device)."""
        return GptqLinear(self.qweight, self.qzeros, self.scales, self.g_idx, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gptq_linear(x, self.stored(), self.scheme, gather_groups=self.act_order, name=self.name)

    def extra_repr(self) -> str:
        s = self.scheme
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={s.bits}, "
            f"group_size={s.group_size}, sym={s.sym}, act_order={self.act_order}, bias={self.bias is not None}"
        )
