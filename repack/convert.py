"""Execute a :class:`~repack.plan.Plan`: stream layer by layer into a temp folder, then rename it to OUT.

Memory: one layer's experts plus one shard's pending tensors. Every byte written is hashed as it is
written; source weight files are hashed by a background thread while the conversion reads them (the
page cache serves both), other files are hashed while they are copied. OUT appears only complete: the
output is built in ``.OUT.tmp-<pid>`` next to OUT and renamed at the end; on any error or Ctrl-C the
temp folder is removed, and a temp folder left by a killed run is never named like OUT.
"""

from __future__ import annotations

import copy
import datetime as dt
import errno
import hashlib
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from repack import __version__
from repack.errors import RepackError
from repack.formats.checkpoint import (
    CONFIG_FILE,
    HASH_CHUNK,
    CheckpointReader,
    ShardedWriter,
    WrittenFile,
    hash_file,
    write_json,
)
from repack.formats.gptq import GptqLinear, check_linear, check_zero_points
from repack.formats.repack_v1 import FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE, QUANT_METHOD, pack_stack
from repack.plan import CopyTensor, PackStack, Plan, build_plan
from repack.source import SourceCheckpoint, resolve_source

SLOW_LAYER_ENV = "REPACK_TEST_SLOW_LAYER_SECONDS"  # test hook: sleep per layer so tests can interrupt
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes, '500MiB' -> 500 * 2**20, '1000' -> 1000."""
    match = _SIZE.match(text)
    if not match:
        raise RepackError(f"--shard-size {text!r}: expected a size like 5GB, 500MB or 2GiB")
    unit = (match[2] or "").lower().rstrip("b")
    binary = unit.endswith("i")
    unit = unit.rstrip("i")
    scale = 1024 ** " kmgt".index(unit or " ") if binary else _UNITS[unit]
    size = int(float(match[1]) * scale)
    if size <= 0:
        raise RepackError(f"--shard-size {text!r}: must be more than 0 bytes")
    return size


def temp_folder_for(out: Path) -> Path:
    return out.parent / f".{out.name}.tmp-{os.getpid()}"


def remove_stale_temps(out: Path) -> None:
    """Delete ``.OUT.tmp-<pid>`` folders of runs whose process no longer exists (killed conversions)."""
    for path in out.parent.glob(f".{out.name}.tmp-*"):
        pid = path.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_output_target(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise RepackError(f"{out}: exists and is a file; choose another output folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise RepackError(f"{out}: output folder exists and is not empty; pass --force to replace it")
    parent = out.parent
    if parent.exists() and not parent.is_dir():
        raise RepackError(f"{out}: cannot create it, {parent} is not a folder; choose another output path")


def human_size(nbytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 1e3:.1f} kB"


def check_free_space(plan: Plan, folder: Path) -> None:
    need = plan.output_bytes + plan.copied_file_bytes() + (1 << 20)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise RepackError(
            f"not enough disk space in {folder.parent}: free {human_size(free)}, need ~{human_size(need)}; "
            "free some space or choose another output folder"
        )


@contextmanager
def disk_errors(target: Callable[[], str], plan: Plan, folder: Path) -> Iterator[None]:
    """Turn ENOSPC / permission errors while writing into one line naming the file being written."""
    try:
        yield
    except OSError as error:
        if error.errno == errno.ENOSPC:
            free = shutil.disk_usage(folder).free
            need = plan.output_bytes + plan.copied_file_bytes()
            raise RepackError(
                f"disk full writing {target()}: free {human_size(free)}, need ~{human_size(need)}; free some "
                "space or choose another output folder"
            ) from None
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise RepackError(f"cannot write {target()}: {error.strerror}; choose a writable output folder") from None
        raise


class SourceHasher:
    """sha256 of the source weight files, computed by a background thread while the conversion runs."""

    def __init__(self, folder: Path, files: list[str]) -> None:
        self.results: dict[str, dict] = {}
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(folder, files), daemon=True)
        self._thread.start()

    def _run(self, folder: Path, files: list[str]) -> None:
        try:
            for name in files:
                digest, size = hashlib.sha256(), 0
                with (folder / name).open("rb") as handle:
                    while chunk := handle.read(HASH_CHUNK):
                        if self._stop.is_set():
                            return
                        digest.update(chunk)
                        size += len(chunk)
                self.results[name] = {"sha256": digest.hexdigest(), "size": size}
        except BaseException as error:  # reported in join(), on the main thread
            self._error = error

    def stop(self) -> None:
        self._stop.set()

    def join(self) -> dict[str, dict]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.results


def _load_linear(reader: CheckpointReader, module: str) -> GptqLinear:
    g_idx = f"{module}.g_idx"
    return GptqLinear(
        qweight=reader.get(f"{module}.qweight"),
        qzeros=reader.get(f"{module}.qzeros"),
        scales=reader.get(f"{module}.scales"),
        g_idx=reader.get(g_idx) if g_idx in reader else None,
    )


def run_pack_stack(reader: CheckpointReader, step: PackStack) -> dict:
    """Load one stack's source experts (checked), and pack them."""
    info, scheme = step.info, step.info.scheme
    experts = []
    for triple in info.source_modules:
        linears = tuple(_load_linear(reader, module) for module in triple)
        for module, linear in zip(triple, linears, strict=True):
            check_linear(module, linear, scheme)
            check_zero_points(module, linear, scheme)
        experts.append(linears)
    return pack_stack(info, experts)


def output_config(plan: Plan) -> dict:
    """config.json with quantization_config replaced as in formats/SPEC.md section 4."""
    config = copy.deepcopy(plan.source.config)
    base = plan.quant.base
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "bits": base.bits,
        "group_size": base.group_size,
        "sym": base.sym,
        "source_quantization_config": plan.source.quantization_config,
        "stacks": [info.to_json() for info in plan.stacks],
    }
    return config


def copy_file(src: Path, dst: Path) -> dict:
    """Copy one file, hashing it on the way (the source and the copy share the hash)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    with src.open("rb") as fin, dst.open("wb") as fout:
        while chunk := fin.read(HASH_CHUNK):
            digest.update(chunk)
            fout.write(chunk)
            size += len(chunk)
    return {"sha256": digest.hexdigest(), "size": size}


def make_progress(quiet: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[layers]}"),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=quiet,
        transient=False,
    )


class Converter:
    """Runs one plan into a temp folder; :meth:`run` returns the manifest written."""

    def __init__(self, plan: Plan, reader: CheckpointReader, folder: Path, shard_bytes: int, quiet: bool) -> None:
        self.plan, self.reader, self.folder = plan, reader, folder
        self.writer = ShardedWriter(folder, shard_bytes)
        self.quiet = quiet
        self.current = str(folder)

    def run(self) -> dict:
        with disk_errors(lambda: self.current, self.plan, self.folder):
            hasher = SourceHasher(self.plan.source.path, self.plan.weight_files)
            try:
                self._write_weights()
                outputs = {f.name: {"sha256": f.sha256, "size": f.size} for f in self.writer.close()}
                sources = self._copy_files(outputs)
                sources.update(hasher.join())
            finally:
                hasher.stop()
            manifest = self._manifest(sources, outputs)
            self.current = str(self.folder / MANIFEST_FILE)
            write_json(self.folder / MANIFEST_FILE, manifest)
        return manifest

    def _write_weights(self) -> None:
        delay = float(os.environ.get(SLOW_LAYER_ENV) or 0)
        groups = self.plan.groups
        with make_progress(self.quiet) as progress:
            task = progress.add_task("converting", total=self.plan.output_bytes, layers=f"0/{len(groups)} layers")
            for done, group in enumerate(groups, start=1):
                progress.update(task, description=group.label)
                for step in group.steps:
                    self._run_step(step)
                    progress.advance(task, step.nbytes)
                progress.update(task, layers=f"{done}/{len(groups)} layers")
                if delay:
                    time.sleep(delay)
            progress.update(task, description="done")

    def _run_step(self, step: CopyTensor | PackStack) -> None:
        self.current = f"{self.folder} (shard {len(self.writer.written) + 1})"
        if isinstance(step, CopyTensor):
            self.writer.add(step.name, self.reader.get(step.name))
            return
        for name, tensor in run_pack_stack(self.reader, step).items():
            self.writer.add(name, tensor)

    def _copy_files(self, outputs: dict) -> dict:
        source = self.plan.source
        sources: dict[str, dict] = {}
        for name in self.plan.files_to_copy:
            self.current = str(self.folder / name)
            sources[name] = outputs[name] = copy_file(source.path / name, self.folder / name)
        self.current = str(self.folder / CONFIG_FILE)
        written: WrittenFile = write_json(self.folder / CONFIG_FILE, output_config(self.plan))
        outputs[CONFIG_FILE] = {"sha256": written.sha256, "size": written.size}
        sha, size = hash_file(source.path / CONFIG_FILE)
        sources[CONFIG_FILE] = {"sha256": sha, "size": size}
        index = source.path / "model.safetensors.index.json"
        if index.is_file():
            sha, size = hash_file(index)
            sources[index.name] = {"sha256": sha, "size": size}
        return sources

    def _manifest(self, sources: dict, outputs: dict) -> dict:
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "converter_version": __version__,
            "source": self.plan.source.provenance(),
            "source_files": dict(sorted(sources.items())),
            "output_files": dict(sorted(outputs.items())),
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt (on the main thread) so the temp folder is cleaned up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def publish(temp: Path, out: Path) -> None:
    """Move the finished temp folder to OUT; an existing OUT (only with --force) is swapped then deleted."""
    if out.is_dir() and any(out.iterdir()):
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        temp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        if out.is_dir():
            out.rmdir()
        temp.rename(out)


def convert(
    src: str,
    out: str | Path,
    *,
    revision: str | None = None,
    force: bool = False,
    dry_run: bool = False,
    shard_size: str | int = "5GB",
    quiet: bool = False,
    console: Console | None = None,
) -> Plan | dict:
    """Convert SRC into OUT. Returns the plan for ``dry_run``, else the manifest written."""
    out = Path(out).expanduser().absolute()
    shard_bytes = shard_size if isinstance(shard_size, int) else parse_size(shard_size)
    source: SourceCheckpoint = resolve_source(src, revision)
    reader = CheckpointReader(source.path)
    plan = build_plan(source, reader)
    if dry_run:
        (console or Console()).print(plan.describe())
        return plan
    check_output_target(out, force)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(out)
        temp = temp_folder_for(out)
        temp.mkdir()
    except OSError as error:
        raise RepackError(f"cannot write output folder {out}: {error.strerror}; choose a writable location") from None
    try:
        with sigterm_as_interrupt():
            check_free_space(plan, temp)
            manifest = Converter(plan, reader, temp, shard_bytes, quiet).run()
            reader.close()
            publish(temp, out)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return manifest
