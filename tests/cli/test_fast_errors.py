"""Errors that need no tensor answer at once, through the real `repack` script: one line, under half a second, torch
never imported (a missing or wrong folder, an existing output, a bad option, and what a config alone decides: a
source that is not JSON, not quantized, of another format or scheme or architecture; a folder not converted yet or
of a newer format version; a manifest that is not ours); and outputs that could never be published (a link, a
mount point, an unwritable folder) are refused before any work, with nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from repack.convert import SLOW_LAYER_ENV, convert
from repack.formats.constants import MANIFEST_FILE
from repack.formats.errors import RepackError
from repack.formats.manifest import SELF_CHECKSUM
from tests.support.entry_point import REPACK, error_line, imported_modules, run_repack
from tests.support.fixtures import FIXTURES_DIR

SRC = FIXTURES_DIR / "qwen3moe-g128-sym"
CT = FIXTURES_DIR / "ct-qwen3moe-g128-sym"  # no quantize_config.json beside its config.json
AWQ = FIXTURES_DIR / "awq-qwen3moe-g64-sym"
NOT_A_FOLDER = "no such folder; pass the output folder of `repack convert`"
NOT_CONVERTED = "not a repack-moe checkpoint (quant_method 'gptq'); convert it first with `repack convert`"


def quant(**values):
    return lambda config: config["quantization_config"].update(values)


# Sources whose config.json alone says they cannot be converted: name -> (fixture, edit of config.json, the line).
SOURCE_CONFIGS = {
    "not-json": (SRC, '{"model_type": "qwen3_moe",', "config.json: not valid JSON"),
    "not-quantized": (CT, lambda config: config.pop("quantization_config"), "this is not a quantized checkpoint"),
    "other-method": (SRC, quant(quant_method="bitsandbytes"), "quant_method is 'bitsandbytes'; supported source"),
    "gptq-3-bit": (SRC, quant(bits=3), "3-bit GPTQ is not supported"),
    "awq-gemv": (AWQ, quant(version="gemv", format="gemv", checkpoint_format="gemv"), "AWQ version 'gemv'"),
    "ct-not-compressed": (CT, quant(quantization_status="frozen"), "quantization_status is 'frozen'"),
    "llama": (SRC, lambda config: config.update(model_type="llama"), "unsupported architecture model_type='llama'"),
}


def edited_copy(fixture: Path, folder: Path, edit) -> Path:
    """A copy of ``fixture`` whose config.json ``edit`` rewrote (new text, or a change to the parsed object)."""
    shutil.copytree(fixture, folder)
    path = folder / "config.json"
    if isinstance(edit, str):
        path.write_text(edit)
    else:
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config))
    return folder


def fastest(*args: object, attempts: int = 5):
    """The quickest of a few runs (the machine is shared; the claim is about our start-up, not its load)."""
    runs = [run_repack(*args) for _ in range(attempts)]
    return min(runs, key=lambda run: run.seconds)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, tuple[list, str]]:
    root = tmp_path_factory.mktemp("fast")
    existing = root / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    dangling = root / "dangling"
    dangling.symlink_to(root / "gone")
    linked = root / "linked"
    linked.symlink_to(existing)
    no_config = root / "no-config"
    no_config.mkdir()
    missing = root / "missing"
    converted = root / "converted"
    convert(str(SRC), converted, quiet=True)  # in-process: only the commands under test run as the real script
    newer = edited_copy(converted, root / "newer", quant(format_version=99))
    unsealed = shutil.copytree(converted, root / "unsealed")
    manifest = json.loads((unsealed / MANIFEST_FILE).read_text())
    del manifest[SELF_CHECKSUM]
    (unsealed / MANIFEST_FILE).write_text(json.dumps(manifest))
    sources = {
        f"convert-{name}": (["convert", edited_copy(fixture, root / name, edit), root / "out"], expected)
        for name, (fixture, edit, expected) in SOURCE_CONFIGS.items()
    }
    return sources | {
        "inspect-not-converted": (["inspect", SRC], NOT_CONVERTED),
        "tune-not-converted": (["tune", SRC], NOT_CONVERTED),
        "inspect-newer-version": (["inspect", newer], "format_version 99 is not supported by this reader"),
        "verify-manifest-without-checksum": (["verify", unsealed], "has no manifest_sha256"),
        "demo-not-empty": (["demo", existing], "folder is not empty; pass --force"),
        "inspect-missing": (["inspect", missing], f"{missing}: {NOT_A_FOLDER}"),
        "verify-missing": (["verify", missing], f"{missing}: {NOT_A_FOLDER}"),
        "push-missing": (["push", "me/model", missing, "--dry-run"], f"{missing}: {NOT_A_FOLDER}"),
        "tune-missing": (["tune", missing], f"{missing}: {NOT_A_FOLDER}"),
        "inspect-no-config": (["inspect", existing], "has no config.json"),
        "convert-missing-source": (["convert", missing, root / "out"], "no such folder, and not a Hub repo id"),
        "convert-no-config": (["convert", no_config, root / "out"], "no config.json"),
        "convert-output-exists": (["convert", SRC, existing], "pass --force to replace it"),
        "convert-dangling-link": (["convert", SRC, dangling], "is a link"),
        "convert-linked-folder": (["convert", SRC, linked, "--force"], "is a link"),
        "convert-shard-size": (["convert", SRC, root / "out", "--shard-size", "5XB"], "--shard-size"),
        "convert-revision-local": (["convert", SRC, root / "out", "--revision", "main"], "--revision only applies"),
    }


CASES = [
    "inspect-missing",
    "verify-missing",
    "push-missing",
    "tune-missing",
    "inspect-no-config",
    "convert-missing-source",
    "convert-no-config",
    "convert-output-exists",
    "convert-dangling-link",
    "convert-linked-folder",
    "convert-shard-size",
    "convert-revision-local",
    *(f"convert-{name}" for name in SOURCE_CONFIGS),
    "inspect-not-converted",
    "tune-not-converted",
    "inspect-newer-version",
    "verify-manifest-without-checksum",
    "demo-not-empty",
]


@pytest.mark.parametrize("case", CASES)
def test_errors_without_tensors_answer_in_half_a_second_without_torch(cases, case: str):
    args, expected = cases[case]
    run = fastest(*args)
    line = error_line(run)
    assert expected in line, line
    assert run.seconds < 0.5, f"{case}: {run.seconds:.2f} s"
    assert "torch" not in imported_modules(*args)


@pytest.mark.parametrize("name", SOURCE_CONFIGS)
def test_a_config_refused_at_once_is_the_conversions_own_line(cases, name: str):
    """The line the script prints before importing torch is the one the conversion itself ends with (the library's
    convert(), which lists the files, opens every header and plans before it reads the same config)."""
    args, _ = cases[f"convert-{name}"]
    line = error_line(run_repack(*args), code=1)
    with pytest.raises(RepackError) as raised:
        convert(str(args[1]), args[2], quiet=True)
    assert line == "error: " + " ".join(str(raised.value).split())
    assert not Path(args[2]).exists()


def test_a_missing_folder_reads_the_same_in_every_command(cases):
    lines = {case: error_line(run_repack(*cases[case][0])) for case in CASES if case.endswith("-missing")}
    assert len(set(lines.values())) == 1, lines


def test_outputs_that_are_links_are_left_as_they_are(cases, tmp_path):
    for case in ("convert-dangling-link", "convert-linked-folder"):
        args, _ = cases[case]
        link = Path(args[2])
        run_repack(*args)
        assert link.is_symlink()
        assert not list(link.parent.glob(f".{link.name}.tmp-*"))
    assert (Path(cases["convert-output-exists"][0][2]) / "keep.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- mount points, unwritable folders


def mount_namespace_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    return probe.returncode == 0


needs_mounts = pytest.mark.skipif(not mount_namespace_works(), reason="needs `unshare -m` (root, or user namespaces)")


def repack_under_mount(mount: Path, options: str, *args: object):
    """``repack ARGS`` in a private mount namespace where ``mount`` is a fresh tmpfs mounted with ``options``."""
    script = 'mount -t tmpfs -o "$1" none "$2" && shift 2 && exec "$@"'
    command = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", options, str(mount)]
    start = time.monotonic()
    result = subprocess.run([*command, str(REPACK), *map(str, args)], capture_output=True, text=True, timeout=300)
    return result, time.monotonic() - start


@needs_mounts
@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_a_mount_point_as_output_is_refused_before_the_work(tmp_path, force):
    mount = tmp_path / "mnt"
    mount.mkdir()
    result, seconds = repack_under_mount(mount, "rw", "convert", SRC, mount, *(["--force"] if force else []))
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "is a mount point" in line and str(mount / "NAME") in line, line
    assert seconds < 5  # refused before the conversion, not after it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnt"]


@needs_mounts
def test_a_read_only_folder_for_the_output_is_refused_before_the_work(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    result, _ = repack_under_mount(mount, "ro", "convert", SRC, mount / "deeper" / "out")
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "is not writable (read-only file system)" in line and str(mount) in line, line


# ------------------------------------------------------------------------------------- as an unprivileged user

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="runs the command as the user nobody, which needs root")
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.fixture(scope="module")
def nobody_runs_repack() -> None:
    """Skips unless nobody can run this checkout's ``repack`` at all: a clone under a folder only its owner may enter
    (root's home, a 0700 temp folder) keeps nobody from the virtual environment, which says nothing about the
    command. Asked once for the module's tests."""
    reach = subprocess.run([*NOBODY, str(REPACK), "--version"], capture_output=True, text=True, timeout=120)
    if reach.returncode != 0:
        pytest.skip(f"nobody cannot run {REPACK} ({reach.stderr.strip()[-120:]}): clone where other users may read")


@pytest.fixture
def shared_dir(nobody_runs_repack) -> Iterator[Path]:
    """A folder the user nobody may write in (pytest's tmp_path is private to its owner)."""
    folder = Path(tempfile.mkdtemp(prefix="repack-nobody-"))
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def repack_as_nobody(*args: object, home: Path) -> subprocess.CompletedProcess:
    """``repack ARGS`` as nobody, whose home is ``home``, with no numba cache folder set: a service user."""
    env = {key: value for key, value in os.environ.items() if key != "NUMBA_CACHE_DIR"}
    env["HOME"] = str(home)
    command = [*NOBODY, str(REPACK), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=home.parent, timeout=600)


def readable_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for path in [dst, *dst.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dst


@needs_root
def test_an_unwritable_folder_for_the_output_is_refused_before_the_work(shared_dir):
    locked = shared_dir / "locked"
    locked.mkdir(mode=0o555)
    locked.chmod(0o555)
    source = readable_copy(SRC, shared_dir / "src")
    result = repack_as_nobody("convert", source, locked / "out", home=shared_dir / "no-home")
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"{locked / 'out'}: cannot be written, {locked} is not writable (permission denied)" in line, line


@needs_root
def test_an_unreadable_source_file_is_named_as_unreadable(shared_dir):
    source = readable_copy(SRC, shared_dir / "src")
    (source / "tokenizer.json").chmod(0)
    start = time.monotonic()
    result = repack_as_nobody("convert", source, shared_dir / "out", "--quiet", home=shared_dir / "no-home")
    assert result.returncode == 1, result.stderr
    assert time.monotonic() - start < 15  # named before the conversion, not after it
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: cannot read {source / 'tokenizer.json'}: Permission denied"), line
    assert sorted(path.name for path in shared_dir.iterdir()) == ["src"]


@needs_root
def test_convert_runs_with_nowhere_to_write_numba_s_cache(shared_dir):
    """A read-only install (the package's __pycache__ belongs to root) run by a user whose home cannot be written
    and with no NUMBA_CACHE_DIR: the mma128 loops are compiled uncached, and the conversion is the same."""
    home = shared_dir / "home"
    home.mkdir(mode=0o555)
    home.chmod(0o555)
    source = readable_copy(SRC, shared_dir / "src")
    result = repack_as_nobody("convert", source, shared_dir / "out", "--quiet", home=home)
    assert result.returncode == 0, result.stderr[-3000:]
    verified = repack_as_nobody("verify", shared_dir / "out", "--source", source, "--quiet", home=home)
    assert verified.returncode == 0 and verified.stdout.startswith("ok: "), verified.stderr[-3000:]
    assert "mma128" in run_repack("inspect", shared_dir / "out").stdout


# ---------------------------------------------------------------------------------------------------- interrupt


def test_an_interrupt_removes_the_parent_folders_the_run_created(tmp_path):
    out = tmp_path / "new" / "deeper" / "out"
    env = dict(os.environ, **{SLOW_LAYER_ENV: "2"})
    proc = subprocess.Popen(
        [str(REPACK), "convert", str(SRC), str(out), "--quiet"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not list(out.parent.glob(f".{out.name}.tmp-*")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert list(tmp_path.iterdir()) == [], "the run left the folders it created for OUT"
