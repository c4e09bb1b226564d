"""The one error base of the format and the runtime: library callers catch it as ``ValueError``.

Every problem with a checkpoint, a config or a call's arguments is raised as :class:`RepackError` (or a
subclass), phrased as one line: what, where, what to do. Serving stacks that guard a call with
``except ValueError`` catch it; the CLI prints ``str(error)`` on one line and exits with ``exit_code``.
"""

from __future__ import annotations


class RepackError(ValueError):
    """A problem with the user's input or environment, phrased as: what, where, what to do."""

    exit_code = 1

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\x1b``, ``\\ud800``): names from a file must not
    drive the user's terminal or break the one-line error."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)
