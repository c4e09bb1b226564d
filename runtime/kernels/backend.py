"""Which backend the kernels run on: a CUDA GPU, or on the CPU the Triton interpreter (tests, no GPU). (Whether a
device runs the Gluon sm_90 kernels is theirs to say: runtime/kernels/gluon_sm90.py ``runs_on``.) And whether a
GPU lets each launch start before the kernel ahead of it ends (:func:`dependent_launch`).

Why a check: Triton decides at import whether its kernels are interpreted, so a CPU run whose triton was imported
without ``TRITON_INTERPRET=1`` dies deep inside Triton ("0 active drivers"); callers check first and say what to do.
This module is the one place the runtime switches the interpreter on (``load``, ``load_hf_model`` and the
``from_pretrained`` quantizer all call :func:`check_kernel_backend`).
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from repack.formats.errors import RepackError


def check_kernel_backend(device: torch.device, caller: str) -> None:
    """On the CPU the kernels can only run in the Triton interpreter; refuse early if it is off.

    When nothing has imported triton yet, ``TRITON_INTERPRET=1`` is set here so the kernels are defined
    for the interpreter; once triton is imported without it, only a new process can switch.
    """
    if device.type != "cpu":
        return
    if "triton" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if not interpreter_active():
        raise RepackError(
            f"{caller}: device='cpu' needs the Triton interpreter, but triton was imported without "
            "TRITON_INTERPRET=1; set TRITON_INTERPRET=1 before importing torch/triton, or use device='cuda'"
        )


def interpreter_active() -> bool:
    """True when the runtime's kernels were defined for the interpreter (imports them)."""
    from triton.runtime.interpreter import InterpretedFunction

    from repack.runtime.kernels import gptq_linear, gptq_order

    kernels = (gptq_order._w13_kernel, gptq_linear._gptq_linear_kernel)
    return all(isinstance(kernel, InterpretedFunction) for kernel in kernels)


DEPENDENT_LAUNCH_ENV = "REPACK_DEPENDENT_LAUNCH"  # "0": every launch waits for the one before to end


def dependent_launch(device: torch.device) -> bool:
    """Whether this call's kernels are launched as programmatic dependents of the kernel before each (Hopper and
    up, CUDA only, never interpreted): a kernel's programs are scheduled while the one before it still runs, do
    what needs nothing it writes (their weights' first loads, their setup), then wait for it to end
    (kernels/common.py ``await_previous_kernel``). Between the few-microsecond kernels of a decode step the launch
    gaps and each kernel's ramp are a third of the call: measured 2-3 us (up to 10%) off the whole call at M = 1-4,
    0.5-5% at 16-256, no change past the noise at M >= 1024 (benchmarks/KERNEL_NOTES.md item 34). On by default;
    ``$REPACK_DEPENDENT_LAUNCH=0`` turns it off."""
    return os.environ.get(DEPENDENT_LAUNCH_ENV, "1") != "0" and _launches_dependents(device)


@functools.cache
def _launches_dependents(device: torch.device) -> bool:
    """Whether ``device`` can (CUDA, Hopper and up, kernels not interpreted): asked once per device, not per launch
    (the environment switch stays live: the anchor's variants flip it between calls)."""
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and not interpreter_active()
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )
