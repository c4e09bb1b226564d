"""Publishing OUT: durable (fsync), atomic (no moment without OUT), never over another run's output, honest on
Ctrl-C, and no leftovers next to OUT (issue 13, items 5, 6, 7, 13)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from repack import publish as publish_module
from repack.formats.stacks import MANIFEST_FILE
from tests.support.cli import assert_one_line_error, run_cli
from tests.support.fixtures import FIXTURES_DIR

SYM = FIXTURES_DIR / "qwen2moe-g128-sym"


def converted(out: Path, *extra: str) -> None:
    result = run_cli("convert", SYM, out, "--quiet", *extra)
    assert result.exit_code == 0, result.output


def test_out_appearing_during_the_run_is_not_replaced_without_force(tmp_path, monkeypatch):
    """Another run publishes OUT (even an empty folder) while this one converts: this one fails, OUT is kept."""
    out = tmp_path / "out"
    real_fsync_tree = publish_module.fsync_tree

    def other_run_publishes_first(folder: Path) -> None:
        real_fsync_tree(folder)
        out.mkdir()
        (out / "theirs.txt").write_text("the other run's output")

    monkeypatch.setattr(publish_module, "fsync_tree", other_run_publishes_first)
    line = assert_one_line_error(run_cli("convert", SYM, out, "--quiet"), "appeared while converting", "--force")
    assert str(out) in line
    assert sorted(p.name for p in out.iterdir()) == ["theirs.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # our temp folder is gone


def test_empty_out_appearing_during_the_run_is_not_replaced_either(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(publish_module, "fsync_tree", lambda folder: out.mkdir())
    rmdir = Path.rmdir
    monkeypatch.setattr(Path, "rmdir", lambda self: None if self == out else rmdir(self))  # it appears after the check
    assert_one_line_error(run_cli("convert", SYM, out, "--quiet"), "appeared while converting")
    assert out.is_dir() and not any(out.iterdir())


def test_rename_noreplace_refuses_an_existing_empty_folder(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(FileExistsError):
        publish_module.rename_noreplace(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "a").is_dir()


@pytest.mark.skipif(publish_module._RENAMEAT2 is None, reason="needs Linux renameat2")
def test_force_swaps_out_in_one_step_and_leaves_nothing_behind(tmp_path, monkeypatch):
    """--force exchanges the trees atomically (never two renames that leave OUT missing) and deletes the old one."""
    out = tmp_path / "out"
    converted(out)
    (out / "old-marker").write_text("old")

    def no_plain_rename(*args, **kwargs):
        raise AssertionError("OUT must be swapped with renameat2(RENAME_EXCHANGE), not moved away and back")

    monkeypatch.setattr(Path, "rename", no_plain_rename)
    monkeypatch.setattr(os, "rename", no_plain_rename)
    converted(out, "--force")
    assert (out / MANIFEST_FILE).is_file() and not (out / "old-marker").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_publish_fsyncs_every_file_and_folder_before_the_rename_and_the_parent_after(tmp_path, monkeypatch):
    out = tmp_path / "out"
    events: list[tuple[str, str]] = []
    real_fsync, real_noreplace = os.fsync, publish_module.rename_noreplace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename_noreplace(src: Path, dst: Path) -> None:
        events.append(("rename", str(src)))
        real_noreplace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(publish_module, "rename_noreplace", rename_noreplace)
    converted(out)
    renamed = next(i for i, (kind, _) in enumerate(events) if kind == "rename")
    temp = events[renamed][1]
    synced_before = {Path(path).relative_to(temp).as_posix() for _, path in events[:renamed] if path.startswith(temp)}
    written = {p.relative_to(out).as_posix() for p in out.rglob("*")} | {"."}
    assert written <= synced_before
    assert ("fsync", str(tmp_path)) in events[renamed:]


def test_interrupt_during_the_swap_says_out_holds_the_new_output(tmp_path, monkeypatch):
    """Ctrl-C while publishing: held back until OUT is complete, then reported as what is true."""
    out = tmp_path / "out"
    converted(out)
    real_exchange = publish_module.exchange

    def interrupted_exchange(a: Path, b: Path) -> bool:
        os.kill(os.getpid(), signal.SIGINT)  # arrives in the middle of the swap
        return real_exchange(a, b)

    monkeypatch.setattr(publish_module, "exchange", interrupted_exchange)
    result = run_cli("convert", SYM, out, "--quiet", "--force")
    line = assert_one_line_error(result, "interrupted after", "holds the new output")
    assert "nothing was written" not in line
    assert result.exit_code == 130
    assert (out / MANIFEST_FILE).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_stale_folder_of_a_reused_pid_is_still_cleaned_up(tmp_path):
    """A leftover named after a live PID (here: ours) that no run holds is stale: the old OUT comes back."""
    out = tmp_path / "out"
    converted(out)
    parked = tmp_path / f".out.old-{os.getpid()}"
    out.rename(parked)
    (tmp_path / f".out.tmp-{os.getpid()}").mkdir()
    assert_one_line_error(run_cli("convert", SYM, out, "--quiet"), "exists and is not empty")
    assert (out / MANIFEST_FILE).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_live_runs_work_folder_is_left_alone(tmp_path):
    out = tmp_path / "out"
    live = publish_module.WorkFolder(tmp_path / ".out.tmp-1")
    try:
        converted(out)
        assert live.path.is_dir()
    finally:
        live.close()


def test_the_janitor_waits_out_a_lock_that_outlives_the_pipe(tmp_path):
    """A killed converter's pipe may close a moment before its work folder's lock does (the kernel closes its files
    one by one): the janitor (repack.janitor) retries, so the folder goes once the lock is released; a folder still
    locked after its SETTLE_SECONDS is left to the run holding it."""
    import subprocess
    import sys
    import time

    from repack.janitor import SETTLE_SECONDS

    out = tmp_path / "out"
    held, kept = publish_module.WorkFolder(tmp_path / ".out.tmp-1"), publish_module.WorkFolder(tmp_path / ".out.tmp-2")
    janitor = subprocess.Popen([sys.executable, "-m", "repack.janitor", str(out)], stdin=subprocess.PIPE)
    janitor.stdin.close()  # the converter's end of the pipe is gone, its lock not yet
    time.sleep(0.5)
    assert held.path.is_dir()
    held.close()  # now the lock goes too
    deadline = time.monotonic() + 30
    while held.path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not held.path.exists()
    assert janitor.wait(timeout=SETTLE_SECONDS + 30) == 0
    assert kept.path.is_dir()  # a live run's folder: never taken
    kept.close()
