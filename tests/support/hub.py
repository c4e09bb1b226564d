"""A hand-made Hugging Face cache (refs, snapshots whose files link into blobs/, as huggingface_hub lays it out)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def offline_env(cache: Path) -> dict:
    """The environment of a process that finds only ``cache`` and never reaches the Hub."""
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", HF_HOME=str(cache.parent / "hf_home"))
    env.pop("HF_TOKEN", None)
    return env


def make_cache(tmp_path: Path, src: Path, repo_id: str = "org/tiny-moe") -> Path:
    """A cache under ``tmp_path/hub`` holding ``src``'s files as ``repo_id`` at :data:`COMMIT`; returns the cache."""
    cache = tmp_path / "hub"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    (repo / "refs").mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for path in sorted(src.rglob("*")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / path.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return cache
