"""What this process has done to the user's folders, for the one line an interrupt prints.

Kept apart from :mod:`repack.publish` (which loads ctypes and subprocess) so that the CLI, which reads it on every
Ctrl-C, pays nothing for it at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Outcome:
    """What this process has done to the user's folders: the one line an interrupt prints must be true in every
    window (before the swap, after it, after ``convert()`` returned, while pushing)."""

    published: Path | None = None  # an OUT this process made complete
    card: Path | None = None  # a model card it wrote into a folder
    uploading: tuple[str, Path] | None = None  # (repo id, folder) of an upload started and not finished

    def interrupted_line(self) -> str:
        """``error: interrupted; ...`` saying what was and was not written."""
        if self.published is not None:
            out = self.published
            line = f"error: interrupted after {out} was complete: it holds the new output (verify it with "
            line += f"`repack verify {out}`)"
        elif self.card is not None:
            line = f"error: interrupted; only the model card {self.card} was written"
        else:
            return "error: interrupted; nothing was written to the output folder"
        if self.uploading is not None:
            repo, folder = self.uploading
            line += f"; the upload to {repo} did not finish, `repack push {repo} {folder}` resumes it"
        return line


OUTCOME = Outcome()  # this process's; the CLI resets it for each command


def reset_outcome() -> None:
    OUTCOME.published = OUTCOME.card = OUTCOME.uploading = None
