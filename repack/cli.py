"""The ``repack`` command line: convert, verify, inspect, push, tune, demo.

Every command runs inside :func:`one_line_errors`, so user-facing failures (RepackError, GPTQ format
errors, safetensors errors, OS errors, Ctrl-C) print a single ``error: ...`` line to stderr and exit
non-zero; no traceback is ever shown for them.
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_startup_interrupts: list[int] = []


def _record_interrupt(signum, frame) -> None:
    _startup_interrupts.append(signum)


def _started_as_the_command() -> bool:
    """``repack ...`` (the console script) or ``python -m repack.cli``, not an import by a test or a library."""
    main = sys.modules.get("__main__")
    return __name__ == "__main__" or Path(getattr(main, "__file__", None) or "").name == "repack"


# Why before the imports below: Ctrl-C while a module (typer, then torch) is half imported leaves it broken and
# prints a long traceback; the interrupt is held until the imports are done (``_imports_uninterrupted``).
if _started_as_the_command() and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, _record_interrupt)

import typer  # noqa: E402
from rich.console import Console  # noqa: E402

from repack.formats.errors import RepackError, printable  # noqa: E402

INTERRUPTED = "error: interrupted; nothing was written to the output folder"

app = typer.Typer(
    name="repack",
    help="Convert GPTQ int4 Mixture-of-Experts checkpoints into the kernel-ready repack-moe format.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _one_line(error: BaseException) -> str:
    return printable(" ".join(str(error).split())) or type(error).__name__


@contextmanager
def _imports_uninterrupted() -> Iterator[None]:
    """Hold Ctrl-C until the block (slow imports) is done, then raise it (also one that came during start-up)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _record_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is _record_interrupt else previous)
    if _startup_interrupts:
        _startup_interrupts.clear()
        raise KeyboardInterrupt


@contextmanager
def one_line_errors() -> Iterator[None]:
    """Print known failures as ``error: <one line>`` on stderr and exit with a non-zero code."""
    try:
        with _imports_uninterrupted():  # torch, through formats.gptq: the slow one
            from safetensors import SafetensorError

            from repack.formats.gptq import GptqFormatError
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        raise typer.Exit(130) from None
    try:
        yield
    except RepackError as error:
        print(f"error: {_one_line(error)}", file=sys.stderr)
        raise typer.Exit(error.exit_code) from None
    except (GptqFormatError, SafetensorError) as error:
        print(f"error: {_one_line(error)}", file=sys.stderr)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        raise typer.Exit(130) from None
    except OSError as error:
        where = f" ({printable(str(error.filename))})" if error.filename else ""
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
    push: str | None = typer.Option(None, "--push", help="Then upload OUT to this Hub repo (see `repack push`)."),
    private: bool = typer.Option(False, "--private", help="With --push: create the repo private."),
) -> None:
    """Convert a GPTQ MoE checkpoint into the repack-moe v1 layout."""
    with one_line_errors():
        from repack.convert import convert as run_convert

        access = None
        if push and not dry_run:  # check the token before a long conversion, not after
            from repack.push import check_hub_access

            access = check_hub_access(push)
        result = run_convert(
            src, out, revision=revision, force=force, dry_run=dry_run, shard_size=shard_size, quiet=quiet
        )
        if not dry_run and not quiet:
            files = result["output_files"]
            total = sum(f["size"] for f in files.values())
            Console(stderr=True).print(f"wrote {out} ({len(files)} files, {total / 1e6:.1f} MB)")
        if access is not None:
            from repack.push import push_after_convert

            push_after_convert(out, push, access, private=private)


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


@app.command()
def demo(
    out_dir: Path = typer.Argument(..., help="Folder for the demo (source/, converted/); must be empty."),
    force: bool = typer.Option(False, "--force", help="Replace the files of an earlier demo in OUT_DIR."),
    generate: bool = typer.Option(True, "--generate/--no-generate", help="Run greedy generate (slowest on a CPU)."),
) -> None:
    """Write a tiny GPTQ MoE, convert, verify, run it on the runtime and transformers, preview the push."""
    try:
        with _imports_uninterrupted():
            from repack.demo import demo_command
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        raise typer.Exit(130) from None

    demo_command(out_dir, force=force, generate=generate)


@app.command()
def tune(
    checkpoint: Path = typer.Argument(..., help="A converted checkpoint: its routed-expert shapes are tuned."),
    out_dir: Path = typer.Option(Path("tuned-configs"), "--out", help="Where to write the JSON tables."),
    dtype: str = typer.Option("float16", "--dtype", help="float16 or bfloat16 activations."),
) -> None:
    """Time candidate kernel configs on this GPU and write E=..,N=..,device_name=...json tables.

    Point REPACK_MOE_CONFIG_DIR at the folder (or copy the files into runtime/configs/) to use them.
    """
    with one_line_errors():
        import torch

        from repack.formats.checkpoint import read_repack_config
        from repack.runtime.tune import tune as tune_shapes

        config, stacks = read_repack_config(checkpoint)
        top_k = int(config.get("num_experts_per_tok", 1))
        shapes = sorted(
            {(s.num_experts, s.hidden_size, s.intermediate_size, top_k) for s in stacks if s.kind == "routed"}
        )
        if dtype not in ("float16", "bfloat16"):
            raise RepackError(f"--dtype {dtype}: use float16 or bfloat16")
        for path in tune_shapes(shapes, getattr(torch, dtype), out_dir):
            Console().print(f"wrote {path}")


def _register_push() -> None:
    """``push`` keeps its typer signature in repack/push.py (huggingface_hub is imported there); it runs inside
    :func:`one_line_errors` like every command, so an unreadable file is one line too."""
    from repack.push import push_command

    @functools.wraps(push_command)
    def push(*args, **kwargs) -> None:
        with one_line_errors():
            push_command(*args, **kwargs)

    app.command("push")(push)


_register_push()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
