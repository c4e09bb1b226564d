"""Text that comes from a checkpoint (tensor, file and folder names, config values), as the terminal shows it.

Why: rich reads ``[...]`` in a printed string as markup, so a tensor named ``x[/]`` stops a command with a
``MarkupError`` and one named ``x[bold red]`` or ``[link=...]`` changes what the user sees. Names are therefore
always handed to rich as :class:`rich.text.Text` (never parsed), with control characters escaped.
"""

from __future__ import annotations

from rich.text import Text

from repack.formats.errors import printable


def plain(value: object, style: str = "") -> Text:
    """``value`` as literal text: no markup, no terminal control characters."""
    return Text(printable(str(value)), style=style)


def architecture_names(config: dict) -> list[str]:
    """config.json's ``architectures`` as names, whatever the file holds (a list of strings, one string, a
    number...); ``model_type`` when it has none."""
    value = config.get("architectures")
    if isinstance(value, list):
        names = [str(name) for name in value]
    elif value is None:
        names = []
    else:
        names = [str(value)]
    return names or [str(config.get("model_type", "unknown"))]
