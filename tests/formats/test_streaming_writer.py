"""The streaming shard writer: safetensors bytes exactly as the reference writer makes them, a correct
index, bounded memory whatever the shard size, and one-line errors (disk full, misuse)."""

from __future__ import annotations

import errno
import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from repack.formats import checkpoint
from repack.formats.checkpoint import (
    INDEX_FILE,
    CheckpointReader,
    HashingFile,
    PlannedTensor,
    ShardedWriter,
    dtype_code,
    plan_shards,
)
from repack.formats.errors import RepackError
from tests.support.cli import assert_one_line_error, run_cli
from tests.support.fixtures import FIXTURES_DIR

SYM = FIXTURES_DIR / "qwen2moe-g128-sym"


def sample_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors of every dtype the converter writes, odd sizes included (unaligned tails)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "model.layers.0.mlp.experts.w13_qweight": torch.randint(
            -(2**31), 2**31 - 1, (3, 10, 7), generator=gen, dtype=torch.int32
        ),
        "model.layers.0.mlp.experts.w13_scales": torch.randn(3, 2, 10, generator=gen).half(),
        "model.layers.0.mlp.experts.w13_zeros": torch.randint(0, 16, (3, 2, 10), generator=gen, dtype=torch.uint8),
        "model.embed_tokens.weight": torch.randn(37, 5, generator=gen).half(),
        "model.norm.weight": torch.randn(5, generator=gen).to(torch.bfloat16),
        "lm_head.weight": torch.randn(13, 3, generator=gen),
        "empty": torch.empty(0, 4, dtype=torch.int32),
    }


def data_order(path) -> list[str]:
    """Tensor names of a safetensors file in data-offset order (save_file picks it: dtype, then name)."""
    header = checkpoint.read_safetensors_header(path)
    return sorted(header, key=lambda name: header[name].offset)


def planned(tensors: dict[str, torch.Tensor], order: list[str]) -> list[PlannedTensor]:
    return [PlannedTensor(name, dtype_code(tensors[name].dtype), tuple(tensors[name].shape)) for name in order]


def pieces(tensor: torch.Tensor, count: int) -> list[torch.Tensor]:
    """Split along the first axis (how the converter streams one expert at a time)."""
    if tensor.dim() == 0 or tensor.shape[0] < 2:
        return [tensor]
    return list(torch.tensor_split(tensor, min(count, tensor.shape[0])))


@pytest.mark.parametrize("piecewise", [False, True], ids=["whole", "pieces"])
def test_one_shard_is_byte_identical_to_save_file(tmp_path, piecewise):
    tensors = sample_tensors()
    save_file(tensors, str(tmp_path / "reference.safetensors"), metadata={"format": "pt"})
    order = data_order(tmp_path / "reference.safetensors")
    out = tmp_path / "out"
    out.mkdir()
    writer = ShardedWriter(out, planned(tensors, order), max_shard_bytes=10**9)
    for name in order:
        if piecewise:
            for piece in pieces(tensors[name], 3):
                writer.write(name, piece)
        else:
            writer.add(name, tensors[name])
    written = writer.close()

    shard = out / "model-00001-of-00001.safetensors"
    assert shard.read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    assert written[0].name == shard.name
    assert written[0].sha256 == hashlib.sha256(shard.read_bytes()).hexdigest()
    assert written[0].size == shard.stat().st_size
    assert written[-1].name == INDEX_FILE


def test_shards_and_index_match_the_plan(tmp_path):
    tensors = sample_tensors(1)
    order = list(tensors)
    layout = plan_shards(planned(tensors, order), max_shard_bytes=400)
    writer = ShardedWriter(tmp_path, planned(tensors, order), max_shard_bytes=400)
    for name in order:
        writer.add(name, tensors[name])
    written = {f.name: f for f in writer.close()}

    count = len(layout)
    assert count > 2
    names = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == names
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert set(index["weight_map"]) == set(tensors)
    for name, file in index["weight_map"].items():
        with safe_open(str(tmp_path / file), framework="pt") as handle:
            assert torch.equal(handle.get_tensor(name), tensors[name])
    for name in names:
        data = (tmp_path / name).read_bytes()
        assert written[name].sha256 == hashlib.sha256(data).hexdigest()
        assert written[name].size == len(data)
    reader = CheckpointReader(tmp_path)  # our reader agrees (pread path, data offsets)
    for name, tensor in tensors.items():
        assert torch.equal(reader.read(name), tensor)
        assert b"".join(bytes(p.numpy()) for p in reader.iter_raw(name, 64)) == bytes(
            tensor.reshape(-1).view(torch.uint8).numpy()
        )
    reader.close()


def test_a_shard_larger_than_the_buffer_is_never_held(tmp_path):
    """64 MB into one shard through a 1 MB queue: the writer never holds more than the queue plus one piece."""
    piece_bytes, count, queue_bytes = 256 << 10, 256, 1 << 20
    tensors = [PlannedTensor(f"t{i:03d}", "I32", (piece_bytes // 4,)) for i in range(count)]
    writer = ShardedWriter(tmp_path, tensors, max_shard_bytes=10**12, queue_bytes=queue_bytes)
    for i, planned_tensor in enumerate(tensors):
        data = torch.full((piece_bytes // 4,), i, dtype=torch.int32)
        writer.add(planned_tensor.name, data)
        assert writer.buffered_bytes <= queue_bytes + piece_bytes
    writer.close()
    shard = tmp_path / "model-00001-of-00001.safetensors"
    assert shard.stat().st_size > 64 * queue_bytes
    assert 0 < writer.peak_buffered_bytes <= queue_bytes + piece_bytes
    with safe_open(str(shard), framework="pt") as handle:
        for i in (0, 97, count - 1):
            assert torch.equal(handle.get_tensor(f"t{i:03d}"), torch.full((piece_bytes // 4,), i, dtype=torch.int32))


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_hashing_file_blocks_and_tail(tmp_path, direct):
    """Several staging blocks plus an unaligned tail come out byte for byte, with or without O_DIRECT."""
    payload = torch.randint(0, 256, (3 * 8192 + 1234,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    data = bytes(payload.numpy())
    out = HashingFile(tmp_path / "f.bin", direct=direct, staging_bytes=8192)
    out.write(data[:5000])
    out.write(data[5000:])
    out.close()
    assert (tmp_path / "f.bin").read_bytes() == data
    assert out.sha256.hexdigest() == hashlib.sha256(data).hexdigest()
    assert out.size == len(data)


def test_misuse_is_a_one_line_converter_bug(tmp_path):
    tensors = sample_tensors()
    order = list(tensors)
    writer = ShardedWriter(tmp_path, planned(tensors, order), max_shard_bytes=10**9)
    with pytest.raises(RepackError, match="out of plan order") as error:
        writer.add(order[1], tensors[order[1]])
    assert "\n" not in str(error.value)
    writer.abort()

    writer = ShardedWriter(tmp_path, planned(tensors, order), max_shard_bytes=10**9)
    writer.write(order[0], pieces(tensors[order[0]], 3)[0])
    with pytest.raises(RepackError, match="bytes short"):
        writer.add(order[1], tensors[order[1]])
    writer.abort()

    writer = ShardedWriter(tmp_path, planned(tensors, order), max_shard_bytes=10**9)
    with pytest.raises(RepackError, match="plan says"):
        writer.add(order[0], tensors[order[0]].float())
    writer.abort()


def test_disk_full_in_the_writer_thread_surfaces_on_the_caller(tmp_path, monkeypatch):
    def full(self, block):  # runs in the file's I/O helper thread, behind the writer thread
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.HashingFile, "_write_out", full)
    tensors = [PlannedTensor(f"t{i}", "U8", (8 << 20,)) for i in range(8)]
    writer = ShardedWriter(tmp_path, tensors, max_shard_bytes=10**12, queue_bytes=1 << 20)
    with pytest.raises(OSError) as error:
        for t in tensors:
            writer.add(t.name, torch.zeros(t.shape, dtype=torch.uint8))
        writer.close()
    assert error.value.errno == errno.ENOSPC
    writer.abort()  # after the error: returns at once, leaves no thread behind


def test_disk_full_during_convert_is_one_line(tmp_path, monkeypatch):
    """ENOSPC from a block write in the helper thread -> one line naming the shard, no output left."""
    real_write_out = checkpoint.HashingFile._write_out
    written = {"bytes": 0}

    def fills_up(self, block):
        written["bytes"] += len(block)
        if written["bytes"] > 1 << 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write_out(self, block)

    small_blocks = {"direct": True, "staging_bytes": 64 << 10}  # so the helper thread writes blocks
    monkeypatch.setattr(checkpoint.HashingFile.__init__, "__kwdefaults__", small_blocks)
    monkeypatch.setattr(checkpoint.HashingFile, "_write_out", fills_up)
    out = tmp_path / "out"
    line = assert_one_line_error(run_cli("convert", SYM, out, "--quiet"), "disk full writing", "shard", "need ~")
    assert ".safetensors" in line
    assert written["bytes"] > 1 << 20
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_reader_reads_a_row_range_without_the_rest(tmp_path):
    from repack.formats.checkpoint import CheckpointReader, write_safetensors

    stack = torch.arange(5 * 3 * 4, dtype=torch.int32).view(5, 3, 4)
    write_safetensors(tmp_path / "model.safetensors", {"w": stack})
    reader = CheckpointReader(tmp_path)
    assert torch.equal(reader.read_rows("w", 1, 3), stack[1:3])
    assert reader.read_rows("w", 2, 2).shape == (0, 3, 4)
    with pytest.raises(RepackError, match="rows 4:6 of tensor w"):
        reader.read_rows("w", 4, 6)
