"""Jit and host helpers the kernel families share (public inside runtime/kernels/; each family's own helpers
stay private to its module). Dimension letters: runtime/kernels/__init__.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repack.runtime.kernel_config import fit_config

TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}  # activation dtype -> Triton's


@triton.jit
def expert_of(topk_ids_ptr, pair, num_experts):
    """The pair's expert, clamped into the stack: a bad id (NaN router logits) must not read past the weights."""
    return tl.minimum(tl.maximum(tl.load(topk_ids_ptr + pair), 0), num_experts - 1).to(tl.int64)


@triton.jit
def word_mask(n_mask, offs_w, first_word, k_words, EVEN_K: tl.constexpr):
    """Rows in range, and (only when K is not a multiple of BLOCK_K) words in range: a mask that varies
    along the words would split the 16-byte loads into single words."""
    if EVEN_K:
        return tl.broadcast_to(n_mask[:, None], (n_mask.shape[0], offs_w.shape[0]))
    return n_mask[:, None] & (first_word + offs_w < k_words)[None, :]


@triton.jit
def quant_params(
    scale_ptrs,
    zero_ptrs,  # [BLOCK_N] row pointers of group 0
    group,
    stride_s_g,
    n_mask,
    HAS_ZEROS: tl.constexpr,
    SYM_ZERO: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """(scale as stored [BLOCK_N], zero int32 [BLOCK_N]) of one group: the stored zero, or 2^(bits-1) when
    the stack is symmetric and stores none."""
    scale = tl.load(scale_ptrs + group * stride_s_g, mask=n_mask, other=0.0)
    if HAS_ZEROS:
        zero = tl.load(zero_ptrs + group * stride_s_g, mask=n_mask, other=0).to(tl.int32)
    else:
        zero = tl.full((BLOCK_N,), SYM_ZERO, tl.int32)
    return scale, zero


@triton.jit
def block_rows(pid_m, sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """(pair index of each row [BLOCK_M], row mask, expert) of aligned row block ``pid_m`` (kernels/align.py)."""
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return pairs, pairs < num_pairs, tl.load(block_experts_ptr + pid_m).to(tl.int64)


@triton.jit
def tile_ids(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row blocks share each weight tile while it is hot in L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


def launch_tiles(kernel, row_blocks: int, n: int, meta: dict, device: torch.device, /, **args) -> None:
    """Launch ``kernel`` over (row blocks x N tiles) with meta-parameters that fit the device's shared memory
    (shrunk at run time if they do not: kernel_config.fit_config; the grid follows the fitted BLOCK_N)."""

    def launch(fitted: dict) -> None:
        kernel[(row_blocks * triton.cdiv(n, fitted["BLOCK_N"]),)](**args, **fitted)

    fit_config(meta, device, launch, kernel.fn.__name__)


def projection_args(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> dict:
    """One projection's stored tensors as the kernels take them: ``qw_ptr``, ``scales_ptr``, ``zeros_ptr`` (any
    tensor for a symmetric stack, whose HAS_ZEROS is off) and their expert and row strides.

    ``qweight`` [E, N, K/VALS] (int32, or a narrower view of it), ``scales`` and ``zeros`` [E, G, N]."""
    return dict(
        qw_ptr=qweight,
        scales_ptr=scales,
        zeros_ptr=zeros if zeros is not None else scales,
        stride_qw_e=qweight.stride(0),
        stride_qw_n=qweight.stride(1),
        stride_s_e=scales.stride(0),
        stride_s_g=scales.stride(1),
    )
