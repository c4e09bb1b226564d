"""The ``repack`` command line: convert, verify, inspect, push, tune, demo.

Every command runs inside :func:`one_line_errors`, so user-facing failures (RepackError and its subclasses,
safetensors errors, OS errors, Ctrl-C) print a single ``error: ...`` line to stderr and exit non-zero; no
traceback is ever shown for them.

Importing this module imports neither torch nor huggingface_hub: ``repack --help``, a mistyped argument and
``repack push --dry-run`` do not pay seconds for them. Each command first makes the checks that need no tensor
(:mod:`repack.preflight`: missing folders, an existing output, options, and what a config or manifest alone rules
out), then imports what it needs.
"""

from __future__ import annotations

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

from repack import __version__  # noqa: E402
from repack.formats.constants import (  # noqa: E402
    ACTIVATION_DTYPE_NAMES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FILE,
)
from repack.formats.errors import RepackError, printable  # noqa: E402
from repack.preflight import (  # noqa: E402
    CONFIG_FILE,
    check_convert_arguments,
    check_converted_config,
    check_converted_folder,
    check_demo_folder,
    local_source,
)

INTERRUPTED = "error: interrupted; nothing was written to the output folder"


def examples(*lines: str) -> str:
    """A command's Examples section (shown after its options by --help), one command line per paragraph."""
    return "Examples:\n\n" + "\n\n".join(lines)


app = typer.Typer(
    name="repack",
    help=f"Convert GPTQ int4 Mixture-of-Experts checkpoints into the kernel-ready {FORMAT_NAME} format.",
    no_args_is_help=True,
    epilog=examples(
        "repack convert Qwen/Qwen2-57B-A14B-Instruct-GPTQ-Int4 out/",
        "repack verify out/ --source Qwen/Qwen2-57B-A14B-Instruct-GPTQ-Int4",
        "repack push myorg/qwen2-57b-repack out/ --dry-run",
        "repack demo demo-out   # a tiny model: convert, verify, run, no network",
    ),
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
INCLUDE_HELP = "Also copy source files matching this glob (repeatable); the plan lists what is copied."
EXCLUDE_HELP = "Do not copy source files matching this glob (repeatable)."


def _print_version(value: bool) -> None:
    if value:
        print(f"repack (moe-repack) {__version__}, writes {FORMAT_NAME} v{FORMAT_VERSION}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Convert GPTQ int4 Mixture-of-Experts checkpoints into the kernel-ready repack-moe format."""


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


def import_torch() -> None:
    """Import torch (seconds) with Ctrl-C held until it is done. Commands call it after the checks that need no
    tensor (:mod:`repack.preflight`), so a mistyped path or an existing output answers at once."""
    with _imports_uninterrupted():
        import torch  # noqa: F401


@contextmanager
def one_line_errors() -> Iterator[None]:
    """Print known failures as ``error: <one line>`` on stderr and exit with a non-zero code."""
    try:
        with _imports_uninterrupted():
            from safetensors import SafetensorError
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        raise typer.Exit(130) from None
    from repack.outcome import OUTCOME, reset_outcome

    reset_outcome()
    try:
        yield
    except RepackError as error:
        print(f"error: {_one_line(error)}", file=sys.stderr)
        raise typer.Exit(error.exit_code) from None
    except SafetensorError as error:
        print(f"error: {_one_line(error)}", file=sys.stderr)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        print(OUTCOME.interrupted_line(), file=sys.stderr)  # true in every window: what was published, what was not
        raise typer.Exit(130) from None
    except OSError as error:
        where = f" ({printable(str(error.filename))})" if error.filename else ""
        print(f"error: {error.strerror or _one_line(error)}{where}", file=sys.stderr)
        raise typer.Exit(1) from None


@app.command(
    help=f"Convert a GPTQ MoE checkpoint into the {FORMAT_NAME} v{FORMAT_VERSION} layout.",
    epilog=examples(
        "repack convert ./my-gptq-moe out/   # a local folder",
        "repack convert Qwen/Qwen2-57B-A14B-Instruct-GPTQ-Int4 out/   # a Hub id",
        "repack convert ./my-gptq-moe out/ --dry-run   # the plan, nothing written",
        "repack convert ./my-gptq-moe out/ --force --shard-size 2GB --include '*.md'",
        "repack convert ./my-gptq-moe out/ --push myorg/my-moe-repack   # then upload",
    ),
)
def convert(
    src: str = typer.Argument(..., help="Local GPTQ checkpoint folder or Hugging Face repo id (org/name)."),
    out: Path = typer.Argument(..., help="Output folder (created; must be empty unless --force)."),
    revision: str | None = typer.Option(None, help="Hub branch, tag or commit (Hub ids only)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing non-empty OUT (after success)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (every output tensor and file) and exit."),
    shard_size: str = typer.Option("5GB", "--shard-size", help="Maximum shard size, e.g. 5GB, 500MB, 2GiB."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
    base_model: str | None = typer.Option(
        None, "--base-model", help="Hub id of the model this checkpoint quantizes (card's base_model)."
    ),
    include: list[str] | None = typer.Option(None, "--include", help=INCLUDE_HELP),
    exclude: list[str] | None = typer.Option(None, "--exclude", help=EXCLUDE_HELP),
    push: str | None = typer.Option(None, "--push", help="Then upload OUT to this Hub repo (see `repack push`)."),
    private: bool = typer.Option(False, "--private", help="With --push: create the repo private."),
) -> None:
    with one_line_errors():
        check_convert_arguments(src, out, revision=revision, force=force, dry_run=dry_run, shard_size=shard_size)
        if base_model is not None:
            from repack.provenance import checked_repo_id

            checked_repo_id(base_model, "--base-model")
        import_torch()
        from rich.filesize import decimal

        from repack.convert import convert as run_convert

        access = None
        if push and not dry_run:  # check the token before a long conversion, not after
            from repack.push import check_hub_access

            access = check_hub_access(push)
        result = run_convert(
            src,
            out,
            revision=revision,
            force=force,
            dry_run=dry_run,
            shard_size=shard_size,
            quiet=quiet,
            base_model=base_model,
            include=include or [],
            exclude=exclude or [],
        )
        if not dry_run and not quiet:
            Console(stderr=True).print(
                f"wrote {out} ({len(result.output_files)} files, {decimal(result.output_bytes)})",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
        if access is not None:
            from repack.push import push_after_convert

            push_after_convert(out, push, access, private=private, quiet=quiet)


@app.command(
    epilog=examples(
        "repack verify out/   # every file against the manifest's sha256",
        "repack verify out/ --source ./my-gptq-moe   # and the source, bit for bit",
    )
)
def verify(
    out: Path = typer.Argument(..., help="Output folder of repack convert."),
    source: str | None = typer.Option(None, "--source", help="Source folder or Hub id: bit-exact inverse check."),
    revision: str | None = typer.Option(None, help="Hub revision of --source."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Check checksums against the manifest and, with --source, the bit-exact inverse of every tensor."""
    with one_line_errors():
        check_converted_folder(out, MANIFEST_FILE)
        check_converted_config(out, manifest=True)
        if source is not None:
            local_source(source, revision)
        import_torch()
        from repack.verify import verify as run_verify

        report = run_verify(out, source, revision, quiet=quiet)
        detail = (
            f", {report.source_files_checked} source files, {report.stacks_checked} stacks, "
            f"{report.tensors_compared} tensors bit-exact"
            if source
            else ""
        )
        print(f"ok: {report.files_checked} output files match the manifest{detail}")


@app.command(epilog=examples("repack inspect out/"))
def inspect(out: Path = typer.Argument(..., help="Output folder of repack convert.")) -> None:
    """Show format version, layers, experts, shapes, quantization, provenance and sizes."""
    with one_line_errors():
        check_converted_folder(out, CONFIG_FILE)
        check_converted_config(out, manifest=False)
        import_torch()
        from repack.inspect_cmd import inspect_output

        Console().print(inspect_output(out))


@app.command(epilog=examples("repack demo demo-out", "repack demo demo-out --force --no-generate"))
def demo(
    out_dir: Path = typer.Argument(..., help="Folder for the demo (source/, converted/); must be empty."),
    force: bool = typer.Option(False, "--force", help="Replace the files of an earlier demo in OUT_DIR."),
    generate: bool = typer.Option(True, "--generate/--no-generate", help="Run greedy generate (slowest on a CPU)."),
) -> None:
    """Write a tiny GPTQ MoE, convert, verify, run it on the runtime and transformers, preview the push."""
    with one_line_errors():
        check_demo_folder(out_dir, force)
    try:
        with _imports_uninterrupted():
            from repack.demo import demo_command
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        raise typer.Exit(130) from None

    demo_command(out_dir, force=force, generate=generate)


@app.command(epilog=examples("repack tune out/ --out tuned-configs --dtype bfloat16   # on that GPU"))
def tune(
    checkpoint: Path = typer.Argument(..., help="A converted checkpoint: its routed-expert shapes are tuned."),
    out_dir: Path = typer.Option(Path("tuned-configs"), "--out", help="Where to write the JSON tables."),
    dtype: str = typer.Option("float16", "--dtype", help="float16 or bfloat16 activations."),
) -> None:
    """Time candidate kernel configs on this GPU and write E=..,N=..,device_name=...json tables.

    Point REPACK_MOE_CONFIG_DIR at the folder (or copy the files into runtime/configs/) to use them.
    """
    with one_line_errors():
        if dtype not in ACTIVATION_DTYPE_NAMES:
            raise RepackError(f"--dtype {dtype}: use {' or '.join(ACTIVATION_DTYPE_NAMES)}")
        check_converted_folder(checkpoint, CONFIG_FILE)
        check_converted_config(checkpoint, manifest=False)
        import_torch()
        import torch

        from repack.formats.checkpoint import read_repack_config
        from repack.runtime.tune import tune as tune_shapes

        config, stacks = read_repack_config(checkpoint)
        top_k = int(config.get("num_experts_per_tok", 1))
        shapes = sorted(
            {(s.num_experts, s.hidden_size, s.intermediate_size, top_k) for s in stacks if s.kind == "routed"}
        )
        for path in tune_shapes(shapes, getattr(torch, dtype), out_dir):
            Console().print(f"wrote {path}", markup=False, highlight=False, soft_wrap=True)


@app.command(
    "push",
    epilog=examples(
        "repack push myorg/my-moe-repack out/ --dry-run   # files and card, no upload",
        "repack push myorg/my-moe-repack out/ --private",
        "repack push myorg/my-moe-repack out/ --create-pr --speed-table speeds.md",
    ),
)
def push(
    repo_id: str = typer.Argument(..., help="Hub repo to push to, e.g. myorg/Qwen2-57B-A14B-repack (as `hf upload`)."),
    local_path: str = typer.Argument(".", help="A folder written by `repack convert` (default: this folder)."),
    private: bool = typer.Option(False, "--private", help="Create the repo as private."),
    revision: str = typer.Option("main", "--revision", help="Branch to push to (created if missing)."),
    create_pr: bool = typer.Option(False, "--create-pr", help="Push into a pull request (re-running resumes it)."),
    commit_message: str | None = typer.Option(
        None, "--commit-message", help="Commit message (default: names the source and the manifest's checksum)."
    ),
    include: list[str] | None = typer.Option(None, "--include", help="Upload only verified files matching this glob."),
    exclude: list[str] | None = typer.Option(None, "--exclude", help="Do not upload files matching this glob."),
    base_model: str | None = typer.Option(None, "--base-model", help="Hub id the card names as base_model."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print files, sizes and the card; no network, no writes."),
    force: bool = typer.Option(False, "--force", help="Replace a README.md edited by hand in the folder."),
    speed_table: Path | None = typer.Option(None, "--speed-table", help="Markdown file of measured speeds (card)."),
    token: str | None = typer.Option(None, "--token", help="Hub token (default: HF_TOKEN, then the cached login)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar while the files are checked."),
) -> None:
    """Upload a converted checkpoint to the Hugging Face Hub with a generated model card.

    Arguments in the order of `hf upload REPO_ID [LOCAL_PATH]`; the older `repack push LOCAL_PATH REPO_ID` works too.
    """
    with one_line_errors():
        folder, repo = push_arguments(repo_id, local_path)
        check_converted_folder(Path(folder), MANIFEST_FILE)
        from rich.console import Console as RichConsole

        from repack.push import print_result, push_checkpoint

        result = push_checkpoint(
            Path(folder),
            repo,
            private=private,
            revision=revision,
            create_pr=create_pr,
            dry_run=dry_run,
            force=force,
            speed_table=speed_table,
            token=token,
            base_model=base_model,
            include=include or [],
            exclude=exclude or [],
            commit_message=commit_message,
            quiet=quiet,
        )
        print_result(result, RichConsole())


def push_arguments(first: str, second: str) -> tuple[str, str]:
    """(folder, repo id) from `push REPO_ID [LOCAL_PATH]`, or from the older `push LOCAL_PATH REPO_ID`."""
    from repack.formats.constants import MANIFEST_FILE

    if (Path(first) / MANIFEST_FILE).is_file() and not Path(second).is_dir():
        return first, second
    return second, first


def flags_without_value_hint(command) -> None:
    """Typer labels every option with its type, so a flag reads `--force <bool>` as if it took a value: drop the
    label of the flags (boolean options take none), `-h/--help` included (created here, as it would be on use)."""
    context = command.context_class(command, **(command.context_settings | app.info.context_settings))
    for param in [*command.params, command.get_help_option(context)]:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    for sub in getattr(command, "commands", {}).values():
        flags_without_value_hint(sub)


def main() -> None:
    command = typer.main.get_command(app)
    flags_without_value_hint(command)
    try:
        command()
    finally:
        # The command is over (its output published, or its one line printed). A Ctrl-C now would land in the
        # interpreter's shutdown (joining worker threads) and kill the process with no message: ignore it.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    main()
