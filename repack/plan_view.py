"""``repack convert --dry-run``: the plan as a table of one line per output tensor, readable at 80 columns.

Tensors are listed layer by layer under a heading that names the layer's prefix once, so each line carries the
part of the name that differs (``mlp.experts.w13_qweight``), then shape, dtype, size and where it comes from;
the source files copied, left behind and written follow, then the source tensors of each stack, the totals.
Every name is shown as text (:mod:`repack.display`), never as markup.
"""

from __future__ import annotations

from rich.console import Group
from rich.filesize import decimal
from rich.table import Table
from rich.text import Text

from repack.display import plain
from repack.formats.constants import INDEX_FILE, MANIFEST_FILE, SHARED
from repack.plan import ConvertLinear, CopyTensor, PackStack, Plan, Step
from repack.preflight import CONFIG_FILE

COLUMNS = ("tensor", "shape", "dtype", "size", "from")


def layer_prefix(names: list[str]) -> str:
    """The dotted prefix every name of a layer shares (``model.layers.3.``), or "" when they share none."""
    if len(names) < 2:  # a heading that names one tensor's own path would say nothing
        return ""
    first, *rest = names
    parts = first.split(".")[:-1]
    for name in rest:
        other = name.split(".")
        while parts and other[: len(parts)] != parts:
            parts.pop()
    return ".".join(parts) + "." if parts else ""


def _packed_from(stack: PackStack) -> str:
    """What a stack tensor is packed from: the layer's experts (or the shared expert's routed-size chunks)."""
    experts = stack.info.num_experts
    return f"{experts} chunk{'s' * (experts != 1)}" if stack.info.kind == SHARED else f"{experts} experts"


def _origins(step: Step) -> dict[str, tuple[str, str]]:
    """output tensor name -> (dtype, where it comes from)."""
    if isinstance(step, CopyTensor):
        return {step.name: (step.dtype, "copy")}
    if isinstance(step, ConvertLinear):  # a linear of an AWQ or compressed-tensors source, stored as GPTQ tensors
        return {tensor.name: (tensor.dtype, "as GPTQ") for tensor in step.planned_tensors()}
    origins = {
        name: (tensor.dtype, _packed_from(stack))
        for stack in step.stacks
        for name, tensor in ((t.name, t) for t in stack.planned_tensors())
    }
    for tensor in step.planned_tensors():
        if tensor.follows is not None:  # joined stacks: the shared tensor is stored right after its routed one
            dtype, origin = origins[tensor.name]
            origins[tensor.name] = (dtype, f"{origin}, joined")
    return origins


def _table(rows: list[tuple[str, ...]]) -> Table:
    """Every column as wide as its longest cell except the tensor's, which alone gives way on a narrow terminal."""
    widths = [max([len(row[i]) for row in rows if len(row) > i] + [len(title)]) for i, title in enumerate(COLUMNS)]
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold", padding=(0, 1, 0, 0))
    table.add_column(COLUMNS[0], no_wrap=True, overflow="ellipsis", ratio=1, min_width=16)
    for title, width in zip(COLUMNS[1:], widths[1:], strict=True):
        table.add_column(title, no_wrap=True, min_width=width, justify="right" if title == "size" else "left")
    return table


def describe_plan(plan: Plan) -> Group:
    """Title, one line per output tensor (under one heading per layer), the files, what each stack is stacked
    from, then the totals."""
    rows: list[tuple[str, ...]] = []  # a heading is a row of one cell
    tensors = 0
    for group in plan.groups:
        layer = []
        for step in group.steps:
            origins = _origins(step)
            for tensor in step.planned_tensors():
                dtype, origin = origins[tensor.name]
                layer.append((tensor.name, str(list(tensor.shape)), dtype, decimal(tensor.nbytes), origin))
        prefix = layer_prefix([row[0] for row in layer])
        rows.append((f"{group.label} ({prefix}*)" if prefix else group.label,))
        rows.extend(("  " + name.removeprefix(prefix), *rest) for name, *rest in layer)
        tensors += len(layer)
    rows.append(("files",))
    for copied in plan.files_to_copy:
        size = decimal((plan.source.path / copied.source).stat().st_size)
        rows.append(
            ("  " + copied.output, "", "", size, "copy" if copied.output == copied.source else "copy (renamed)")
        )
    rows.extend(("  " + name, "", "", "", "not copied") for name in plan.files_left_behind)
    rows.append(("  " + CONFIG_FILE, "", "", "", "rewritten"))
    rows.extend(("  " + name, "", "", "", "written") for name in (INDEX_FILE, MANIFEST_FILE))
    table = _table(rows)
    for row in rows:
        table.add_row(*(plain(cell, style="bold" if len(row) == 1 else "") for cell in row))
    sources = [Text("stacked from (stack <- source tensors: first .. last)", style="bold")]
    for group in plan.groups:
        for step in group.steps:
            for stack in [] if isinstance(step, CopyTensor | ConvertLinear) else step.stacks:
                modules = stack.info.source_modules
                block = stack.info.prefix.rpartition(".")[0] + "."
                first, last = (name.removeprefix(block) for name in (modules[0][0], modules[-1][-1]))
                last = last.removeprefix(layer_prefix([first + ".x", last + ".x"]))  # the part that differs
                line = f"  {stack.info.prefix} <- {len(stack.sources)}: {first} .. {last}"
                sources.append(plain(line))
    stacks = plan.stacks
    fmt = plan.source_format.describe()
    title = Text.assemble("repack plan: ", plain(plan.source.label), f" ({plan.family}, {fmt})", style="bold")
    totals = (
        f"{tensors} tensors, {decimal(plan.output_bytes)} of weights; {len(stacks)} stacks "
        f"({sum(s.num_experts for s in stacks)} stacked experts), {len(plan.files_to_copy)} files copied"
    )
    note = "(--include GLOB copies a file not copied; --exclude GLOB leaves one out)" if plan.files_left_behind else ""
    return Group(title, table, *(sources if len(sources) > 1 else []), Text(totals), Text(note))
