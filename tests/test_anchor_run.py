"""benchmarks/anchor_run.py's changes to the harness that can be checked without a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.anchor_run import fp16_where_it_fits

MODEL = SimpleNamespace(key="dsv3")


def test_a_model_whose_fp16_copies_do_not_fit_runs_without_that_variant(capsys):
    """The build that runs out of memory for triton_fp16's dequantized weights is redone without them, with a line,
    and the weights it returns build no such variant (make_variants looks for ``fp16``)."""
    asked = []

    def build(m, dtype, device, compile_only, which, cpu):
        asked.append(list(which))
        if "triton_fp16" in which:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.00 GiB.")
        return dict(project=[], marlin=[], fp16=[], R=2, R16=1)

    which = ["project", "marlin", "triton_fp16"]
    weights = fp16_where_it_fits(build)(MODEL, torch.float16, "cuda", False, which, False)
    assert asked == [["project", "marlin", "triton_fp16"], ["project", "marlin"]]
    assert "fp16" not in weights and weights["R"] == 2
    assert "dsv3: no GPU memory for triton_fp16" in capsys.readouterr().out


def test_running_out_of_memory_without_the_fp16_variant_still_fails():
    def build(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory.")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        fp16_where_it_fits(build)(MODEL, torch.float16, "cuda", False, ["project", "marlin"], False)
