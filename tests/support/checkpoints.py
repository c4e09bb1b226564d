"""Converted checkpoints for the runtime tests, and how far a result is from its reference."""

from __future__ import annotations

from pathlib import Path

import torch


def convert_fixture(source: Path, out: Path, shard_size: int | str = "5GB") -> Path:
    """Convert with the project's converter (its Python API), quietly; returns OUT."""
    from repack.convert import convert

    convert(str(source), out, shard_size=shard_size, quiet=True)
    return out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float32."""
    expected = expected.float()
    return float((actual.float() - expected).abs().max() / expected.abs().max())
