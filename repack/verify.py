"""``repack verify OUT [--source SRC]``: prove an output is intact and, with a source, lossless.

Without a source: every output file's sha256 against the manifest. With a source, additionally: the
source files' sha256 against the manifest, every stack turned back into canonical linears with ``unpack_stack``
and those into the source format's tensors by its reader's inverse (``SourceFormat.write``: GPTQ, AWQ,
compressed-tensors), every non-expert linear the converter turned into GPTQ tensors turned back the same way,
each compared bit for bit with the source tensors, every copied tensor compared byte for byte, and every source
tensor accounted for. Any mismatch raises a one-line :class:`RepackError`.

Memory stays bounded whatever the model size: files are hashed in chunks, stacks are rebuilt one source
expert at a time, copied tensors (embeddings and lm_head are over a GB each) are compared piece by piece.
A rich progress bar (stderr) counts the bytes of each pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.progress import Progress

from repack.formats.checkpoint import CheckpointReader, read_repack_config
from repack.formats.errors import RepackError
from repack.formats.hashing import hash_file
from repack.formats.integrity import check_output_files, output_bytes
from repack.formats.manifest import Manifest
from repack.formats.paths import contained_child
from repack.formats.quant_config import DENSE_CONFIG_KEY, DENSE_LINEAR_FORMAT, SOURCE_CONFIG_KEY
from repack.formats.sources import SourceFormat, reader_named
from repack.formats.sources.gptq import GptqSource
from repack.formats.stacks import MANIFEST_FILE, split_by_source, unpack_stack
from repack.progress import byte_progress
from repack.source import resolve_source


@dataclass
class VerifyReport:
    files_checked: int = 0
    source_files_checked: int = 0
    stacks_checked: int = 0
    tensors_compared: int = 0
    notes: list[str] = field(default_factory=list)


def check_source_files(src_folder: Path, manifest: Manifest, report: VerifyReport, progress: Progress) -> None:
    paths = {name: contained_child(src_folder, name, f"{MANIFEST_FILE} source_files") for name in manifest.source_files}
    for path in paths.values():
        if not path.is_file():
            raise RepackError(f"{path}: source file recorded in {MANIFEST_FILE} is missing from the source")
    task = progress.add_task("hashing source", total=sum(path.stat().st_size for path in paths.values()))
    for name, record in manifest.source_files.items():
        path = paths[name]
        sha, _ = hash_file(path, lambda n: progress.advance(task, n))
        if sha != record.sha256:
            raise RepackError(
                f"{path}: sha256 differs from the manifest; the source changed since conversion (wrong --source "
                "or --revision?)"
            )
        report.source_files_checked += 1


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (dtype, shape and bytes; -0.0 differs from 0.0, NaN payloads count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def same_stored_tensor(output: CheckpointReader, source: CheckpointReader, name: str, on_bytes) -> bool:
    """Whether tensor ``name`` has the same dtype, shape and bytes in both checkpoints, read piece by piece."""
    mine, theirs = output.entry(name), source.entry(name)
    if (mine.dtype, tuple(mine.shape)) != (theirs.dtype, tuple(theirs.shape)):
        return False
    for piece, original in zip(output.iter_raw(name), source.iter_raw(name), strict=True):
        if not torch.equal(piece, original):
            return False
        on_bytes(piece.numel())
    return True


def recorded_source_format(out: Path, quant: dict) -> SourceFormat:
    """The reader of the format the output was converted from, with the source config it recorded (GPTQ for
    checkpoints written before ``source_format`` existed)."""
    where = f"{out / 'config.json'} quantization_config.{SOURCE_CONFIG_KEY}"
    return reader_named(str(quant.get("source_format") or "gptq"), quant.get(SOURCE_CONFIG_KEY) or {}, where)


def compare_rebuilt(out: Path, what: str, rebuilt: dict, source: CheckpointReader, covered: set, report) -> None:
    """Every rebuilt source tensor against the source's, bit for bit; one line naming the first that differs."""
    for name, tensor in rebuilt.items():
        if name not in source:
            raise RepackError(f"{out}: {what} rebuilds {name}, which the source does not have")
        original = source.read(name)
        if not same_bits(tensor, original):
            raise RepackError(
                f"{out}: {what} does not rebuild source tensor {name} bit for bit "
                f"({_describe(tensor)} vs {_describe(original)}); the output is corrupt, re-convert"
            )
        covered.add(name)
        report.tensors_compared += 1


def check_tensors(out: Path, src_folder: Path, report: VerifyReport, progress: Progress) -> None:
    config, stacks = read_repack_config(out)
    quant = config.get("quantization_config") or {}
    fmt = recorded_source_format(out, quant)
    output = CheckpointReader(out)
    source = CheckpointReader(src_folder)
    task = progress.add_task("checking tensors", total=sum(output.entry(name).nbytes for name in output.names()))
    covered: set[str] = set()
    rebuilt_from: set[str] = set()  # output tensors read by an inverse, not compared as copies
    for info in stacks:
        names = info.tensor_names()
        rebuilt_from.update(names)
        for expert_info, rows in split_by_source(info):  # one source expert in memory at a time
            stored = {name: output.read_rows(name, rows.start, rows.stop) for name in names}
            progress.advance(task, sum(tensor.nbytes for tensor in stored.values()))
            for module, linear in unpack_stack(expert_info, stored).items():
                tensors = fmt.write(module, linear, expert_info.scheme, source)
                compare_rebuilt(out, f"stack {info.prefix}", tensors, source, covered, report)
        report.stacks_checked += 1
    if DENSE_CONFIG_KEY in quant:  # non-expert linears converted into GPTQ tensors: back into the source's
        dense = GptqSource(quant[DENSE_CONFIG_KEY], f"{out / 'config.json'} quantization_config.{DENSE_CONFIG_KEY}")
        for module in sorted(n.removesuffix(".qweight") for n in output.names() if n.endswith(".qweight")):
            if f"{module}.qweight" in rebuilt_from:
                continue
            scheme = fmt.scheme_for(module)
            if scheme is None:
                raise RepackError(f"{out}: GPTQ linear {module} is not quantized per the recorded source config")
            gptq_scheme = dense.scheme_for(module)
            if gptq_scheme is None or gptq_scheme.checkpoint_format != DENSE_LINEAR_FORMAT:
                raise RepackError(f"{out}: {DENSE_CONFIG_KEY} does not describe {module}; re-convert")
            linear = dense.read(output, module, gptq_scheme)
            names = dense.module_tensors(module, lambda name: name in output)
            rebuilt_from.update(names)
            progress.advance(task, sum(output.entry(name).nbytes for name in names))
            compare_rebuilt(out, f"linear {module}", fmt.write(module, linear, scheme, source), source, covered, report)
    for name in output.names():
        if name in rebuilt_from:
            continue
        if name not in source:
            raise RepackError(f"{out}: tensor {name} is not in the source {src_folder}; wrong --source?")
        if not same_stored_tensor(output, source, name, lambda n: progress.advance(task, n)):
            raise RepackError(f"{out}: copied tensor {name} differs from the source; the output is corrupt, re-convert")
        covered.add(name)
        report.tensors_compared += 1
    missing = sorted(set(source.names()) - covered)
    if missing:
        raise RepackError(f"{out}: source tensor {missing[0]} is missing from the output ({len(missing)} in all)")


def verify(
    out: str | Path, source: str | None = None, revision: str | None = None, *, quiet: bool = False
) -> VerifyReport:
    """Check OUT (and with ``source`` its bit-exact inverse); progress on stderr unless ``quiet``."""
    out = Path(out)
    if not out.is_dir():
        raise RepackError(f"{out}: no such folder; pass the output folder of repack convert")
    report = VerifyReport()
    manifest = Manifest.read(out)
    # transient: the outcome is one line (``ok: ...`` or one ``error:``), so the bar leaves nothing behind
    with byte_progress(quiet, transient=True) as progress:
        task = progress.add_task("hashing output", total=output_bytes(out, manifest))
        report.files_checked += check_output_files(out, manifest, lambda n: progress.advance(task, n))
        if source is not None:
            src = resolve_source(source, revision)
            recorded = manifest.source.revision
            if src.revision and recorded and src.revision != recorded:
                raise RepackError(
                    f"{source}: resolves to revision {src.revision} but {out} was converted from {recorded}; "
                    "pass --revision"
                )
            check_source_files(src.path, manifest, report, progress)
            check_tensors(out, src.path, report, progress)
    return report
