"""`repack push`: publish a converted checkpoint folder to the Hugging Face Hub, with a generated model card.

The flow, top to bottom:
1. `check_hub_access`: find the token (argument, `HF_TOKEN`, cached login) and ask the Hub who it belongs
   to, so a missing or rejected token fails in a second, not after hashing gigabytes (and, for
   `repack convert --push`, before converting at all).
2. `plan_push`: local only. Reads the manifest (`Manifest.read`), verifies the size and sha256 of every file it
   will upload (with a progress bar), renders the card and decides whether OUT/README.md may be (re)written.
   `--dry-run` stops here and prints the plan.
3. `create_repo(exist_ok=True)`, then one `upload_folder` restricted to the verified files. huggingface_hub
   2.x resumes an interrupted `upload_folder` by itself; with `--create-pr` we find the open PR this tool
   opened for the same checkpoint (its title is our commit message) and upload to `refs/pr/N` again, since
   `create_pr=True` would open a second PR.

Every Hub failure becomes a one-line `RepackError` (`hub_error`). The Hub client is injectable (`api`) so
the tests run without network and assert the exact calls.
"""

from __future__ import annotations

import glob
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
from rich.console import Console
from rich.filesize import decimal
from rich.table import Table

from repack.card import is_generated_card, render_model_card
from repack.display import plain
from repack.formats.constants import CARD_FILE, FORMAT_NAME, INDEX_FILE, MANIFEST_FILE
from repack.formats.errors import RepackError, printable
from repack.formats.manifest import Manifest, check_file
from repack.formats.paths import contained_child
from repack.model_files import SOURCE_README, matches_any
from repack.outcome import OUTCOME
from repack.progress import byte_progress
from repack.provenance import checked_repo_id, source_card_data

CONFIG_NAME = "config.json"
DEFAULT_BRANCH = "main"
PUSHING = "pushing to"


@dataclass(frozen=True)
class HubAccess:
    """Who the token belongs to and where it may write: checked once, before any long local work."""

    token: str
    user: str
    orgs: tuple[str, ...]

    def full_repo_id(self, repo_id: str) -> str:
        """`name` alone means the user's own namespace, as on the Hub website."""
        return repo_id if "/" in repo_id else f"{self.user}/{repo_id}"


@dataclass(frozen=True)
class UploadFile:
    """One file that goes to the Hub, by its name relative to OUT."""

    name: str
    size: int


@dataclass(frozen=True)
class PushPlan:
    """Everything a push will do, decided locally: what `--dry-run` prints."""

    out_dir: Path
    repo_id: str
    files: tuple[UploadFile, ...]
    not_uploaded: tuple[str, ...]  # in OUT, but not verified by the manifest or left out by --include/--exclude
    card: str
    write_card: bool
    commit_message: str
    commit_description: str

    @property
    def allow_patterns(self) -> list[str]:
        """Exactly the verified files (escaped, since Hub patterns are globs): nothing else in OUT leaves."""
        return [glob.escape(upload.name) for upload in self.files]

    @property
    def total_bytes(self) -> int:
        return sum(upload.size for upload in self.files)


@dataclass(frozen=True)
class PushResult:
    plan: PushPlan
    dry_run: bool
    revision: str | None = None
    commit_url: str | None = None
    pr_url: str | None = None


def resolve_token(token: str | None) -> str:
    """The explicit token, else huggingface_hub's own lookup (`HF_TOKEN`, then the cached `hf auth login`)."""
    found = token or get_token()
    if not found:
        raise RepackError(
            "no Hugging Face token found for pushing: run `hf auth login` or set HF_TOKEN "
            "(a token with write access, https://huggingface.co/settings/tokens)"
        )
    return found


def check_hub_access(repo_id: str, *, token: str | None = None, api: HfApi | None = None) -> HubAccess:
    """Fail fast on a missing, invalid or read-only token, or no network. `repack convert --push` calls this
    before converting so a long conversion never ends in an authentication error."""
    resolved = resolve_token(token)
    api = api if api is not None else HfApi()
    try:
        identity = api.whoami(token=resolved)
    except Exception as error:
        _raise_as_hub_error(error, repo_id, "checking the token for")
    user = identity.get("name")
    if not user:
        raise RepackError(f"the Hub did not say whom the token belongs to while pushing {repo_id}: re-run later")
    role = ((identity.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise RepackError(
            f"the token of user '{user}' is read-only and cannot push {repo_id}: "
            "create a token with write access at https://huggingface.co/settings/tokens"
        )
    orgs = tuple(org["name"] for org in identity.get("orgs") or [] if org.get("name"))
    access = HubAccess(token=resolved, user=user, orgs=orgs)
    checked_repo_id(access.full_repo_id(repo_id), "repo id")
    return access


def plan_push(
    out_dir: Path,
    repo_id: str,
    *,
    force: bool = False,
    speed_table: Path | None = None,
    base_model: str | None = None,
    include: list[str] = (),
    exclude: list[str] = (),
    commit_message: str | None = None,
    quiet: bool = True,
) -> PushPlan:
    """Verify OUT against its manifest and decide what to upload. Touches no network and writes nothing."""
    out_dir = Path(out_dir)
    checked_repo_id(repo_id, "repo id")
    if base_model is not None:
        checked_repo_id(base_model, "--base-model")
    manifest = Manifest.read(out_dir)
    config = _read_config(out_dir)
    selected = select_uploads(manifest, include, exclude)
    verified = verify_output_files(out_dir, manifest, selected, quiet=quiet)
    existing_card = _read_existing_card(out_dir)
    card = render_model_card(
        manifest,
        config,
        repo_id=repo_id,
        speed_table=_read_speed_table(speed_table),
        source_card=_source_card(out_dir, existing_card, manifest),
        base_model=base_model,
    )
    write_card = _may_write_card(out_dir, existing_card, card, manifest, force)
    card_upload = UploadFile(CARD_FILE, len(card.encode("utf-8")))
    manifest_upload = UploadFile(MANIFEST_FILE, len(manifest.raw))
    files = (*verified, manifest_upload, card_upload)
    uploaded_names = {upload.name for upload in files}
    return PushPlan(
        out_dir=out_dir,
        repo_id=repo_id,
        files=files,
        not_uploaded=tuple(name for name in _files_in(out_dir) if name not in uploaded_names),
        card=card,
        write_card=write_card,
        commit_message=commit_message or _commit_message(manifest),
        commit_description=_commit_description(manifest),
    )


def is_required_upload(name: str) -> bool:
    """Files without which the repo is no checkpoint: config, weights, index (the manifest and card always go)."""
    return name in (CONFIG_NAME, INDEX_FILE) or name.endswith(".safetensors")


def is_utf8(name: str) -> bool:
    """Whether a file name (as Python decoded it from the disk) is valid UTF-8: the only names the Hub takes."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def select_uploads(manifest: Manifest, include: list[str] = (), exclude: list[str] = ()) -> list[str]:
    """The manifest's files to upload, narrowed by ``hf upload``-style ``--include``/``--exclude`` globs.

    Only files the manifest verifies are ever candidates; the checkpoint's own files cannot be left out."""
    selected = []
    for name in sorted(manifest.checked_output_files):
        wanted = (not include or matches_any(name, include)) and not matches_any(name, exclude)
        if not wanted and is_required_upload(name):
            raise RepackError(f"--include/--exclude would leave out {name}, which the checkpoint needs; narrow them")
        if wanted and not is_utf8(name):
            raise RepackError(
                f"{printable(name)}: the Hub takes only UTF-8 file names; leave the file out (--exclude) or "
                "re-convert with the file renamed"
            )
        if wanted:
            selected.append(name)
    return selected


def push_checkpoint(
    out_dir: Path,
    repo_id: str,
    *,
    api: HfApi | None = None,
    private: bool = False,
    revision: str = DEFAULT_BRANCH,
    create_pr: bool = False,
    dry_run: bool = False,
    force: bool = False,
    speed_table: Path | None = None,
    token: str | None = None,
    access: HubAccess | None = None,
    base_model: str | None = None,
    include: list[str] = (),
    exclude: list[str] = (),
    commit_message: str | None = None,
    quiet: bool = True,
) -> PushResult:
    """Push OUT to `repo_id`: plan (verify + card), then create the repo and upload the verified files.

    `access` comes from an earlier `check_hub_access` (so `convert --push` does not ask the Hub twice).
    """
    if create_pr and revision != DEFAULT_BRANCH:
        raise RepackError(
            f"--create-pr opens a pull request against the default branch of {repo_id}, "
            f"so it cannot be combined with --revision {revision}: drop one of the two"
        )
    options = dict(
        force=force,
        speed_table=speed_table,
        base_model=base_model,
        include=include,
        exclude=exclude,
        commit_message=commit_message,
        quiet=quiet,
    )
    if dry_run:
        return PushResult(plan=plan_push(out_dir, repo_id, **options), dry_run=True)

    api = api if api is not None else HfApi()
    access = access if access is not None else check_hub_access(repo_id, token=token, api=api)
    full_id = access.full_repo_id(repo_id)
    plan = plan_push(out_dir, full_id, **options)
    if plan.write_card:
        _write_card(plan)
    OUTCOME.uploading = (full_id, out_dir)  # what an interrupt from here on says (repack.publish.Outcome)
    try:
        result = _upload(api, plan, access, private=private, revision=revision, create_pr=create_pr)
    except RepackError:
        raise
    except Exception as error:
        _raise_as_hub_error(error, full_id, PUSHING, access)
    OUTCOME.uploading = None
    return result


def push_after_convert(
    out_dir: Path,
    repo_id: str,
    access: HubAccess,
    *,
    api: HfApi | None = None,
    private: bool = False,
    revision: str = DEFAULT_BRANCH,
    create_pr: bool = False,
    speed_table: Path | None = None,
    console: Console | None = None,
    base_model: str | None = None,
    quiet: bool = False,
) -> PushResult:
    """What `repack convert SRC OUT --push REPO` runs once OUT is complete.

    Call `check_hub_access(REPO, token=...)` before converting and pass its result here. OUT has no README.md
    yet (the converter keeps the source's card as SOURCE_README.md), so the generated card is written.
    """
    result = push_checkpoint(
        out_dir,
        repo_id,
        api=api,
        private=private,
        revision=revision,
        create_pr=create_pr,
        speed_table=speed_table,
        access=access,
        base_model=base_model,
        quiet=quiet,
    )
    print_result(result, console or Console())
    return result


def print_result(result: PushResult, console: Console) -> None:
    """Dry run: the files, their sizes and the card. Real push: where it went."""
    plan = result.plan
    if not result.dry_run:
        where = result.pr_url or result.commit_url or f"https://huggingface.co/{plan.repo_id}"
        console.print(
            f"pushed {len(plan.files)} files ({decimal(plan.total_bytes)}) to {plan.repo_id}"
            f" @ {result.revision}: {where}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return
    table = Table(title=plain(f"dry run: would upload to {plan.repo_id}"))
    table.add_column("file")
    table.add_column("size", justify="right")
    for upload in plan.files:
        table.add_row(plain(upload.name), decimal(upload.size))  # a file's name is text, never markup
    table.add_row(f"{len(plan.files)} files", decimal(plan.total_bytes))
    console.print(table)
    if plan.not_uploaded:
        skipped = printable(", ".join(plan.not_uploaded))
        console.print(f"not uploaded (not in the manifest, or left out): {skipped}", markup=False, soft_wrap=True)
    card_note = "would write" if plan.write_card else "unchanged"
    console.print(f"{CARD_FILE} ({card_note}):", markup=False)
    console.print(plan.card, markup=False, highlight=False, soft_wrap=True)  # exact text, never re-wrapped


def verify_output_files(out_dir: Path, manifest: Manifest, names: list[str], quiet: bool = True) -> list[UploadFile]:
    """Check the files ``names`` against the manifest by size and sha256, with a progress bar unless ``quiet``.

    A push must never publish a checkpoint that changed since conversion; the error names the file.
    """
    records = manifest.checked_output_files
    with byte_progress(quiet) as progress:
        task = progress.add_task("verifying", total=sum(records[name].size for name in names))
        for name in names:
            progress.update(task, description=f"verifying {name}")
            check_file(out_dir, name, records[name], on_read=lambda n: progress.advance(task, n))
        progress.update(task, description=f"verified {len(names)} files")
    return [UploadFile(name, records[name].size) for name in names]


def find_resumable_pr(api: HfApi, repo_id: str, access: HubAccess, title: str) -> str | None:
    """`refs/pr/N` of an open (or draft) PR that this user opened for this very checkpoint, if any.

    The title is the commit message, which names the manifest's checksum: another checkpoint's PR is
    never reused.
    """
    discussions = api.get_repo_discussions(
        repo_id, author=access.user, discussion_type="pull_request", token=access.token
    )
    for discussion in discussions:
        if discussion.is_pull_request and discussion.status in ("open", "draft") and discussion.title == title:
            return discussion.git_reference
    return None


def hub_error(error: BaseException, repo_id: str, action: str, access: HubAccess | None = None) -> Exception:
    """Translate what huggingface_hub raises into one line: what failed, for which repo, what to do.

    Returns the error unchanged when it is not a Hub or network problem (a bug must keep its traceback).
    """
    if isinstance(error, OfflineModeIsEnabled):
        return RepackError(f"HF_HUB_OFFLINE is set, so {repo_id} cannot be pushed: unset it and re-run")
    if isinstance(error, HfHubHTTPError) and getattr(error, "response", None) is not None:
        return _http_error(error, repo_id, action, access)
    if _is_network_error(error):
        resume = "; the upload resumes where it stopped" if action == PUSHING else ""
        return RepackError(
            f"cannot reach the Hugging Face Hub while {action} {repo_id} ({type(error).__name__}): "
            f"check the network or proxy and re-run{resume}"
        )
    return error


def _raise_as_hub_error(error: Exception, repo_id: str, action: str, access: HubAccess | None = None) -> NoReturn:
    """Re-raise inside an `except` block: as a one-line RepackError, or unchanged when it is not a Hub error."""
    translated = hub_error(error, repo_id, action, access)
    if translated is error:
        raise error
    raise translated from error


def _http_error(error: HfHubHTTPError, repo_id: str, action: str, access: HubAccess | None) -> RepackError:
    status = error.response.status_code
    if status == 401:
        return RepackError(
            f"the Hub rejected the token (401 Unauthorized) while {action} {repo_id}: "
            "run `hf auth login` again or set a valid HF_TOKEN"
        )
    if status in (403, 409):
        who = f"user '{access.user}'" if access else "this token"
        yours = ", ".join((access.user, *access.orgs)) if access else "your own namespace"
        return RepackError(
            f"{who} may not write to {repo_id} ({status} {error.response.reason_phrase}): the name belongs to "
            f"someone else or the token lacks write access; push to a repo under {yours}"
        )
    if status == 404:
        return RepackError(
            f"{repo_id} or its revision was not found (404) while {action} it: check the repo id and --revision"
        )
    detail = " ".join(str(error.server_message or error).split())
    return RepackError(f"the Hub answered {status} while {action} {repo_id} ({detail}): re-run later to resume")


def _is_network_error(error: BaseException) -> bool:
    """Transport failures of the Hub's HTTP client (httpx in huggingface_hub 1.x, httpx2 in 2.x)."""
    names = {cls.__name__ for cls in type(error).__mro__}
    return bool(names & {"TransportError", "RequestError"}) or isinstance(error, ConnectionError | TimeoutError)


def _upload(
    api: HfApi, plan: PushPlan, access: HubAccess, *, private: bool, revision: str, create_pr: bool
) -> PushResult:
    api.create_repo(plan.repo_id, token=access.token, private=private, exist_ok=True, repo_type="model")
    target: str | None = revision
    if create_pr:
        target = find_resumable_pr(api, plan.repo_id, access, plan.commit_message)
    elif revision != DEFAULT_BRANCH:
        api.create_branch(plan.repo_id, branch=revision, token=access.token, exist_ok=True, repo_type="model")
    info = api.upload_folder(
        repo_id=plan.repo_id,
        folder_path=str(plan.out_dir),
        commit_message=plan.commit_message,
        commit_description=plan.commit_description,
        token=access.token,
        repo_type="model",
        revision=target,
        create_pr=create_pr and target is None,
        allow_patterns=plan.allow_patterns,
    )
    pr_url = getattr(info, "pr_url", None)
    if create_pr and target is None and getattr(info, "pr_revision", None):
        target = info.pr_revision
    return PushResult(
        plan=plan,
        dry_run=False,
        revision=target,
        commit_url=getattr(info, "commit_url", None),
        pr_url=pr_url,
    )


def _read_config(out_dir: Path) -> dict:
    path = contained_child(out_dir, CONFIG_NAME, str(out_dir))
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise RepackError(f"{path} not found: re-run `repack convert`") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RepackError(f"{path} is not valid JSON: re-run `repack convert`") from error
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    quant_method = quant.get("quant_method") if isinstance(quant, dict) else None
    if quant_method != "repack":
        raise RepackError(
            f"{path} has quant_method {quant_method!r}, not 'repack': push folders written by `repack convert`"
        )
    return config


def _read_speed_table(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = type(error).__name__
        raise RepackError(f"cannot read the speed table {path} ({reason}): pass a markdown file") from error
    if not text.strip():
        raise RepackError(f"the speed table {path} is empty: pass the markdown table you measured")
    return text


def _card_path(out_dir: Path) -> Path:
    """OUT/README.md, which push reads and may rewrite: never a link (a write would land in the file it points to,
    inside OUT or out of it), and, like every file push touches, inside OUT (formats.paths)."""
    path = contained_child(out_dir, CARD_FILE, str(out_dir))
    if path.is_symlink():
        raise RepackError(
            f"{path}: is a link; push writes the model card here, so replace the link with a file or remove it"
        )
    return path


def _read_existing_card(out_dir: Path) -> str | None:
    path = _card_path(out_dir)
    if not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise RepackError(f"{path} is not UTF-8 text: move it away or pass --force to replace it") from error


def _may_write_card(out_dir: Path, existing: str | None, card: str, manifest: Manifest, force: bool) -> bool:
    """Write unless OUT holds a README.md that a person wrote or edited (then refuse without --force).

    Not edited: no README yet, our own unedited card (marker checksum matches), or the source's card as the
    converter copied it (its sha256 is still the manifest's).
    """
    if existing is None:
        return True
    if existing == card:
        return False
    if force or is_generated_card(existing) or _is_converter_copy(existing, manifest):
        return True
    raise RepackError(
        f"{out_dir / CARD_FILE} was edited by hand (not the card repack generates): "
        "pass --force to replace it with the generated card, or move it away"
    )


def _is_converter_copy(existing: str, manifest: Manifest) -> bool:
    """A README.md an older converter copied from the source (its checksum is still the manifest's)."""
    record = manifest.output_files.get(CARD_FILE)
    return record is not None and record.sha256 == hashlib.sha256(existing.encode("utf-8")).hexdigest()


def _source_card(out_dir: Path, existing: str | None, manifest: Manifest) -> dict:
    """The source card's metadata: SOURCE_README.md, or a README.md an older converter copied from the source."""
    if contained_child(out_dir, SOURCE_README, str(out_dir)).is_file():
        return source_card_data(out_dir, SOURCE_README)
    if existing is not None and _is_converter_copy(existing, manifest):
        return source_card_data(out_dir, CARD_FILE)
    return {}


def _write_card(plan: PushPlan) -> None:
    path = _card_path(plan.out_dir)
    OUTCOME.card = path
    try:
        path.write_text(plan.card, encoding="utf-8")
    except OSError as error:
        raise RepackError(f"cannot write {path} ({error.strerror}): make {plan.out_dir} writable") from error


def _commit_message(manifest: Manifest) -> str:
    """Names the checkpoint exactly (manifest checksum), so a resumed `--create-pr` finds its own PR."""
    origin = manifest.source.repo_id or "a local checkpoint"
    if manifest.source.revision:
        origin = f"{origin}@{manifest.source.revision[:12]}"
    return f"Upload {FORMAT_NAME} v{manifest.format_version} of {origin} (manifest {manifest.digest[:12]})"


def _commit_description(manifest: Manifest) -> str:
    return f"Converted by moe-repack {manifest.converter_version}; checksums of every file in {MANIFEST_FILE}."


def _files_in(out_dir: Path) -> list[str]:
    """Files in OUT, relative, skipping hidden ones (huggingface_hub never uploads `.git` or caches either)."""
    names = []
    for path in sorted(out_dir.rglob("*")):
        relative = path.relative_to(out_dir)
        if path.is_file() and not any(part.startswith(".") for part in relative.parts):
            names.append(relative.as_posix())
    return names
