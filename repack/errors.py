"""The one exception type the CLI turns into a single line and a non-zero exit code."""

from __future__ import annotations


class RepackError(Exception):
    """A problem with the user's input or environment, phrased as: what, where, what to do.

    The CLI prints ``str(error)`` on one line and exits with ``exit_code``; it never shows a traceback.
    """

    exit_code = 1

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
