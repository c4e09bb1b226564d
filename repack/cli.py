"""The ``repack`` command line: convert, verify, inspect (plus push and tune when their modules exist).

Every command runs inside :func:`one_line_errors`, so user-facing failures (RepackError, GPTQ format
errors, safetensors errors, OS errors, Ctrl-C) print a single ``error: ...`` line to stderr and exit
non-zero; no traceback is ever shown for them.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console

from repack.errors import RepackError

app = typer.Typer(
    name="repack",
    help="Convert GPTQ int4 Mixture-of-Experts checkpoints into the kernel-ready repack-moe format.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


@contextmanager
def one_line_errors() -> Iterator[None]:
    """Print known failures as ``error: <one line>`` on stderr and exit with a non-zero code."""
    from safetensors import SafetensorError

    from repack.formats.gptq import GptqFormatError

    try:
        yield
    except RepackError as error:
        print(f"error: {_one_line(error)}", file=sys.stderr)
        raise typer.Exit(error.exit_code) from None
    except (GptqFormatError, SafetensorError) as error:
        print(f"error: {_one_line(error)}", file=sys.stderr)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written to the output folder", file=sys.stderr)
        raise typer.Exit(130) from None
    except OSError as error:
        where = f" ({error.filename})" if error.filename else ""
        print(f"error: {error.strerror or _one_line(error)}{where}", file=sys.stderr)
        raise typer.Exit(1) from None


@app.command()
def convert(
    src: str = typer.Argument(..., help="Local GPTQ checkpoint folder or Hugging Face repo id (org/name)."),
    out: Path = typer.Argument(..., help="Output folder (created; must be empty unless --force)."),
    revision: str | None = typer.Option(None, help="Hub branch, tag or commit (Hub ids only)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing non-empty OUT (after success)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (every output tensor) and exit."),
    shard_size: str = typer.Option("5GB", "--shard-size", help="Maximum shard size, e.g. 5GB, 500MB, 2GiB."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
) -> None:
    """Convert a GPTQ MoE checkpoint into the repack-moe v1 layout."""
    with one_line_errors():
        from repack.convert import convert as run_convert

        result = run_convert(
            src, out, revision=revision, force=force, dry_run=dry_run, shard_size=shard_size, quiet=quiet
        )
        if not dry_run and not quiet:
            files = result["output_files"]
            total = sum(f["size"] for f in files.values())
            Console(stderr=True).print(f"wrote {out} ({len(files)} files, {total / 1e6:.1f} MB)")


@app.command()
def verify(
    out: Path = typer.Argument(..., help="Output folder of repack convert."),
    source: str | None = typer.Option(None, "--source", help="Source folder or Hub id: bit-exact inverse check."),
    revision: str | None = typer.Option(None, help="Hub revision of --source."),
) -> None:
    """Check checksums against the manifest and, with --source, the bit-exact inverse of every tensor."""
    with one_line_errors():
        from repack.verify import verify as run_verify

        report = run_verify(out, source, revision)
        detail = (
            f", {report.source_files_checked} source files, {report.stacks_checked} stacks, "
            f"{report.tensors_compared} tensors bit-exact"
            if source
            else ""
        )
        print(f"ok: {report.files_checked} output files match the manifest{detail}")


@app.command()
def inspect(out: Path = typer.Argument(..., help="Output folder of repack convert.")) -> None:
    """Show format version, layers, experts, shapes, quantization, provenance and sizes."""
    with one_line_errors():
        from repack.inspect_cmd import inspect_output

        Console().print(inspect_output(out))


def _register_optional_commands() -> None:
    """``push`` (repack/push.py) and ``tune`` (runtime/tune.py) when those modules are installed."""
    for name, module, attr in (
        ("push", "repack.push", "push_command"),
        ("tune", "repack.runtime.tune", "tune_command"),
    ):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            continue
        command = getattr(importlib.import_module(module), attr, None)
        if command is not None:
            app.command(name)(command)


_register_optional_commands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
