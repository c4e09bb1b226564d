"""Which aten ops a piece of code dispatches: the loader must only allocate, fill and view."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

# The only tensor operations a load may perform: allocate the byte buffers, fill them (copy_ on a GPU),
# and take views of them. Anything else (cat, permute, to, contiguous...) would change or move data.
ALLOWED_OPS = {
    "empty.memory_format",
    "slice.Tensor",
    "view.dtype",
    "view.default",
    "copy_.default",
    "alias.default",
    "detach.default",
}  # detach: the numpy() view that file.readinto fills


class OpRecorder(TorchDispatchMode):
    """Records the name of every aten op dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(f"{func._schema.name.split('::')[-1]}.{func._overloadname}")
        return func(*args, **(kwargs or {}))
