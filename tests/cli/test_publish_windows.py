"""The end of a conversion, through the real entry point (issue 22, items 14, 16 and 23): a write that fails at a
shard's last block is one line, the line an interrupt prints is true in every window of the publish and of the
push after it, and nothing of the old output outlives a run killed after the swap."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import pytest

from repack.convert import convert
from repack.formats.constants import MANIFEST_FILE
from repack.verify import verify
from tests.support.entry_point import error_line, run_repack, run_repack_after
from tests.support.fixtures import FIXTURES_DIR

SYM = FIXTURES_DIR / "qwen2moe-g128-sym"
SHARD = "model-00001-of-00001.safetensors"  # the fixture converts into one shard


def conversion_id(out: Path) -> str:
    return json.loads((out / MANIFEST_FILE).read_text())["conversion_id"]


def leftovers(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name != "out")


def wait_until_clean(folder: Path, timeout: float = 30.0) -> list[str]:
    """What is left next to OUT once the run's janitor (repack.publish.Janitor) has had its time."""
    deadline = time.monotonic() + timeout
    while leftovers(folder) and time.monotonic() < deadline:
        time.sleep(0.1)
    return leftovers(folder)


@pytest.fixture(scope="module")
def shard_bytes(tmp_path_factory) -> int:
    out = tmp_path_factory.mktemp("size") / "out"
    convert(str(SYM), out, quiet=True)
    return (out / SHARD).stat().st_size


def test_file_size_limit_at_a_shards_last_block_is_one_line(tmp_path, shard_bytes):
    """``ulimit -f`` one byte short of the shard: the last (buffered) write fails, not the O_DIRECT ones."""
    limit = shard_bytes - 1

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = tmp_path / "out"
    result = run_repack("convert", SYM, out, "--quiet", preexec_fn=limited)
    error_line(result, "cannot write", SHARD, "ulimit -f", code=1)
    assert not out.exists() and wait_until_clean(tmp_path) == []


FULL_DISK = """
import errno, os
real_write, room = os.write, {room}
def write(fd, data):
    global room
    if len(data) > room:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    room -= len(data)
    return real_write(fd, data)
os.write = write
"""


def test_full_disk_at_a_shards_last_block_is_one_line(tmp_path, shard_bytes):
    out = tmp_path / "out"
    result = run_repack_after(FULL_DISK.format(room=shard_bytes - 1), "convert", SYM, out, "--quiet")
    error_line(result, "disk full writing", SHARD, code=1)
    assert not out.exists() and wait_until_clean(tmp_path) == []


def first_conversion(tmp_path: Path) -> tuple[Path, str]:
    """The output a test then replaces (made in-process: only the step under test pays for a subprocess)."""
    out = tmp_path / "out"
    convert(str(SYM), out, quiet=True)
    return out, conversion_id(out)


CTRL_C_TWICE_WHILE_THE_OLD_TREE_GOES = """
import repack.convert, repack.publish
def interrupted(*args):
    raise KeyboardInterrupt
repack.convert.remove_tree = interrupted
repack.publish.Janitor.finish = lambda self, real=repack.publish.Janitor.finish: (real(self), interrupted())
"""
CTRL_C_AFTER_CONVERT_RETURNED = """
import repack.convert
real = repack.convert.convert
def convert_then_interrupted(*args, **kwargs):
    real(*args, **kwargs)
    raise KeyboardInterrupt
repack.convert.convert = convert_then_interrupted
"""


@pytest.mark.parametrize(
    "window", [CTRL_C_TWICE_WHILE_THE_OLD_TREE_GOES, CTRL_C_AFTER_CONVERT_RETURNED], ids=["deleting-old", "returned"]
)
def test_ctrl_c_after_the_swap_never_says_nothing_was_written(tmp_path, window):
    out, first = first_conversion(tmp_path)
    result = run_repack_after(window, "convert", SYM, out, "--quiet", "--force")
    line = error_line(result, f"interrupted after {out} was complete", "repack verify", code=130)
    assert "nothing was written" not in line
    assert conversion_id(out) != first and verify(out, quiet=True).files_checked
    assert wait_until_clean(tmp_path) == []  # the old tree went all the same


PUSH_INTERRUPTED = """
import repack.push
repack.push.check_hub_access = lambda repo, **kwargs: repack.push.HubAccess("token", "me", ())
class Hub:
    def create_repo(self, *args, **kwargs):
        raise KeyboardInterrupt
repack.push.HfApi = Hub
"""


def test_ctrl_c_during_convert_push_says_out_is_complete_and_how_to_resume(tmp_path):
    out = tmp_path / "out"
    result = run_repack_after(PUSH_INTERRUPTED, "convert", SYM, out, "--quiet", "--push", "me/tiny")
    line = error_line(result, f"interrupted after {out} was complete", "me/tiny did not finish", code=130)
    assert f"repack push me/tiny {out}" in line
    assert verify(out, quiet=True).files_checked


def test_ctrl_c_during_a_push_names_the_card_it_wrote(tmp_path):
    out, _ = first_conversion(tmp_path)
    result = run_repack_after(PUSH_INTERRUPTED, "push", "me/tiny", out, "--quiet")
    error_line(result, f"only the model card {out / 'README.md'} was written", "did not finish", code=130)
    assert (out / "README.md").is_file()


KILLED_AFTER_THE_SWAP = """
import os, signal, repack.convert
repack.convert.remove_tree = lambda path: os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_kill_after_the_swap_leaves_no_old_output_behind(tmp_path):
    out, first = first_conversion(tmp_path)
    result = run_repack_after(KILLED_AFTER_THE_SWAP, "convert", SYM, out, "--quiet", "--force")
    assert result.returncode == -9
    assert conversion_id(out) != first  # the swap was done
    assert wait_until_clean(tmp_path) == []  # and the old tree did not wait for the next convert


def test_force_over_a_symlinked_out_is_refused_before_any_work_and_leaves_nothing(tmp_path):
    """A link as OUT would be swapped out (the link replaced, its target kept, the link left behind under the temp
    name for good): refused before converting (repack.preflight), so neither the link nor its target changes."""
    (tmp_path / "elsewhere").mkdir()
    target, first = first_conversion(tmp_path / "elsewhere")
    link = tmp_path / "out"
    link.symlink_to(target, target_is_directory=True)
    error_line(run_repack("convert", SYM, link, "--quiet", "--force"), "is a link", code=1)
    assert link.is_symlink() and conversion_id(target) == first
    assert wait_until_clean(tmp_path) == ["elsewhere"]


def test_a_stale_temp_that_is_a_link_is_unlinked_and_its_target_kept(tmp_path):
    """What --force over a link left behind before it was refused: the next run removes the link, not its target."""
    (tmp_path / "elsewhere").mkdir()
    target, first = first_conversion(tmp_path / "elsewhere")
    (tmp_path / ".out.tmp-99999").symlink_to(target, target_is_directory=True)
    convert(str(SYM), tmp_path / "out", quiet=True)
    assert wait_until_clean(tmp_path) == ["elsewhere"] and conversion_id(target) == first
