"""``repack verify OUT [--source SRC]``: prove an output is intact and, with a source, lossless.

Without a source: every output file's sha256 against the manifest. With a source, additionally: the source
files' sha256 against the manifest, every stack turned back into canonical linears with ``unpack_stack`` and those
into the source format's tensors by its reader's inverse (``SourceFormat.write``: GPTQ, AWQ, compressed-tensors),
every non-expert linear the converter turned into GPTQ tensors turned back the same way, each compared bit for bit
with the source tensors, every copied tensor compared byte for byte, and every source tensor accounted for. Any
mismatch raises a one-line :class:`RepackError`.

First what costs nothing (formats.integrity.check_structure: sizes, config.json, the index, every shard's header,
one conversion id), then one pass over the data. Every weight file, output and source, is read once: each through
a read-once stream (repack.streamed_reads: O_DIRECT, hashed as it is read) from which the checks take their
tensors, in the output's file order: each stack where its first tensor lies, rebuilt one source expert at a time,
each converted linear where its first tensor lies, each copied tensor piece by piece. So memory stays bounded
whatever the model size (the streams' rings and what they keep aside), and the checking costs about what the
conversion did: one read of each side, one sha256 of each.

A rich progress bar (stderr) counts the bytes read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.progress import Progress

from repack.formats.checkpoint import CheckpointReader, parse_repack_quant_config
from repack.formats.config_files import read_config_record
from repack.formats.constants import CONFIG_FILE
from repack.formats.errors import RepackError
from repack.formats.hashing import hash_file
from repack.formats.integrity import check_output_files, check_structure, output_bytes
from repack.formats.manifest import Manifest
from repack.formats.paths import contained_child
from repack.formats.quant_config import DENSE_CONFIG_KEY, DENSE_LINEAR_FORMAT, SOURCE_CONFIG_KEY
from repack.formats.sources import SourceFormat, reader_named
from repack.formats.sources.gptq import GptqSource
from repack.formats.stacks import MANIFEST_FILE, StackInfo, split_by_source, unpack_stack
from repack.formats.streaming import same_memory
from repack.progress import byte_progress
from repack.source import resolve_source
from repack.streamed_reads import StreamedReads

OUTPUT_RING_BYTES = 704 << 20  # verify reads an expert's w13 rows, then its w2 rows: two thirds of a stack apart
SOURCE_RING_BYTES = 128 << 20  # the source is read in file order, an expert's down weight kept aside
KEEP_BYTES = 256 << 20  # of each side's passed-over tensors (repack.streamed_reads): both rings and both kept <= 1.5 GB
# The output's stack rows are used where the ring holds them when one block holds them all (no copy): an expert's
# w13 rows (9 MB for Qwen2-57B) lie within one 32 MB block twice as often as within one 16 MB block.
OUTPUT_BLOCK_BYTES = 32 << 20


@dataclass
class VerifyReport:
    files_checked: int = 0
    source_files_checked: int = 0
    stacks_checked: int = 0
    tensors_compared: int = 0
    notes: list[str] = field(default_factory=list)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (dtype, shape and bytes; -0.0 differs from 0.0, NaN payloads count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return same_memory(_byte_array(a), _byte_array(b))


def _byte_array(tensor: torch.Tensor):
    """A tensor's bytes as a contiguous uint8 numpy array (no copy when the tensor is contiguous)."""
    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, dtype=np.uint8)


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def check_source_files(
    src_folder: Path, manifest: Manifest, names: list[str], report: VerifyReport, progress: Progress
) -> None:
    """The source files ``names`` (those not read by the tensor check: config, index, copied files) by sha256."""
    paths = [contained_child(src_folder, name, f"{MANIFEST_FILE} source_files") for name in names]
    for path in paths:
        if not path.is_file():
            raise RepackError(f"{path}: source file recorded in {MANIFEST_FILE} is missing from the source")
    task = progress.add_task("hashing source", total=sum(path.stat().st_size for path in paths))
    for name, path in zip(names, paths, strict=True):
        if hash_file(path, lambda n: progress.advance(task, n))[0] != manifest.source_files[name].sha256:
            raise RepackError(_source_changed(path))
        report.source_files_checked += 1


def _source_changed(path: Path) -> str:
    return (
        f"{path}: sha256 differs from the manifest; the source changed since conversion (wrong --source or --revision?)"
    )


def _output_changed(path: Path) -> str:
    return (
        f"{path}: sha256 differs from {MANIFEST_FILE} (the output file changed or is corrupt); re-run `repack convert`"
    )


def recorded_source_format(out: Path, quant: dict) -> SourceFormat:
    """The reader of the format the output was converted from, with the source config it recorded (GPTQ for
    checkpoints written before ``source_format`` existed)."""
    where = f"{out / CONFIG_FILE} quantization_config.{SOURCE_CONFIG_KEY}"
    return reader_named(str(quant.get("source_format") or "gptq"), quant.get(SOURCE_CONFIG_KEY) or {}, where)


@dataclass(frozen=True)
class _Check:
    """One step of the tensor check: a whole stack, one linear the converter turned into GPTQ tensors (a non-GPTQ
    source's attention, say), or one copied tensor."""

    stack: StackInfo | None = None
    linear: str | None = None  # the module
    copied: str | None = None


class TensorCheck:
    """The bit-exact inverse of one output against its source, both read once (see the module docstring)."""

    def __init__(
        self, out: Path, output: CheckpointReader, source: CheckpointReader, stacks: list[StackInfo], quant: dict
    ) -> None:
        self.out, self.output, self.source = out, output, source
        self.fmt = recorded_source_format(out, quant)
        self.dense = None
        if DENSE_CONFIG_KEY in quant:  # non-expert linears converted into GPTQ tensors: back into the source's
            where = f"{out / CONFIG_FILE} quantization_config.{DENSE_CONFIG_KEY}"
            self.dense = GptqSource(quant[DENSE_CONFIG_KEY], where)
        self.checks = self._in_file_order(stacks)
        outputs = [self._output_names(check) for check in self.checks]
        sources = [self._source_names(check) for check in self.checks]
        missing = sorted(set(source.names()) - {name for names in sources for name in names})
        if missing:
            raise RepackError(f"{out}: source tensor {missing[0]} is missing from the output ({len(missing)} in all)")
        self.output_reads = StreamedReads(
            output, outputs, ring=OUTPUT_RING_BYTES, keep=KEEP_BYTES, block=OUTPUT_BLOCK_BYTES
        )
        self.source_reads = StreamedReads(source, sources, ring=SOURCE_RING_BYTES, keep=KEEP_BYTES)

    def _in_file_order(self, stacks: list[StackInfo]) -> list[_Check]:
        """The checks in the order the output's bytes lie: a stack, or a converted linear, where its first tensor is;
        copies one by one."""
        owner: dict[str, _Check] = {}
        for info in stacks:
            check = _Check(stack=info)
            owner.update({name: check for name in info.tensor_names()})
        if self.dense is not None:
            for name in self.output.names():
                if name.endswith(".qweight") and name not in owner:
                    check = _Check(linear=name.removesuffix(".qweight"))
                    owner.update({n: check for n in self._output_names(check)})
        rank = {file: index for index, file in enumerate(self.output.files)}
        checks, seen = [], set()
        for entry in sorted(self.output.entries.values(), key=lambda e: (rank[e.file], e.offset)):
            check = owner.get(entry.name)
            if check is None:
                if entry.name not in self.source:
                    raise RepackError(f"{self.out}: tensor {entry.name} is not in the source; wrong --source?")
                checks.append(_Check(copied=entry.name))
            elif id(check) not in seen:
                seen.add(id(check))
                checks.append(check)
        for info in stacks:
            missing = [name for name in info.tensor_names() if name not in self.output]
            if missing:
                raise RepackError(f"{self.out}: stack tensor {missing[0]} is missing from the shards; re-convert")
        return checks

    def _output_names(self, check: _Check) -> list[str]:
        if check.stack is not None:
            return check.stack.tensor_names()
        if check.linear is not None:
            return self.dense.module_tensors(check.linear, lambda name: name in self.output)
        return [check.copied]

    def _source_names(self, check: _Check) -> list[str]:
        """The source tensors a check rebuilds or compares, in the order it reads them (what the format's inverse
        writes, where the source has it)."""
        if check.copied is not None:
            return [check.copied]
        modules = [m for triple in check.stack.source_modules for m in triple] if check.stack else [check.linear]
        present = lambda name: name in self.source  # noqa: E731
        return [name for module in modules for name in self.fmt.module_tensors(module, present)]

    def run(self, report: VerifyReport, on_bytes: Callable[[int], object]) -> tuple[dict, dict]:
        """Every check; returns the {sha256, size} of every output and source weight file, as read."""
        for k, check in enumerate(self.checks):
            self.output_reads.before(k)
            self.source_reads.before(k)
            if check.stack is not None:
                self._check_stack(check.stack, report, on_bytes)
            elif check.linear is not None:
                self._check_linear(check.linear, report, on_bytes)
            else:
                self._check_copied(check.copied, report, on_bytes)
            self.output_reads.after(k)
            self.source_reads.after(k)
        return self.output_reads.finish(), self.source_reads.finish()

    def _check_stack(self, info: StackInfo, report: VerifyReport, on_bytes: Callable[[int], object]) -> None:
        names = info.tensor_names()
        for expert_info, rows in split_by_source(info):  # one source expert in memory at a time
            stored = {name: self._stored_rows(name, rows) for name in names}
            on_bytes(sum(tensor.nbytes for tensor in stored.values()))
            for module, linear in unpack_stack(expert_info, stored).items():
                tensors = self.fmt.write(module, linear, expert_info.scheme, self.source)
                self._compare_rebuilt(f"stack {info.prefix}", tensors, report, on_bytes)
            del stored  # unpack_stack's linears are new tensors: nothing refers to the ring's bytes any more
            self.output_reads.release_views()
        report.stacks_checked += 1

    def _stored_rows(self, name: str, rows: slice) -> torch.Tensor:
        """Rows of an output stack tensor: a view of the output stream's ring where one block holds them (no copy;
        valid until ``release_views``), else read (copied out of the ring, or from the file)."""
        entry = self.output.entry(name)
        row_bytes = entry.nbytes // entry.shape[0]
        count = (rows.stop - rows.start) * row_bytes
        array = self.output_reads.view(entry, entry.offset + rows.start * row_bytes, count) if count else None
        if array is None:
            return self.output.read_rows(name, rows.start, rows.stop)
        if array.ctypes.data % 8:  # safetensors offsets are 8-byte aligned; never seen, but the loops want it
            tensor = torch.empty((rows.stop - rows.start, *entry.shape[1:]), dtype=entry.torch_dtype)
            tensor.view(torch.uint8).view(-1).numpy()[:] = array
            return tensor
        return torch.from_numpy(array).view(entry.torch_dtype).view(rows.stop - rows.start, *entry.shape[1:])

    def _check_linear(self, module: str, report: VerifyReport, on_bytes: Callable[[int], object]) -> None:
        """A non-expert linear the converter turned into GPTQ tensors, back into the source format's."""
        scheme = self.fmt.scheme_for(module)
        if scheme is None:
            raise RepackError(f"{self.out}: GPTQ linear {module} is not quantized per the recorded source config")
        gptq_scheme = self.dense.scheme_for(module)
        if gptq_scheme is None or gptq_scheme.checkpoint_format != DENSE_LINEAR_FORMAT:
            raise RepackError(f"{self.out}: {DENSE_CONFIG_KEY} does not describe {module}; re-convert")
        linear = self.dense.read(self.output, module, gptq_scheme)
        on_bytes(sum(self.output.entry(name).nbytes for name in self._output_names(_Check(linear=module))))
        tensors = self.fmt.write(module, linear, scheme, self.source)
        self._compare_rebuilt(f"linear {module}", tensors, report, on_bytes)

    def _compare_rebuilt(self, what: str, rebuilt: dict, report: VerifyReport, on_bytes) -> None:
        """Every rebuilt source tensor against the source's, bit for bit; one line naming the first that differs."""
        for name, tensor in rebuilt.items():
            if name not in self.source:
                raise RepackError(f"{self.out}: {what} rebuilds {name}, which the source does not have")
            if not self._same_as_source(name, tensor):
                entry = self.source.entry(name)
                raise _Mismatch(
                    f"{what} does not rebuild source tensor {name} bit for bit ({_describe(tensor)} vs "
                    f"{str(entry.torch_dtype).removeprefix('torch.')} {list(entry.shape)})"
                )
            on_bytes(tensor.nbytes)
            report.tensors_compared += 1

    def _same_as_source(self, name: str, tensor: torch.Tensor) -> bool:
        """The rebuilt ``tensor`` against source tensor ``name``: in the stream where it is held (no copy), else
        read."""
        entry = self.source.entry(name)
        if tensor.dtype != entry.torch_dtype or tuple(tensor.shape) != tuple(entry.shape):
            return False
        same = self.source_reads.compare(entry, memoryview(_byte_array(tensor)))
        return same if same is not None else same_bits(tensor, self.source.read(name))

    def _check_copied(self, name: str, report: VerifyReport, on_bytes: Callable[[int], object]) -> None:
        mine, theirs = self.output.entry(name), self.source.entry(name)
        if (mine.dtype, tuple(mine.shape)) != (theirs.dtype, tuple(theirs.shape)):
            raise _Mismatch(f"copied tensor {name} is {mine.dtype} {list(mine.shape)} in the output but {theirs.dtype} "
                            f"{list(theirs.shape)} in the source")  # fmt: skip
        block = self.output_reads.stream.block_bytes
        start = 0
        while start < mine.nbytes:  # pieces that end where the output stream's blocks do: each one view, no copy
            count = min(mine.nbytes, (mine.offset + start) // block * block + block - mine.offset) - start
            piece = self.output_reads.view(mine, mine.offset + start, count)
            if piece is None:
                piece = self.output.read_raw(name, start, count).numpy()
            same = self.source_reads.compare(theirs, memoryview(piece), theirs.offset + start)
            if same is None:
                same = same_memory(piece, self.source.read_raw(name, start, count).numpy())
            del piece
            self.output_reads.release_views()
            if not same:
                raise _Mismatch(f"copied tensor {name} differs from the source")
            on_bytes(2 * count)
            start += count
        report.tensors_compared += 1

    def finish_after_mismatch(self) -> tuple[dict, dict]:
        """After a mismatch: read and hash the rest (no tensor taken), so the message can say which side changed."""
        self.output.serve_from(None)
        self.source.serve_from(None)
        return self.output_reads.finish(), self.source_reads.finish()

    def stop(self) -> None:
        self.output_reads.stop()
        self.source_reads.stop()


class _Mismatch(RepackError):
    """A rebuilt or copied tensor differs from the source; which file to blame is decided from the hashes."""


@contextmanager
def one_thread_and_reused_memory() -> Iterator[None]:
    """One intra-op thread (the per-expert ops are small, and OpenMP workers spinning against the stream threads on
    two cores halved the check's speed) and glibc keeping freed pieces for reuse, as the converter does."""
    from repack.convert import reuse_freed_memory

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    reuse_freed_memory()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _check_weight_hashes(folder: Path, hashed: dict, records: dict, message: Callable[[Path], str]) -> int:
    for name, result in hashed.items():
        record = records.get(name)
        if record is None or result["sha256"] != record.sha256:
            raise RepackError(message(folder / name))
    return len(hashed)


def verify(
    out: str | Path, source: str | None = None, revision: str | None = None, *, quiet: bool = False
) -> VerifyReport:
    """Check OUT (and with ``source`` its bit-exact inverse); progress on stderr unless ``quiet``."""
    out = Path(out)
    if not out.is_dir():
        raise RepackError(f"{out}: no such folder; pass the output folder of repack convert")
    report = VerifyReport()
    manifest = Manifest.read(out)
    config, config_record = read_config_record(out)
    stacks = parse_repack_quant_config(config.get("quantization_config") or {}, str(out / CONFIG_FILE))
    src = resolve_source(source, revision) if source is not None else None
    if src is not None and src.revision and manifest.source.revision and src.revision != manifest.source.revision:
        raise RepackError(
            f"{source}: resolves to revision {src.revision} but {out} was converted from {manifest.source.revision}; "
            "pass --revision"
        )
    with CheckpointReader(out) as output, one_thread_and_reused_memory():
        check_structure(out, manifest, config, config_record, output)  # costs nothing: before any data is read
        shards = set(output.files)
        # transient: the outcome is one line (``ok: ...`` or one ``error:``), so the bar leaves nothing behind
        with byte_progress(quiet, transient=True) as progress:
            if src is None:
                task = progress.add_task("hashing output", total=output_bytes(out, manifest))
                advance = lambda n: progress.advance(task, n)  # noqa: E731
                report.files_checked += check_output_files(out, manifest, advance, skip=shards)
                hashed = StreamedReads(output, [], on_hashed=advance).finish()  # the shards: O_DIRECT, hashed as read
                _check_weight_hashes(out, hashed, manifest.output_files, _output_changed)
                return report
            with CheckpointReader(src.path) as source_reader:
                quant = config.get("quantization_config") or {}
                _verify_against_source(out, src.path, manifest, stacks, quant, output, source_reader, report, progress)
    return report


def _verify_against_source(
    out: Path,
    src_folder: Path,
    manifest: Manifest,
    stacks: list[StackInfo],
    quant: dict,
    output: CheckpointReader,
    source: CheckpointReader,
    report: VerifyReport,
    progress: Progress,
) -> None:
    for name in source.files:
        record = manifest.source_files.get(name)
        if record is None or record.size != source.file_sizes[name]:
            raise RepackError(_source_changed(src_folder / name))
    others = [name for name in manifest.source_files if name not in set(source.files)]
    check_source_files(src_folder, manifest, others, report, progress)
    task = progress.add_task("hashing output", total=output_bytes(out, manifest, skip=set(output.files)))
    report.files_checked += check_output_files(
        out, manifest, lambda n: progress.advance(task, n), skip=set(output.files)
    )
    total = sum(output.file_sizes.values()) + sum(source.file_sizes.values())
    task = progress.add_task("checking tensors", total=total)
    check = TensorCheck(out, output, source, stacks, quant)
    try:
        try:
            output_hashes, source_hashes = check.run(report, lambda n: progress.advance(task, n))
        except _Mismatch as mismatch:
            output_hashes, source_hashes = check.finish_after_mismatch()
            _check_weight_hashes(src_folder, source_hashes, manifest.source_files, _source_changed)
            _check_weight_hashes(out, output_hashes, manifest.output_files, _output_changed)
            raise RepackError(
                f"{out}: {mismatch} although every file matches its checksum: the conversion was wrong; please report "
                "it"
            ) from None
    finally:
        check.stop()
    report.source_files_checked += _check_weight_hashes(
        src_folder, source_hashes, manifest.source_files, _source_changed
    )
    _check_weight_hashes(out, output_hashes, manifest.output_files, _output_changed)
