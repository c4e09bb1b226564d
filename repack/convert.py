"""Execute a :class:`~repack.plan.Plan`: stream layer by layer into a temp folder, then rename it to OUT.

Memory: the small tensors (scales, zeros, g_idx) of one stack (of two when a layer's routed and shared stacks
are written joined, tensor by tensor), one source expert's qweights per stack, the source ring and the tensors
kept aside of :mod:`repack.streamed_reads`, and the writer's bounded queue of pieces not yet on disk, whatever the
model size. Every byte written is hashed as it is written; the source weight files are read once, hashed as
they are read, and the conversion takes its tensors from those reads (:mod:`repack.streamed_reads`); other files
are hashed while they are copied. OUT appears only complete: the output is built in ``.OUT.tmp-<pid>`` next to
OUT and published by :mod:`repack.publish` (fsync, then a rename that never replaces another run's OUT, or an
atomic exchange with --force); on any error or Ctrl-C before that the temp folder is removed, and a temp folder
left by a killed run is never named like OUT (its janitor removes it).
"""

from __future__ import annotations

import copy
import ctypes
import datetime as dt
import errno
import hashlib
import os
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.filesize import decimal
from rich.progress import (
    Progress,
    TextColumn,
)

from repack import __version__
from repack.formats.checkpoint import (
    CONFIG_FILE,
    CONVERSION_ID_KEY,
    CheckpointReader,
    ShardedWriter,
    WrittenFile,
    write_json,
)
from repack.formats.errors import RepackError
from repack.formats.hashing import HASH_CHUNK, hash_file
from repack.formats.manifest import Manifest, SourceRecord, new_manifest
from repack.formats.paths import check_inside
from repack.formats.quant_config import DENSE_CONFIG_KEY, DENSE_LINEAR_FORMAT, SOURCE_CONFIG_KEY
from repack.formats.sources.gptq import gptq_tensors
from repack.formats.stacks import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_FILE,
    MANIFEST_FILE,
    QUANT_METHOD,
    iter_pack_stack,
)
from repack.outcome import OUTCOME
from repack.plan import ConvertLinear, CopyTensor, JoinedStacks, PackStack, Plan, Step, build_plan, dense_linear_config
from repack.plan_view import describe_plan
from repack.preflight import check_output_target, check_readable, missing_parents, parse_size, remove_created, shown
from repack.progress import byte_progress
from repack.provenance import source_record
from repack.publish import (
    Janitor,
    WorkFolder,
    publish,
    remove_stale_temps,
    remove_tree,
    signals_held,
)
from repack.source import SourceCheckpoint, resolve_source
from repack.streamed_reads import StreamedReads

SLOW_LAYER_ENV = "REPACK_TEST_SLOW_LAYER_SECONDS"  # test hook: sleep per layer so tests can interrupt
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def temp_folder_for(out: Path) -> Path:
    """Hidden, never named like OUT; the PID only keeps names of concurrent runs apart."""
    return out.parent / f".{out.name}.tmp-{os.getpid()}"


def check_free_space(plan: Plan, folder: Path) -> None:
    need = plan.output_bytes + plan.copied_file_bytes() + (1 << 20)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise RepackError(
            f"not enough disk space in {folder.parent}: free {decimal(free)}, need ~{decimal(need)}; "
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
                f"disk full writing {target()}: free {decimal(free)}, need ~{decimal(need)}; free some "
                "space or choose another output folder"
            ) from None
        if error.filename is not None and not _is_under(Path(os.fsdecode(error.filename)), folder):
            raise RepackError(
                f"cannot read {shown(os.fsdecode(error.filename))}: {error.strerror}; make the source readable"
            ) from None
        if error.errno == errno.EFBIG:
            raise RepackError(
                f"cannot write {target()}: larger than this process may write (ulimit -f, or the filesystem's file "
                "size limit); raise the limit or pass a smaller --shard-size"
            ) from None
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise RepackError(f"cannot write {target()}: {error.strerror}; choose a writable output folder") from None
        if error.errno in (errno.EDQUOT, errno.EIO):
            raise RepackError(
                f"cannot write {target()}: {error.strerror}; free some space or choose another output folder"
            ) from None
        raise


def _is_under(path: Path, folder: Path) -> bool:
    """Whether ``path`` (an error's file) lies in ``folder`` (the work folder): a write, not a read, failed."""
    path, folder = path.absolute(), folder.absolute()
    return path == folder or folder in path.parents


def reuse_freed_memory() -> None:
    """Make glibc serve allocations up to 32 MB from its heap and keep freed heap memory for reuse.

    Why: the converter allocates and frees ~10 MB pieces (one expert's words) tens of thousands of
    times. By default glibc maps each with mmap and unmaps it on free, so every piece is first-touch
    page faults, which cost more than the copy itself on virtual machines (measured: 3x slower
    transposes). The heap's high-water mark stays bounded by the pieces alive at once.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20)


def stream_pack_stack(plan: Plan, reader: CheckpointReader, step: PackStack) -> Iterator[tuple[str, torch.Tensor]]:
    """Check one stack's source experts, then yield its output pieces in file order (formats.stacks).

    Only the small tensors of all experts are held; each qweight is read (through the source's reader) when its
    expert is packed.
    """
    info, scheme, fmt = step.info, step.info.scheme, plan.source_format
    experts = [tuple(fmt.read_small(reader, module, scheme) for module in triple) for triple in info.source_modules]
    yield from iter_pack_stack(info, experts, lambda module: fmt.read_qweight(reader, module, scheme))


def converted_linear(plan: Plan, reader: CheckpointReader, step: ConvertLinear) -> dict[str, torch.Tensor]:
    """One non-expert linear of a non-GPTQ source as GPTQ tensors (v2 zero points), in the plan's tensor order."""
    linear = plan.source_format.read(reader, step.module, step.scheme)
    scheme = replace(step.scheme, checkpoint_format=DENSE_LINEAR_FORMAT)
    tensors = gptq_tensors(step.module, linear, scheme)
    return {name: tensors[name] for name in step.outputs}


Piece = tuple[str, torch.Tensor]  # (output tensor name, the next bytes of it)


def stream_stack_step(plan: Plan, reader: CheckpointReader, step: PackStack | JoinedStacks) -> Iterator[Piece]:
    """The pieces of a stack step in plan order: one stack's stream as is, or two joined stacks' interleaved."""
    if isinstance(step, PackStack):
        return stream_pack_stack(plan, reader, step)
    streams = {stack.info.prefix: stream_pack_stack(plan, reader, stack) for stack in step.stacks}
    return interleave_streams(streams, [tensor.name for tensor in step.planned_tensors()])


def interleave_streams(streams: dict[str, Iterator[Piece]], order: list[str]) -> Iterator[Piece]:
    """Pieces of several stacks' streams (keyed by stack prefix) rearranged into ``order`` of whole tensors.

    Each stream yields its own tensors in its own file order, and ``order`` keeps each stack's order, so every
    tensor is drained from its stack's stream up to the first piece of that stack's next tensor, which waits:
    one piece per stream is held back, never a whole tensor (the converter's memory stays bounded). The writer
    checks that every tensor arrives complete and in plan order.
    """
    waiting: dict[str, Piece | None] = {}
    for name in order:
        prefix = name.rsplit(".", 1)[0]
        stream = streams[prefix]
        piece = waiting.pop(prefix) if prefix in waiting else next(stream, None)
        while piece is not None and piece[0] == name:
            yield piece
            piece = next(stream, None)
        waiting[prefix] = piece


def output_config(plan: Plan, conversion_id: str) -> dict:
    """config.json with quantization_config replaced as in formats/SPEC.md section 4."""
    config = copy.deepcopy(plan.source.config)
    base = plan.source_format.base_scheme() or plan.stacks[0].scheme
    quant = {
        "quant_method": QUANT_METHOD,
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "bits": base.bits,
        "group_size": base.group_size,
        "sym": base.sym,
        "source_format": plan.source_format.name,
        SOURCE_CONFIG_KEY: plan.source.quantization_config,
        "stacks": [info.to_json() for info in plan.stacks],
        CONVERSION_ID_KEY: conversion_id,
    }
    dense = dense_linear_config(plan)
    if dense is not None:
        quant[DENSE_CONFIG_KEY] = dense
    config["quantization_config"] = quant
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
    return byte_progress(quiet, TextColumn("{task.fields[layers]}"))


class Converter:
    """Runs one plan into a temp folder; :meth:`run` returns the manifest written."""

    def __init__(
        self, plan: Plan, reader: CheckpointReader, folder: Path, shard_bytes: int, quiet: bool, origin: SourceRecord
    ) -> None:
        self.plan, self.reader, self.folder, self.origin = plan, reader, folder, origin
        self.conversion_id = uuid.uuid4().hex  # ties every file of this run together (formats/SPEC.md section 5)
        metadata = {"format": "pt", CONVERSION_ID_KEY: self.conversion_id}
        self.writer = ShardedWriter(folder, plan.output_tensors(), shard_bytes, metadata=metadata)
        self.quiet = quiet
        self.current = str(folder)
        self.steps = [step for group in plan.groups for step in group.steps]

    def run(self) -> Manifest:
        # One intra-op thread: the tensor ops are small per expert, and the hashing and writer threads
        # need the second core; OpenMP workers spinning against them cost more than they save.
        torch.set_num_threads(1)
        reuse_freed_memory()
        with disk_errors(lambda: self.current, self.plan, self.folder):
            self.reads = StreamedReads(self.reader, [step.sources for step in self.steps])
            try:
                self._write_weights()
                self.current = self.writer.current_file
                outputs = {f.name: f.record() for f in self.writer.close()}
                sources = self._copy_files(outputs)
                sources.update(self.reads.finish())
                self._check_source_unchanged()
            except BaseException:
                self.current = self.writer.current_file
                self.writer.abort()
                raise
            finally:
                self.reads.stop()
            manifest = self._manifest(sources, outputs)
            self.current = str(self.folder / MANIFEST_FILE)
            write_json(self.folder / MANIFEST_FILE, manifest.to_json())
        return manifest

    def _write_weights(self) -> None:
        delay = float(os.environ.get(SLOW_LAYER_ENV) or 0)
        groups = self.plan.groups
        with make_progress(self.quiet) as progress:
            task = progress.add_task("converting", total=self.plan.output_bytes, layers=f"0/{len(groups)} layers")
            steps = iter(range(len(self.steps)))
            for done, group in enumerate(groups, start=1):
                progress.update(task, description=group.label)
                for step in group.steps:
                    self._run_step(next(steps), step)
                    progress.advance(task, step.nbytes)
                progress.update(task, layers=f"{done}/{len(groups)} layers")
                if delay:
                    time.sleep(delay)
            progress.update(task, description="done")

    def _run_step(self, k: int, step: Step) -> None:
        """Step ``k`` of the plan: its source bytes come from the read-once stream (repack.streamed_reads)."""
        self.current = self.writer.current_file
        self.reads.before(k)
        if isinstance(step, CopyTensor):
            for piece in self.reader.iter_raw(step.name):
                self.writer.write(step.name, piece)
        else:
            pieces = converted_linear(self.plan, self.reader, step).items() if isinstance(step, ConvertLinear) else (
                stream_stack_step(self.plan, self.reader, step))  # fmt: skip
            for name, piece in pieces:
                self.writer.write(name, piece)
        self.reads.after(k)

    def _copy_files(self, outputs: dict) -> dict:
        source = self.plan.source
        sources: dict[str, dict] = {}
        for copied in self.plan.files_to_copy:
            self.current = str(self.folder / copied.output)
            origin = check_inside(source.path, source.path / copied.source)  # again, as it is opened
            record = copy_file(origin, self.folder / copied.output)
            sources[copied.source] = outputs[copied.output] = record
        self.current = str(self.folder / CONFIG_FILE)
        written: WrittenFile = write_json(self.folder / CONFIG_FILE, output_config(self.plan, self.conversion_id))
        outputs[CONFIG_FILE] = written.record()
        # The records of the bytes the plan was built from, not of the files as they are now (_check_source_unchanged).
        sources[CONFIG_FILE] = source.config_record.to_json()
        if self.reader.index_record is not None:
            sources[INDEX_FILE] = self.reader.index_record.to_json()
        return sources

    def _check_source_unchanged(self) -> None:
        """Refuse to publish when a source file changed while it was read: the output would be a mix of two versions
        and the manifest's source checksums would match neither (only ``verify --source`` would tell, later)."""
        source = self.plan.source
        changed = self.reader.changed()
        for name, record in ((CONFIG_FILE, source.config_record), (INDEX_FILE, self.reader.index_record)):
            path = source.path / name
            if changed is None and record is not None:
                try:
                    if hash_file(path)[0] != record.sha256:
                        changed = f"{path} was written to"
                except OSError:
                    changed = f"{path} can no longer be read"
        if changed is not None:
            raise RepackError(
                f"the source changed while converting ({changed}); nothing was written to the output folder: re-run "
                "once the source is complete"
            )

    def _manifest(self, sources: dict, outputs: dict) -> Manifest:
        return new_manifest(
            self.origin,
            sources,
            outputs,
            converter_version=__version__,
            created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            conversion_id=self.conversion_id,
        )


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


class InterruptedAfterPublish(RepackError):
    """Ctrl-C or SIGTERM that arrived once OUT already held the new output."""

    exit_code = 130


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
    base_model: str | None = None,
    include: list[str] = (),
    exclude: list[str] = (),
) -> Plan | Manifest:
    """Convert SRC into OUT. Returns the plan for ``dry_run``, else the manifest written."""
    out = Path(out).expanduser().absolute()
    shard_bytes = shard_size if isinstance(shard_size, int) else parse_size(shard_size)
    source: SourceCheckpoint = resolve_source(src, revision)
    origin = source_record(source.path, repo_id=source.repo_id, revision=source.revision, base_model=base_model)
    reader = CheckpointReader(source.path)
    plan = build_plan(source, reader, include, exclude)
    origin = replace(origin, quant_format=plan.source_format.name)
    if dry_run:
        (console or Console()).print(describe_plan(plan))
        return plan
    if out.parent.is_dir():
        remove_stale_temps(out)  # first: it may put back an OUT that a killed --force run had moved away
    check_output_target(out, force, source.path)
    check_readable(source.path, [copied.source for copied in plan.files_to_copy])
    created = missing_parents(out)  # removed again unless the run publishes OUT
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        janitor = Janitor(out)  # cleans up after this run even if it is killed
        work = WorkFolder(temp_folder_for(out))
    except OSError as error:
        remove_created(created)
        raise RepackError(f"cannot write output folder {out}: {error.strerror}; choose a writable location") from None
    temp, old, published = work.path, None, False
    try:
        with sigterm_as_interrupt():
            check_free_space(plan, temp)
            manifest = Converter(plan, reader, temp, shard_bytes, quiet, origin).run()
            reader.close()
            with signals_held():  # an interrupt lands before the swap or after it, never inside
                try:
                    old = publish(temp, out, force=force)
                except FileExistsError:
                    raise RepackError(
                        f"{out}: appeared while converting (another run?) and was left as it is; pass --force to "
                        "replace it"
                    ) from None
                published = True
                OUTCOME.published = out
            remove_tree(old)
    except KeyboardInterrupt:
        if not published:
            shutil.rmtree(temp, ignore_errors=True)
            remove_created(created)
            raise
        # What is left of the old tree is the janitor's (it is unlocked): a second Ctrl-C has nothing to cut short.
        raise InterruptedAfterPublish(OUTCOME.interrupted_line().removeprefix("error: ")) from None
    except BaseException:
        if not published:
            shutil.rmtree(temp, ignore_errors=True)
            remove_created(created)
        raise
    finally:
        work.close()
        reader.close()
        janitor.finish()
    return manifest
