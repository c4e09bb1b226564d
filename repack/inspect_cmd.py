"""``repack inspect OUT``: what a converted checkpoint holds, as rich tables (no tensor data read).

Every value comes from the checkpoint's files, so each cell is literal text (:mod:`repack.display`), never markup."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from rich.console import Group
from rich.filesize import decimal
from rich.table import Table

from repack.display import architecture_names, plain
from repack.formats.checkpoint import read_repack_config
from repack.formats.manifest import Manifest
from repack.formats.stacks import StackInfo


def _word_orders(stacks: list[StackInfo]) -> str:
    """How many stacks use each qweight word order (a kernel needs to know; a v1 checkpoint is all "gptq")."""
    counts = Counter(s.word_order for s in stacks)
    return ", ".join(f"{order} ({n} stack{'s' * (n != 1)})" for order, n in sorted(counts.items())) or "-"


def inspect_output(out: str | Path) -> Group:
    """Summary table (format, model, provenance, sizes) and one row per expert stack."""
    out = Path(out)
    config, stacks = read_repack_config(out)
    quant = config["quantization_config"]
    manifest = Manifest.read(out)
    source = manifest.source

    summary = Table(title=plain(out), show_header=False)
    summary.add_column("key", style="bold")
    summary.add_column("value", overflow="fold")
    rows = [
        ("format", f"{quant.get('format')} v{quant.get('format_version')}"),
        ("architecture", f"{config.get('model_type')} ({', '.join(architecture_names(config))})"),
        ("layers", str(config.get("num_hidden_layers"))),
        ("MoE layers", str(len({s.prefix.rsplit(".", 1)[0] for s in stacks}))),
        ("stacks", f"{len(stacks)} ({sum(s.num_experts for s in stacks)} stacked experts)"),
        ("quantization", f"{quant.get('bits')}-bit, group {quant.get('group_size')}, sym={quant.get('sym')}"),
        ("word order", _word_orders(stacks)),
        ("source", source.repo_id or (f"local folder {source.path}" if source.path else "?")),
        ("base model", source.base_model or "-"),
        ("revision", source.revision or "-"),
        ("converter", manifest.converter_version),
        ("created", manifest.created or "?"),
        ("size", f"{decimal(manifest.output_bytes)} in {len(manifest.output_files)} files"),
    ]
    for key, value in rows:
        summary.add_row(key, plain(value))

    table = Table(title="expert stacks")
    for column in ("prefix", "kind", "E", "H", "I", "bits", "group", "sym", "zeros", "act-order w13/w2"):
        table.add_column(column, overflow="fold")
    for s in stacks:
        cells = (s.prefix, s.kind, s.num_experts, s.hidden_size, s.intermediate_size, s.bits, s.group_size, s.sym)
        table.add_row(*map(plain, cells), plain(s.checkpoint_format), plain(f"{s.act_order_w13}/{s.act_order_w2}"))
    return Group(summary, table)
