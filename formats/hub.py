"""Hugging Face Hub ids: recognise one, and fetch its snapshot (from the cache when offline).

Shared by ``repack convert/verify`` and ``repack.runtime.load``, which both accept ``org/name`` where a folder
is expected, as ``from_pretrained`` does. ``snapshot_download`` gets patterns for weights, config and tokenizer
files only, so it also works from the local cache with ``HF_HUB_OFFLINE=1``; the snapshot folder's name is the
resolved commit hash.
"""

from __future__ import annotations

from pathlib import Path

from repack.formats.errors import RepackError

HUB_ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "tokenizer*",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "*.jinja",
    "*.py",
    "*.md",
]


def is_repo_id(text: object) -> bool:
    """Whether ``text`` is a ``namespace/name`` model id the Hub accepts (huggingface_hub's own rules)."""
    if not isinstance(text, str) or text.count("/") != 1:
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def looks_like_repo_id(src: str) -> bool:
    return not src.startswith((".", "/", "~")) and is_repo_id(src)  # a path answers without huggingface_hub


def download_snapshot(repo_id: str, revision: str | None) -> Path:
    """``snapshot_download`` with one-line errors (offline and not cached, unknown repo or revision)."""
    import huggingface_hub
    from huggingface_hub import errors as hub_errors

    # A mistyped local path with a slash looks like a repo id: every message says there is no such folder too.
    what = f"{repo_id}: no such local folder, and as a Hub repo id"
    try:
        folder = huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS)
    except hub_errors.LocalEntryNotFoundError:
        raise RepackError(
            f"{what} it is not in the local Hugging Face cache and the Hub is unreachable (or HF_HUB_OFFLINE=1); "
            "check the path, or download it once with network access"
        ) from None
    except hub_errors.RevisionNotFoundError:
        raise RepackError(
            f"{what} its revision {revision!r} is not on the Hub; check the path or the revision"
        ) from None
    except hub_errors.RepositoryNotFoundError:
        raise RepackError(f"{what} it is not on the Hub (or gated/private: log in); check the path") from None
    except (hub_errors.HfHubHTTPError, OSError, ValueError) as error:
        message = " ".join(str(error).split())[:300]
        raise RepackError(f"{what} its download failed ({message}); check the path, network and revision") from None
    return Path(folder)
