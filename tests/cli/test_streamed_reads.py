"""The converter's source reads (repack/streamed_reads.py): with a ring far smaller than a layer, passed-over tensors
kept aside and small tensors from the page cache, the output still rebuilds the source bit for bit, and the
manifest's source checksums are the files'."""

from __future__ import annotations

import hashlib
import json

import pytest

import repack.streamed_reads as streamed_reads
from repack.convert import convert
from repack.formats.constants import MANIFEST_FILE
from repack.verify import verify
from tests.support.fixtures import FIXTURES_DIR

SERVED: list[dict] = []


@pytest.fixture
def tiny_ring(monkeypatch):
    """Blocks of 16 KB, a ring of 256 KB (two experts of the fixtures, whose qweights are 48 KB), tensors from 32 KB
    up holding it: every path of StreamedReads is taken."""
    monkeypatch.setattr(streamed_reads, "BLOCK_BYTES", 16 << 10)
    monkeypatch.setattr(streamed_reads, "RING_BYTES", 256 << 10)
    monkeypatch.setattr(streamed_reads, "LARGE_BYTES", 32 << 10)
    monkeypatch.setattr(streamed_reads, "KEEP_BYTES", 1 << 20)
    real_finish = streamed_reads.StreamedReads.finish

    def finish(self):
        SERVED.append(dict(self.served))
        return real_finish(self)

    monkeypatch.setattr(streamed_reads.StreamedReads, "finish", finish)


@pytest.mark.parametrize("fixture", ["qwen2moe-g128-sym", "qwen2moe-g32-actorder"])
def test_a_ring_smaller_than_a_layer_converts_losslessly(tmp_path, tiny_ring, fixture):
    src = FIXTURES_DIR / fixture
    out = tmp_path / "out"
    SERVED.clear()
    convert(str(src), out, quiet=True, shard_size="1MB")
    served = SERVED[-1]
    assert served["ring"] and served["kept"] and served["file"], served  # all three sources were used
    report = verify(out, str(src), quiet=True)
    assert report.stacks_checked and report.tensors_compared
    recorded = json.loads((out / MANIFEST_FILE).read_text())["source_files"]
    for name in ("model.safetensors", "config.json"):
        assert recorded[name]["sha256"] == hashlib.sha256((src / name).read_bytes()).hexdigest()
