"""``repack verify OUT [--source SRC]``: prove an output is intact and, with a source, lossless.

Without a source: every output file's sha256 against the manifest. With a source, additionally: the
source files' sha256 against the manifest, every stack turned back into GPTQ tensors with
``unpack_stack`` and compared bit for bit with the source tensors, every copied tensor compared byte
for byte, and every source tensor accounted for. Any mismatch raises a one-line :class:`RepackError`.

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


def check_tensors(out: Path, src_folder: Path, report: VerifyReport, progress: Progress) -> None:
    _, stacks = read_repack_config(out)
    output = CheckpointReader(out)
    source = CheckpointReader(src_folder)
    task = progress.add_task("checking tensors", total=sum(output.entry(name).nbytes for name in output.names()))
    covered: set[str] = set()
    stack_tensors: set[str] = set()
    for info in stacks:
        names = info.tensor_names()
        stack_tensors.update(names)
        for expert_info, rows in split_by_source(info):  # one source expert in memory at a time
            stored = {name: output.read_rows(name, rows.start, rows.stop) for name in names}
            progress.advance(task, sum(tensor.nbytes for tensor in stored.values()))
            for name, tensor in unpack_stack(expert_info, stored).items():
                if name not in source:
                    raise RepackError(f"{out}: stack {info.prefix} rebuilds {name}, which the source does not have")
                original = source.read(name)
                if not same_bits(tensor, original):
                    raise RepackError(
                        f"{out}: stack {info.prefix} does not rebuild source tensor {name} bit for bit "
                        f"({_describe(tensor)} vs {_describe(original)}); the output is corrupt, re-convert"
                    )
                covered.add(name)
                report.tensors_compared += 1
        report.stacks_checked += 1
    for name in output.names():
        if name in stack_tensors:
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
