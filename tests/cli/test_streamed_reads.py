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
from repack.formats.errors import RepackError
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


@pytest.fixture
def tiny_verify_rings(tiny_ring, monkeypatch):
    import repack.verify as verify_module

    monkeypatch.setattr(verify_module, "OUTPUT_RING_BYTES", 512 << 10)
    monkeypatch.setattr(verify_module, "OUTPUT_BLOCK_BYTES", 32 << 10)
    monkeypatch.setattr(verify_module, "SOURCE_RING_BYTES", 256 << 10)
    monkeypatch.setattr(verify_module, "KEEP_BYTES", 1 << 20)


def test_verify_with_rings_smaller_than_a_stack_checks_every_tensor(tmp_path, tiny_verify_rings):
    """verify reads an expert's w13 rows, then its w2 rows, a stack apart: with small rings the rows come from the
    ring, from what was kept aside and from the files, and a flipped bit anywhere is still found."""
    src = FIXTURES_DIR / "qwen2moe-g32-actorder"
    out = tmp_path / "out"
    convert(str(src), out, quiet=True, shard_size="1MB")
    made = []
    real = streamed_reads.StreamedReads.__init__

    def remember(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(self)

    import unittest.mock

    with unittest.mock.patch.object(streamed_reads.StreamedReads, "__init__", remember):
        report = verify(out, str(src), quiet=True)
    assert report.tensors_compared and len(made) == 2
    output, source = (reads.served for reads in made)
    assert output["ring"] and output["file"], output  # w2 rows beyond the ring: read from the file
    assert source["ring"] and source["kept"], source
    shard = sorted(out.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(RepackError, match="sha256 differs|bit for bit|differs from the source"):
        verify(out, str(src), quiet=True)


def test_views_and_pieces_are_served_from_the_ring(monkeypatch):
    """verify's reads without copies: a view of the ring (held until released) and a tensor compared piece by
    piece where the ring holds it; a differing byte in a piece is found; the files' hashes are those of the files."""
    from repack.formats.checkpoint import CheckpointReader

    monkeypatch.setattr(streamed_reads, "LARGE_BYTES", 32 << 10)
    src = FIXTURES_DIR / "qwen2moe-g128-sym"
    with CheckpointReader(src) as reader:
        large = sorted((e for e in reader.entries.values() if e.nbytes >= 32 << 10), key=lambda e: (e.file, e.offset))
        viewed, pieces = large[0], large[1]
        data = {e.name: (src / e.file).read_bytes()[e.offset : e.offset + e.nbytes] for e in (viewed, pieces)}
        reads = streamed_reads.StreamedReads(reader, [[viewed.name, pieces.name]])
        try:
            array = reads.view(viewed, viewed.offset, viewed.nbytes)
            assert array is not None and array.tobytes() == data[viewed.name]
            assert reads.served["viewed"] == viewed.nbytes and reads._pins  # counted as read, the ring held there
            half = pieces.nbytes // 2
            theirs = bytearray(data[pieces.name])
            assert reads.compare(pieces, memoryview(theirs[:half]), pieces.offset) is True
            theirs[-1] ^= 1
            assert reads.compare(pieces, memoryview(theirs[half:]), pieces.offset + half) is False
            assert array.tobytes() == data[viewed.name]  # still held after reads past it
            reads.release_views()
            assert not reads._pins
            hashed = reads.finish()
        finally:
            reads.stop()
    for name, result in hashed.items():
        assert result["sha256"] == hashlib.sha256((src / name).read_bytes()).hexdigest()
