"""Joined stacks: the converter writes each shared tensor right after its routed twin (formats/SPEC.md section 5),
and the runtime views each pair as one [E + C] tensor without copying, or refuses to when the bytes do not allow it.
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rich.console import Console

from repack.convert import convert, interleave_streams
from repack.formats.checkpoint import CheckpointReader, PlannedTensor, TensorEntry, plan_shards, read_repack_config
from repack.formats.errors import RepackError
from repack.formats.gptq import GptqScheme
from repack.formats.stacks import ROUTED, SHARED, StackInfo, joinable
from repack.plan import JoinedStacks
from repack.runtime import load
from repack.runtime.weights import MoeWeights, join_adjacent, stacked_view
from repack.synthetic import write_synthetic_checkpoint
from repack.verify import verify
from tests.support.cli import run_cli
from tests.support.fixtures import FIXTURES_DIR
from tests.support.plan_text import tensor_lines
from tests.support.tensor_ops import ALLOWED_OPS, OpRecorder

# Joinable by construction: C = 2 chunks of the routed I (sym, act-order), and C = 1 of the same I (asym, act-order).
JOINABLE_SOURCES = {
    "qwen2-chunks": dict(
        family="qwen2_moe", scheme=GptqScheme(4, 32, True, "gptq"), act_order=True, shared_intermediate_size=128
    ),
    "deepseek3-asym": dict(
        family="deepseek_v3", scheme=GptqScheme(4, 32, False, "gptq"), act_order=True, shared_intermediate_size=64
    ),
}


def write_source(folder: Path, name: str) -> Path:
    return write_synthetic_checkpoint(
        folder, **JOINABLE_SOURCES[name], num_layers=2, hidden_size=128, intermediate_size=64, num_experts=8, seed=3
    )


@pytest.fixture(scope="module", params=list(JOINABLE_SOURCES))
def joined_checkpoint(request, tmp_path_factory) -> tuple[Path, Path]:
    """(source, output) of a joinable synthetic checkpoint converted into many small shards."""
    folder = tmp_path_factory.mktemp(request.param)
    source = write_source(folder / "src", request.param)
    convert(str(source), folder / "out", shard_size="20kB", quiet=True)
    return source, folder / "out"


def layer_pairs(out: Path) -> list[tuple[StackInfo, StackInfo]]:
    """(routed, shared) stack infos of every layer that has both."""
    _, stacks = read_repack_config(out)
    shared = {s.prefix.rsplit(".", 1)[0]: s for s in stacks if s.kind == SHARED}
    return [(s, shared[s.prefix.rsplit(".", 1)[0]]) for s in stacks if s.kind == ROUTED]


def tensor_pairs(routed: StackInfo, shared: StackInfo) -> list[tuple[str, str]]:
    return list(zip(routed.tensor_names(), shared.tensor_names(), strict=True))


def back_to_back(first: TensorEntry, second: TensorEntry) -> bool:
    return first.file == second.file and second.offset == first.offset + first.nbytes


def file_order(reader: CheckpointReader) -> list[str]:
    """Every tensor name in the order of the bytes: shard by shard, by data offset."""
    return sorted(reader.names(), key=lambda name: (reader.entry(name).file, reader.entry(name).offset))


# ------------------------------------------------------------------------------------------- converter


def test_joinable_layers_are_written_back_to_back_across_many_shards(joined_checkpoint):
    source, out = joined_checkpoint
    reader = CheckpointReader(out)
    assert len(reader.files) > 4  # small shards: many shard boundaries to fall between the pairs
    pairs = layer_pairs(out)
    assert len(pairs) == 2 and all(joinable(routed, shared) for routed, shared in pairs)
    for routed, shared in pairs:
        for routed_name, shared_name in tensor_pairs(routed, shared):
            assert back_to_back(reader.entry(routed_name), reader.entry(shared_name)), shared_name
    verify(out, str(source))  # the inverse still rebuilds every source tensor bit for bit


def test_the_plan_shows_the_order_the_files_hold(joined_checkpoint, tmp_path):
    source, out = joined_checkpoint
    console = Console(width=400, record=True, file=io.StringIO())
    plan = convert(str(source), tmp_path / "unused", dry_run=True, console=console)
    names = [t.name for t in plan.output_tensors()]
    assert names == file_order(CheckpointReader(out))
    printed = console.export_text()
    shown = tensor_lines(printed)
    rows = [shown[name] for name in names]
    assert rows == sorted(rows)  # --dry-run prints them in that order too
    joined = [step for group in plan.groups for step in group.steps if isinstance(step, JoinedStacks)]
    assert len(joined) == 2 and [s.kind for s in plan.stacks].count(SHARED) == 2
    followers = [t for t in plan.output_tensors() if t.follows is not None]
    assert followers and all(".shared_experts." in t.name for t in followers)


def test_inspect_and_verify_cli_read_the_new_order(joined_checkpoint):
    source, out = joined_checkpoint
    shown = run_cli("inspect", out)
    assert shown.exit_code == 0 and "routed" in shown.stdout and "shared" in shown.stdout, shown.output
    checked = run_cli("verify", out, "--source", source)
    assert checked.exit_code == 0 and "bit-exact" in checked.stdout, checked.output


def test_layers_that_cannot_join_keep_routed_then_shared():
    """The fixture's shared expert (512) is no multiple of the routed size (384): one expert of another I."""
    plan = convert(str(FIXTURES_DIR / "qwen2moe-g128-sym"), Path("/nonexistent/out"), dry_run=True)
    assert not any(isinstance(step, JoinedStacks) for group in plan.groups for step in group.steps)
    assert all(t.follows is None for t in plan.output_tensors())
    for routed, shared in zip(plan.stacks[::2], plan.stacks[1::2], strict=True):
        assert (routed.kind, shared.kind) == (ROUTED, SHARED) and not joinable(routed, shared)
        names = [t.name for t in plan.output_tensors()]
        assert names.index(routed.tensor_names()[-1]) + 1 == names.index(shared.tensor_names()[0])


def test_joinable_needs_the_same_scheme_tensors_and_shapes():
    routed = StackInfo("l.0.mlp.experts", ROUTED, 8, 128, 64, 4, 32, True, "gptq", False, False, True)
    shared = replace(routed, prefix="l.0.mlp.shared_experts", kind=SHARED, num_experts=2)
    assert joinable(routed, shared)
    for change in (
        dict(sym=False),  # zeros in one stack only
        dict(act_order_w2=True),  # a perm in one stack only
        dict(intermediate_size=128),  # one shared expert of its own size
        dict(group_size=64),
        dict(bits=8),
    ):
        assert not joinable(routed, replace(shared, **change)), change


def test_plan_shards_never_splits_a_pair():
    tensors = []
    for layer in range(3):
        routed = PlannedTensor(f"l{layer}.experts.w", "I32", (10,))
        tensors += [PlannedTensor(f"l{layer}.copy", "U8", (4,)), routed]
        tensors.append(PlannedTensor(f"l{layer}.shared_experts.w", "I32", (10,), follows=routed.name))
    shards = plan_shards(tensors, max_shard_bytes=48)  # a pair (80 bytes) never fits with anything else
    assert [t.name for s in shards for t in s.tensors] == [t.name for t in tensors]
    for shard in shards:
        names = [t.name for t in shard.tensors]
        for index, tensor in enumerate(shard.tensors):
            if tensor.follows is not None:
                assert index > 0 and names[index - 1] == tensor.follows
    misplaced = [tensors[2], tensors[1]]
    with pytest.raises(RepackError, match="must follow"):
        plan_shards(misplaced, 100)


def test_interleaving_holds_at_most_one_piece_per_stream():
    """Two stacks' streams, drained tensor by tensor: each is pulled only up to the first piece it cannot yield yet."""
    pulled = {"a": 0, "b": 0}

    def stream(prefix: str, kinds: list[str], pieces: int):
        for kind in kinds:
            for index in range(pieces):
                pulled[prefix] += 1
                yield f"{prefix}.{kind}", torch.tensor([index])

    streams = {"a": stream("a", ["x", "y"], 3), "b": stream("b", ["x", "y"], 2)}
    order = ["a.x", "b.x", "a.y", "b.y"]
    seen = []
    for name, _ in interleave_streams(streams, order):
        seen.append(name)
        yielded = {prefix: sum(n.startswith(prefix) for n in seen) for prefix in pulled}
        assert all(pulled[prefix] - yielded[prefix] <= 1 for prefix in pulled)
    assert seen == ["a.x"] * 3 + ["b.x"] * 2 + ["a.y"] * 3 + ["b.y"] * 2


# --------------------------------------------------------------------------------------------- runtime


def test_joined_weights_are_views_of_the_loaded_shards(joined_checkpoint):
    _, out = joined_checkpoint
    ckpt = load(out, device="cpu")
    for layer in ckpt.moe_layers:
        routed, shared = ckpt.moe_weights(layer), ckpt.moe_weights(layer, SHARED)
        with OpRecorder() as recorder:
            joined = ckpt.joined_moe_weights(layer)
        assert recorder.ops <= ALLOWED_OPS | {"as_strided.default"}, recorder.ops  # no copy, no cat
        assert joined is not None and joined.routed_experts == routed.num_experts
        assert joined.num_experts == routed.num_experts + shared.num_experts
        assert joined.config_experts == routed.num_experts
        for kind in ("w13_qweight", "w13_scales", "w13_zeros", "w13_perm", "w2_qweight", "w2_scales", "w2_zeros"):
            first, second, both = getattr(routed, kind), getattr(shared, kind), getattr(joined, kind)
            assert (first is None) == (second is None) == (both is None), kind
            if both is None:
                continue
            assert both.data_ptr() == first.data_ptr(), kind
            assert both.untyped_storage().data_ptr() == first.untyped_storage().data_ptr(), kind
            assert both[routed.num_experts :].data_ptr() == second.data_ptr(), kind
            assert torch.equal(both[: routed.num_experts], first) and torch.equal(both[routed.num_experts :], second)


def test_an_older_layout_loads_as_two_stacks(tmp_path, monkeypatch):
    """Written as before joined stacks existed (routed stack, then shared stack): no view, the block runs two calls."""
    source = write_source(tmp_path / "src", "qwen2-chunks")
    monkeypatch.setattr("repack.plan.joinable", lambda routed, shared: False)
    convert(str(source), tmp_path / "out", quiet=True)
    ckpt = load(tmp_path / "out", device="cpu")
    assert ckpt.moe_weights(0, SHARED) is not None and ckpt.joined_moe_weights(0) is None
    block = ckpt.moe_block(0, shared_mode="joined")
    assert block.joined is None and "separate" in block.extra_repr()


def small_stack(experts: int, zeros: bool = False, buffer: torch.Tensor | None = None) -> MoeWeights:
    """A sym or asym stack of H = I = 64 (group 32), its tensors fresh or taken from ``buffer`` one after another."""
    shapes = {
        "w13_qweight": ((experts, 128, 8), torch.int32),
        "w13_scales": ((experts, 2, 128), torch.float16),
        "w2_qweight": ((experts, 64, 8), torch.int32),
        "w2_scales": ((experts, 2, 64), torch.float16),
    }
    if zeros:
        shapes |= {"w13_zeros": ((experts, 2, 128), torch.uint8), "w2_zeros": ((experts, 2, 64), torch.uint8)}
    return MoeWeights(**{name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in shapes.items()}, bits=4,
                      group_size=32)  # fmt: skip


def adjacent_stacks(experts: int, chunks: int, gap: int = 0) -> tuple[MoeWeights, MoeWeights]:
    """Routed and shared stacks whose tensors lie in one buffer, each shared one ``gap`` elements after its twin."""
    routed, shared = small_stack(experts), small_stack(chunks)
    total = sum(getattr(s, k).nbytes + gap * 4 for s in (routed, shared) for k in ("w13_qweight", "w2_qweight"))
    total += sum(getattr(s, k).nbytes for s in (routed, shared) for k in ("w13_scales", "w2_scales"))
    buffer, offset = torch.zeros(total, dtype=torch.uint8), 0
    for kind in ("w13_qweight", "w13_scales", "w2_qweight", "w2_scales"):
        for stack in (routed, shared):
            tensor = getattr(stack, kind)
            if stack is shared and tensor.dtype == torch.int32:
                offset += gap * 4
            view = buffer[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
            setattr(stack, kind, view)
            offset += tensor.nbytes
    return routed, shared


def test_join_adjacent_views_one_buffer_and_refuses_everything_else():
    routed, shared = adjacent_stacks(4, 2)
    joined = join_adjacent(routed, shared)
    assert joined is not None and joined.w13_qweight.shape == (6, 128, 8) and joined.routed_experts == 4
    assert joined.w2_scales.data_ptr() == routed.w2_scales.data_ptr()
    assert joined.w2_scales[4:].data_ptr() == shared.w2_scales.data_ptr()

    assert join_adjacent(small_stack(4), small_stack(2)) is None  # separate allocations
    assert join_adjacent(*adjacent_stacks(4, 2, gap=1)) is None  # one buffer, not back to back
    assert join_adjacent(shared, routed) is None  # the wrong way round
    assert join_adjacent(routed, replace(shared, word_order="mma128")) is None
    assert join_adjacent(routed, replace(shared, group_size=64)) is None
    assert join_adjacent(routed, replace(shared, w13_zeros=torch.zeros(2, 2, 128, dtype=torch.uint8))) is None
    assert join_adjacent(joined, shared) is None  # already joined
    assert stacked_view(routed.w13_qweight, shared.w13_qweight.view(torch.float32)) is None  # dtypes differ
    transposed = routed.w2_qweight.transpose(1, 2)
    assert stacked_view(transposed, shared.w2_qweight.transpose(1, 2)) is None  # not contiguous


def test_a_joined_stack_uses_the_routed_table_with_decode_decided_on_its_pairs(tmp_path, monkeypatch):
    """The tuned table of the routed shape (E=6 here) serves the joined stack (E + C = 8); entries are picked among
    the decode ones or the tensor-core ones, as direct_mode says for the joined call's pairs (top-k + C per token)."""
    from repack.runtime import kernel_config
    from repack.runtime.fused_moe import get_config

    decode = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=1, num_stages=1, DIRECT=True)
    tiles = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3, WEIGHT_MAJOR=True)
    table = {1: decode, 4: dict(decode, num_warps=2), 8: tiles, 64: dict(tiles, BLOCK_M=64)}
    name = kernel_config.config_file_name(6, 192, kernel_config.device_name("cpu"))
    (tmp_path / name).write_text(json.dumps({str(m): cfg for m, cfg in table.items()}))
    monkeypatch.setenv("REPACK_MOE_CONFIG_DIR", str(tmp_path))
    kernel_config.load_configs.cache_clear()

    def stack(experts: int, routed: int | None = None) -> MoeWeights:
        empty = lambda *shape: torch.empty(shape, device="meta")  # noqa: E731
        return MoeWeights(empty(experts, 384, 16), empty(experts, 1, 384), empty(experts, 128, 24),
                          empty(experts, 1, 128), 4, 128, routed_experts=routed)  # fmt: skip

    def config(weights: MoeWeights, tokens: int, top_k: int) -> kernel_config.KernelConfig:
        return get_config(weights, tokens, top_k, torch.float16, torch.device("cpu"))

    typed = {m: kernel_config.KernelConfig.from_dict(entry) for m, entry in table.items()}
    try:
        routed, joined = stack(6), stack(8, routed=6)
        assert config(routed, 8, 2) == typed[8]  # routed: the table as tuned
        assert config(joined, 2, 4) == typed[1]  # 8 pairs on 8 experts: decode, the nearest decode entry
        assert config(joined, 4, 4) == typed[8]  # 16 pairs: more than experts, so tensor cores (nearest such entry)
        assert config(joined, 12, 4) == typed[8]  # 48 pairs: tensor cores
        assert config(stack(8), 4, 4) == kernel_config.INTERPRETER_CONFIG  # no table for E=8 itself
    finally:
        kernel_config.load_configs.cache_clear()
