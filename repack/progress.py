"""The one progress bar of long commands (convert, push's hashing): rich, on stderr, in bytes."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


def byte_progress(quiet: bool, *extra: ProgressColumn, transient: bool = False) -> Progress:
    """Description, bar, ``extra`` columns, bytes done/total, speed, time left; nothing when ``quiet``. A
    ``transient`` one leaves nothing behind (erased on a terminal, never printed elsewhere), so a command whose
    outcome is one line (``ok: ...`` or one ``error:``) prints just that line."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        *extra,
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=quiet,
        transient=transient,
    )
