"""Where a conversion comes from, as the manifest records it and the model card publishes it.

The card's ``base_model`` (with ``base_model_relation: quantized``) links a checkpoint to the model it quantizes on
the Hub. One rule, so the same files get the same answer however they were named (a local folder, a Hub id, a
folder inside the Hugging Face cache): ``--base-model``; else the ``base_model`` the source's own card names (what
the GPTQ checkpoint itself says it quantizes); else the Hub repo the source came from (the Hub id it was resolved
from, or the repo a folder inside the cache belongs to: ``models--org--name/snapshots/<commit>``), the nearest
ancestor known; else none. A local absolute path is never recorded: the manifest and the card are published with
the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from repack.formats.errors import RepackError
from repack.formats.hub import is_repo_id
from repack.formats.manifest import SourceRecord

CACHE_REPO_PREFIX = "models--"  # huggingface_hub's cache folder of a model repo: models--{org}--{name}


def checked_repo_id(repo_id: str, what: str) -> str:
    """``repo_id`` if the Hub would accept it as a model id (huggingface_hub's own rules), else a one-line error."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        reason = " ".join(str(error).split())
        raise RepackError(f"{what} {repo_id!r} is not a valid Hub repo id ({reason}); use namespace/name") from None
    return repo_id


def cache_repo_id(folder: Path) -> str | None:
    """The repo id of a snapshot folder inside the Hugging Face cache, or None for any other folder."""
    resolved = folder.expanduser().absolute()
    if resolved.parent.name != "snapshots":
        return None
    repo_folder = resolved.parent.parent.name
    if not repo_folder.startswith(CACHE_REPO_PREFIX):
        return None
    repo_id = repo_folder.removeprefix(CACHE_REPO_PREFIX).replace("--", "/", 1)
    return repo_id if is_repo_id(repo_id) else None


def card_base_model(folder: Path) -> str | None:
    """The one ``base_model`` the source's README.md names in its metadata, if any."""
    card = source_card_data(folder, "README.md")
    base = card.get("base_model") if card else None
    if isinstance(base, list) and len(base) == 1:
        base = base[0]
    return base if is_repo_id(base) else None


def source_card_data(folder: Path, name: str) -> dict:
    """The metadata of the card ``folder / name`` (huggingface_hub's ``ModelCard.load``); empty when it has none
    or is unreadable."""
    from huggingface_hub import ModelCard

    path = folder / name
    if not path.is_file():
        return {}
    try:
        return ModelCard.load(path, ignore_metadata_errors=True).data.to_dict()
    except (OSError, UnicodeDecodeError, ValueError):  # a card we cannot parse carries nothing over
        return {}


def source_record(
    folder: Path, *, repo_id: str | None, revision: str | None, base_model: str | None = None
) -> SourceRecord:
    """The manifest's ``source``: the Hub id and commit, or only the local folder's name, and the base model."""
    if base_model is not None:
        checked_repo_id(base_model, "--base-model")
    found = base_model or card_base_model(folder) or repo_id or cache_repo_id(folder)
    return SourceRecord(
        repo_id=repo_id,
        revision=revision,
        path=None if repo_id else folder.expanduser().absolute().name,
        base_model=found,
    )
