"""Read back the dry-run plan (repack/plan_view.py): which line shows which output tensor."""

from __future__ import annotations


def tensor_lines(printed: str) -> dict[str, int]:
    """Full output tensor name -> index of its line: each tensor line holds the name less its layer heading's
    prefix ("layer 3 (model.layers.3.*)"), so the name is that prefix plus the line's first word."""
    shown: dict[str, int] = {}
    prefix = ""
    for number, line in enumerate(printed.splitlines()):
        if line.startswith("  ") and "[" in line and line.split():
            name = prefix + line.split()[0]
            assert name not in shown, f"{name} shown twice"
            shown[name] = number
        elif line.strip() and not line.startswith(" "):
            prefix = line.split(" (", 1)[1].rstrip().rstrip(")*") if line.rstrip().endswith("*)") else ""
    return shown
