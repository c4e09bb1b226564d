"""``python -m repack.janitor OUT``: what :class:`repack.publish.Janitor` starts beside a conversion.

It reads its stdin until the converter's end of the pipe closes (the converter finished, failed or was killed),
then removes what no live run holds any more: the temp folder, the old tree a ``--force`` swap left behind, or
(a swap cut short) puts the old OUT back. Torch-free and quick to start.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from repack.publish import remove_stale_temps


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the converter's Ctrl-C is not for us
    out = Path(argv[1])
    sys.stdin.buffer.read()  # returns once no process holds the pipe's write end
    remove_stale_temps(out)


if __name__ == "__main__":
    main(sys.argv)
