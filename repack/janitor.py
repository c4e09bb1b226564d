"""``python -m repack.janitor OUT``: what :class:`repack.publish.Janitor` starts beside a conversion.

It reads its stdin until the converter's end of the pipe closes (the converter finished, failed or was killed),
then removes what no live run holds any more: the temp folder, the old tree a ``--force`` swap left behind, or
(a swap cut short) puts the old OUT back. Torch-free and quick to start.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from repack.publish import remove_stale_temps

# A killed converter's files close one by one: its end of the pipe may close (waking this process) a moment before
# its work folder's lock is released, and a folder still locked is not stale. So the removal is retried while
# anything is left, this long at most (a folder another live run holds stays locked: it is left to that run).
SETTLE_SECONDS = 5.0


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the converter's Ctrl-C is not for us
    out = Path(argv[1])
    sys.stdin.buffer.read()  # returns once no process holds the pipe's write end
    deadline = time.monotonic() + SETTLE_SECONDS
    while remove_stale_temps(out) and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv)
