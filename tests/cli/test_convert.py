"""convert + verify on the GPTQModel fixtures and on synthetic checkpoints of every family and scheme."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch
from rich.console import Console
from safetensors import safe_open

from repack.convert import convert, parse_size
from repack.formats.checkpoint import CheckpointReader, read_repack_config, write_safetensors
from repack.formats.gptq import GptqScheme
from repack.formats.stacks import INDEX_FILE, MANIFEST_FILE
from repack.synthetic import write_synthetic_checkpoint
from repack.verify import verify
from tests.support.fixtures import FIXTURES
from tests.support.plan_text import tensor_lines


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda p: p.name)
def test_fixture_converts_and_verifies(fixture, tmp_path):
    out = tmp_path / "out"
    manifest = convert(str(fixture), out, shard_size="1MB", quiet=True)
    report = verify(out, str(fixture))
    assert report.stacks_checked == len(read_repack_config(out)[1]) > 0
    shards = sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    assert not list(out.glob("*.partial")) and not list(tmp_path.glob(".out.tmp-*"))
    assert set(manifest.output_files) == {p.name for p in out.iterdir()} - {MANIFEST_FILE}
    assert manifest.source_files["model.safetensors"].size == (fixture / "model.safetensors").stat().st_size
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (fixture / name).read_bytes()
    for name in ("reference.safetensors", "reference.json", "README.txt", "quantize_config.json"):  # not a model's
        assert not (out / name).exists()
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    source_quant = json.loads((fixture / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "repack" and quant["format_version"] == 3
    assert quant["source_quantization_config"] == source_quant


def test_actorder_fixture_stores_perms_and_shared_stack(tmp_path):
    fixture = next(p for p in FIXTURES if "actorder" in p.name)
    out = convert(str(fixture), tmp_path / "out", quiet=True) and tmp_path / "out"
    _, stacks = read_repack_config(out)
    kinds = {(s.prefix.rsplit(".", 1)[1], s.kind) for s in stacks}
    assert kinds == {("experts", "routed"), ("shared_experts", "shared")}
    reader = CheckpointReader(out)
    assert reader.entry("model.layers.0.mlp.experts.w13_perm").shape == (8, 256)
    assert reader.entry("model.layers.0.mlp.experts.w2_perm").shape == (8, 384)
    assert "model.layers.0.mlp.experts.0.gate_proj.qweight" not in reader
    assert all(s.act_order_w13 and s.act_order_w2 for s in stacks)


# (family, scheme, act_order, extra synthetic arguments): every family, both zero formats, asym, all groups.
MATRIX = [
    ("qwen2_moe", GptqScheme(4, 128, True, "gptq"), False, {}),
    ("qwen2_moe", GptqScheme(4, 32, False, "gptq"), True, {"dense_first_layers": 1, "num_layers": 3}),
    ("qwen3_moe", GptqScheme(4, 64, True, "gptq_v2"), False, {}),
    ("qwen3_moe", GptqScheme(4, -1, False, "gptq"), False, {}),
    ("mixtral", GptqScheme(4, 32, True, "gptq"), True, {"mixtral_naming": "v4"}),
    ("mixtral", GptqScheme(4, 64, False, "gptq_v2"), False, {"mixtral_naming": "v5"}),
    ("deepseek_v2", GptqScheme(4, 32, False, "gptq_v2"), True, {"dense_first_layers": 1, "num_layers": 3}),
    ("deepseek_v3", GptqScheme(4, 128, True, "gptq"), False, {"dense_first_layers": 1, "num_layers": 3}),
    ("qwen2_moe", GptqScheme(8, 32, False, "gptq"), True, {}),
]


@pytest.mark.parametrize(
    "family,scheme,act_order,extra",
    MATRIX,
    ids=[
        f"{f}-{s.bits}b-g{s.group_size}-{'sym' if s.sym else 'asym'}-{s.checkpoint_format}-{'act' if a else 'noact'}"
        for f, s, a, _ in MATRIX
    ],
)
def test_synthetic_family_matrix(family, scheme, act_order, extra, tmp_path):
    src = write_synthetic_checkpoint(
        tmp_path / "src", family=family, scheme=scheme, act_order=act_order, shard_size=200_000, **extra
    )
    out = tmp_path / "out"
    convert(str(src), out, shard_size="300kB", quiet=True)
    verify(out, str(src))
    _, stacks = read_repack_config(out)
    sparse_layers = extra.get("num_layers", 2) - extra.get("dense_first_layers", 0)
    assert len([s for s in stacks if s.kind == "routed"]) == sparse_layers
    assert all(s.bits == scheme.bits and s.sym == scheme.sym and s.group_size == scheme.group_size for s in stacks)
    assert all(s.act_order_w13 == act_order for s in stacks)
    if family in ("qwen2_moe", "deepseek_v2", "deepseek_v3"):
        # I_s = 2 I: two chunks when I (64) is a whole number of groups, else one expert of size I_s.
        chunked = scheme.group_size != -1 and 64 % scheme.group_size == 0
        shared = [s for s in stacks if s.kind == "shared"]
        assert shared and all(s.num_experts == (2 if chunked else 1) for s in shared)
    if extra.get("mixtral_naming") == "v4":
        assert stacks[0].prefix.endswith("block_sparse_moe.experts")
    index = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    for name, file in list(index.items())[:5]:
        with safe_open(str(out / file), "pt") as handle:
            assert name in handle.keys()


def test_dry_run_lists_every_output_tensor_and_writes_nothing(tmp_path):
    console = Console(width=400, record=True, file=io.StringIO())
    plan = convert(str(FIXTURES[0]), tmp_path / "out", dry_run=True, console=console)
    printed = console.export_text()
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())
    outputs = [tensor.name for tensor in plan.output_tensors()]
    assert len(outputs) == len(set(outputs)) > 0
    assert set(tensor_lines(printed)) == set(outputs)
    assert "model.layers.1.mlp.experts <- 96: experts.0.gate_proj .. 7.down_proj" in printed  # sources are named


def test_plan_reads_the_source_front_to_back(tmp_path):
    """Tensors outside the layers go where they lie in the files: the embeddings before the layers when stored first,
    lm_head and the final norm after them (it was converted first: a cold read at the end of the last file)."""
    src = write_synthetic_checkpoint(
        tmp_path / "src", family="qwen2_moe", scheme=GptqScheme(4, 128, True, "gptq"), shard_size=100_000
    )
    reader = CheckpointReader(src)
    last = reader.entries["lm_head.weight"]
    assert (last.file, last.offset + last.nbytes) == (reader.files[-1], max(e.offset + e.nbytes for e in
            reader.entries.values() if e.file == last.file))  # fmt: skip
    plan = convert(str(src), tmp_path / "out", dry_run=True, console=Console(file=io.StringIO()))
    assert [group.label for group in plan.groups] == ["layer 0", "layer 1", "other"]
    assert {step.name for step in plan.groups[-1].steps} >= {"lm_head.weight", "model.norm.weight"}

    first = reader.entries["model.embed_tokens.weight"]
    rewritten = tmp_path / "embeddings-first"
    tensors = {name: reader.read(name) for name in reader.names()}
    order = sorted(tensors, key=lambda name: name != first.name)
    rewritten.mkdir()
    for path in src.iterdir():
        if not path.name.endswith(("safetensors", INDEX_FILE)):
            shutil.copy(path, rewritten / path.name)
    write_safetensors(rewritten / "model.safetensors", {name: tensors[name] for name in order})
    plan = convert(str(rewritten), tmp_path / "out", dry_run=True, console=Console(file=io.StringIO()))
    assert [group.label for group in plan.groups] == ["other", "layer 0", "layer 1", "other"]
    assert [step.name for step in plan.groups[0].steps] == [first.name]


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("500mb") == 500 * 10**6
    assert parse_size("1234") == 1234


def test_stack_tensor_dtypes(tmp_path):
    out = tmp_path / "out"
    convert(str(FIXTURES[2]), out, quiet=True)
    reader = CheckpointReader(out)
    assert reader.read("model.layers.0.mlp.experts.w13_qweight").dtype == torch.int32
    assert reader.read("model.layers.0.mlp.experts.w13_scales").dtype == torch.float16
