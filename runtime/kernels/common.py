"""Jit and host helpers the kernel families share (public inside runtime/kernels/; each family's own helpers
stay private to its module). Dimension letters: runtime/kernels/__init__.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repack.runtime.kernel_config import fit_config
from repack.runtime.kernels.backend import dependent_launch

TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}  # activation dtype -> Triton's


def dependent_launches(device: torch.device) -> dict:
    """A launch's keywords for :func:`await_previous_kernel`'s constexpr and Triton's launch option: a dependent
    launch where backend.dependent_launch says so."""
    dependent = dependent_launch(device)
    return dict(DEPENDENT=dependent, launch_pdl=dependent)


@triton.jit
def await_previous_kernel(DEPENDENT: tl.constexpr):
    """A dependent launch (backend.dependent_launch) waits here until the kernel before it has ended and its writes
    are visible: before its first read of anything a kernel before it wrote, and before its first write (the
    memory may still be read by it); weights and the launch's own arguments may be read before. Then lets the
    kernel after it be scheduled: its programs take the SM room this one's finished programs leave."""
    wait_for_previous_kernel(DEPENDENT)
    release_dependents(DEPENDENT)


@triton.jit
def release_dependents(DEPENDENT: tl.constexpr):
    """A dependent launch lets the kernel after it be scheduled now, before it waits for the one before it (a
    kernel that reads nothing the one before wrote until late: kernels/decode_mma.py's routed w13)."""
    if DEPENDENT:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_previous_kernel(DEPENDENT: tl.constexpr):
    """The wait half of :func:`await_previous_kernel`, for a kernel that released its dependents earlier."""
    if DEPENDENT:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pair_value(ptr, pair, FROM_L2: tl.constexpr = False):
    """``ptr[pair]``; FROM_L2: read past the SM's L1 (``.cg``), for a dependent launch reading what a kernel two
    launches back wrote before it waits (that kernel had ended when the one between them passed its own wait)."""
    if FROM_L2:
        value = tl.load(ptr + pair, cache_modifier=".cg")
    else:
        value = tl.load(ptr + pair)
    return value


@triton.jit
def expert_of(topk_ids_ptr, pair, num_experts, FROM_L2: tl.constexpr = False):
    """The pair's expert (:func:`pair_value`), clamped into the stack: a bad id (NaN router logits) must not read
    past the weights."""
    return clamp_expert(pair_value(topk_ids_ptr, pair, FROM_L2), num_experts)


@triton.jit
def routing_weight(topk_weights_ptr, pair, FROM_L2: tl.constexpr = False):
    """The pair's routing weight in fp32 (:func:`pair_value`), loaded at the top of a w2 program (with ``FROM_L2``
    before its dependent-launch wait): loaded after the K loop it put one more L2 round trip on the end of every
    program's chain, before the top-k sum's atomics (sm_90 SASS, KERNEL_NOTES.md item 41)."""
    return pair_value(topk_weights_ptr, pair, FROM_L2).to(tl.float32)


@triton.jit
def clamp_expert(expert, num_experts):
    """An expert id clamped into [0, E), as int64 (an offset into the stack)."""
    return tl.minimum(tl.maximum(expert, 0), num_experts - 1).to(tl.int64)


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


def word_strides(qweight: torch.Tensor, tiled: bool, block_k: int = 128, bits: int = 4) -> tuple[int, int, int, int]:
    """Where weight row ``n``'s words of K step ``j`` start, for kernels that step ``block_k`` inputs at a time:
    ``(n // 64) * stride_qw_band + (n % 64) * stride_qw_row + j * stride_qw_step`` (+ the expert's
    ``stride_qw_e``) int32 words, in every stored order (formats/SPEC.md section 3).

    Row-major words ``[E, N, K/pack]`` ("gptq", "mma128"): a band of 64 rows is 64 row strides and a step
    ``block_k / pack`` words. Tiles ``[E, N/64, K/128, 64, 16]`` ("mma128_tiles", ``tiled``): the tensor's own strides,
    and a step is one 128-input block (the only ``block_k`` they allow). Returned as (expert, band, row, step)."""
    if tiled:
        if block_k != 128:
            raise ValueError(f"word_strides: tiled words step 128 inputs, not {block_k}")
        return qweight.stride(0), qweight.stride(1), qweight.stride(3), qweight.stride(2)
    return qweight.stride(0), 64 * qweight.stride(1), qweight.stride(1), block_k * bits // 32


@triton.jit
def word_rows(rows, stride_band, stride_row):
    """int64 word offset of each weight row ``rows`` from its expert's first word (see :func:`word_strides`)."""
    rows = rows.to(tl.int64)
    return rows // 64 * stride_band + rows % 64 * stride_row


def quant_args(scales: torch.Tensor, zeros: torch.Tensor | None) -> dict:
    """A projection's ``scales_ptr`` and ``zeros_ptr`` (any tensor for a symmetric stack, whose HAS_ZEROS is off),
    ``[E, G, N]`` each, with their expert and group strides."""
    return dict(
        scales_ptr=scales,
        zeros_ptr=zeros if zeros is not None else scales,
        stride_s_e=scales.stride(0),
        stride_s_g=scales.stride(1),
    )


def projection_args(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, tiled: bool,
                    block_k: int = 128, bits: int = 4) -> dict:  # fmt: skip
    """One projection's stored tensors as the kernels take them: ``qw_ptr`` and the words' strides
    (:func:`word_strides`: ``tiled`` words, K steps of ``block_k`` inputs), and :func:`quant_args`.

    ``qweight`` [E, N, K/VALS] int32 (or a narrower view of it) or its tiles."""
    names = ("stride_qw_e", "stride_qw_band", "stride_qw_row", "stride_qw_step")
    strides = dict(zip(names, word_strides(qweight, tiled, block_k, bits), strict=True))
    return dict(qw_ptr=qweight, **strides, **quant_args(scales, zeros))
