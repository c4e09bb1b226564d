"""The plugin's experts loading and tensor/expert parallelism against stand-ins of vLLM 0.26's and 0.32's loaders
(tests/support/vllm_stand_ins.py), without vLLM: CI installs only the CPU build (0.32, tests/vllm runs it end to
end), and vLLM 0.26's GPU build runs only on the H200.

- The stand-in of 0.26's own ``RoutedExperts.load_weights`` reproduces the failure of the first H200 run exactly
  (``stored torch.int32 [16, 768] but the stack needs torch.int32 [8, 768, 32]`` on the g128 fixture), so it
  does what 0.26 does with our names; with the plugin's loading in its place every stack reaches its parameter
  whole, on both versions, through the runner and through DeepSeek's own loader.
- A stack tensor that never arrives is one error line, not random weights.
- Each tensor-parallel rank keeps its slice of every stack tensor and each expert-parallel rank its whole experts
  (plus the zero expert), and the ranks' block outputs, run by the kernels, sum to the unsharded block's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from repack.formats.errors import RepackError
from repack.formats.gptq import GptqScheme
from repack.runtime.integrations.vllm.sharding import plan_shard
from tests.support.fixtures import FIXTURES_DIR
from tests.support.vllm_stand_ins import (
    StandInExperts,
    StandInParallel,
    deepseek_load,
    parallel_layout,
    runner_load,
    stand_in_vllm,
)

VERSIONS = [(0, 26), (0, 32)]
BLOCK = "model.layers.0.mlp"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> converted folder: the g128 fixture (the H200's failing case), a Qwen2-MoE whose intermediate size
    cuts in two on the mma128 blocks (H 128, I 256, 4 experts, a shared expert of two 256 chunks) and the Qwen3-MoE
    fixture (no shared expert: the runtime's own routing may run it)."""
    from repack.convert import convert
    from repack.synthetic import write_synthetic_checkpoint

    root = tmp_path_factory.mktemp("vllm-loading")
    out = {"g128": convert_to(convert, FIXTURES_DIR / "qwen2moe-g128-sym", root / "g128")}
    source = write_synthetic_checkpoint(
        root / "source",
        family="qwen2_moe",
        scheme=GptqScheme(4, 128, True, "gptq"),
        num_layers=1,
        hidden_size=128,
        intermediate_size=256,
        num_experts=4,
        top_k=2,
        vocab_size=64,
    )
    out["tp"] = convert_to(convert, source, root / "tp")
    out["qwen3"] = convert_to(convert, FIXTURES_DIR / "qwen3moe-g128-sym", root / "qwen3")
    return out


def convert_to(convert, source: Path, out: Path) -> Path:
    convert(str(source), out, quiet=True)
    return out


def stored_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def build(version, checkpoint: Path, tp_size: int = 1, rank: int = 0, expert_parallel: bool = False, gate="gate_proj"):
    """(config, method, layer) for the first MoE block of ``checkpoint`` on one rank, weights created; ``gate`` "w1":
    an experts layer that names its projections as vLLM's Mixtral does."""
    from repack.runtime.integrations.vllm.config import RepackVllmConfig
    from repack.runtime.integrations.vllm.moe import RepackMoEMethod
    from repack.runtime.routers import router_spec

    text_config = json.loads((checkpoint / "config.json").read_text())
    config = RepackVllmConfig(text_config["quantization_config"])
    config.model_type = text_config["model_type"]
    stacks = config.blocks[BLOCK]
    routed = stacks["routed"]
    layout = parallel_layout(tp_size, rank, expert_parallel)
    layer = StandInExperts(version, f"{BLOCK}.experts", routed.num_experts, routed.hidden_size, layout, gate)
    method = RepackMoEMethod(layer.moe_config, routed, stacks.get("shared"), router_spec(text_config))
    experts = routed.num_experts // layout.ep_size
    intermediate = routed.intermediate_size // layout.tp_size
    method.create_weights(layer, experts, routed.hidden_size, intermediate, torch.float16)
    return config, method, layer


def renamed_block_tensors(config, checkpoint: Path) -> list[tuple[str, torch.Tensor]]:
    """The block's stack tensors as the version's weight loader sees them: through the renames it takes from the
    config (0.32: get_checkpoint_weight_mapper; 0.26: get_cache_scale_mapper, module internals)."""
    from repack.runtime.integrations.vllm.internals import vllm_takes_checkpoint_weight_mapper

    takes_hook = vllm_takes_checkpoint_weight_mapper()
    mapper = config.get_checkpoint_weight_mapper() if takes_hook else config.get_cache_scale_mapper()
    tensors = {name: t for name, t in stored_tensors(checkpoint).items() if name.startswith(f"{BLOCK}.")}
    stacks = {name: tensor for name, tensor in tensors.items() if "experts." in name}  # routed and shared stacks
    assert stacks, "no stack tensors found in the block"
    return list(mapper.apply(sorted(stacks.items())))


def test_vllm_026s_own_experts_loader_cuts_our_stack_apart_as_on_the_h200(checkpoints):
    with stand_in_vllm((0, 26)):
        config, _, layer = build((0, 26), checkpoints["g128"])
        weights = dict(renamed_block_tensors(config, checkpoints["g128"]))
        # a 3-D stack tensor (the qweights of "mma128_tiles" are 5-D, which this loader passes whole)
        first = [(name, weights[name]) for name in weights if name.endswith("0.gate_proj.scales")]
        relative = [(name.removeprefix(f"{BLOCK}.experts."), tensor) for name, tensor in first]
        with pytest.raises(RepackError) as error:
            list(StandInExperts.load_weights(layer, relative))  # vLLM's own method, not the layer's (ours)
    # transposed (its last axis is not H), cut in two along axis 1 and unbound: the H200 saw w13_qweight [16, 768]
    assert "stored torch.float16 [384, 2] but the stack needs torch.float16 [8, 2, 768]" in str(error.value)


@pytest.mark.parametrize("version", VERSIONS, ids=lambda v: f"{v[0]}.{v[1]}")
@pytest.mark.parametrize("path", ["runner", "deepseek"])
def test_every_stack_reaches_its_parameter_whole(checkpoints, version, path):
    with stand_in_vllm(version):
        from repack.runtime.integrations.vllm.moe import param_name

        config, method, layer = build(version, checkpoints["g128"])
        weights = renamed_block_tensors(config, checkpoints["g128"])
        loaded = (runner_load if path == "runner" else deepseek_load)(layer, weights)
        method.process_weights_after_loading(layer)
        stored = stored_tensors(checkpoints["g128"])
        params = [p.repack_stack for p in method.params.values()]
        assert sorted(loaded) == sorted(param_name(kind, shared) for kind, shared in params)
        assert any(shared for _, shared in params), "the fixture's shared expert is stacked"
        for kind, shared in params:
            info = method.shared_info if shared else method.routed_info
            assert torch.equal(getattr(layer, param_name(kind, shared)).data, stored[f"{info.prefix}.{kind}"])


@pytest.mark.parametrize("version", VERSIONS, ids=lambda v: f"{v[0]}.{v[1]}")
def test_mixtral_experts_named_w1_w2_load_on_both_versions(checkpoints, version):
    """vLLM names Mixtral's expert projections w1/w2/w3. 0.32's Mixtral loader renames ``.gate_proj.`` to ``.w1.``
    (our poses arrive as ``0.w1.*``), 0.26's does not (they arrive as ``0.gate_proj.*``), and 0.26's own experts
    loader, matching only ``experts.<j>.w1.``, would pass them by without a word."""
    with stand_in_vllm(version):
        config, method, layer = build(version, checkpoints["g128"], gate="w1")
        weights = renamed_block_tensors(config, checkpoints["g128"])
        if version == (0, 32):
            weights = [(n.replace(".gate_proj.", ".w1.").replace(".down_proj.", ".w2."), t) for n, t in weights]
        else:
            assert list(StandInExperts.load_weights(layer, runner_relative(weights))) == []  # vLLM 0.26's: nothing
        runner_load(layer, weights)
        method.process_weights_after_loading(layer)


def runner_relative(weights):
    return [(name.removeprefix(f"{BLOCK}.experts."), tensor) for name, tensor in weights]


def test_a_stack_tensor_that_never_arrives_is_one_error_line(checkpoints):
    with stand_in_vllm((0, 26)):
        config, method, layer = build((0, 26), checkpoints["g128"])
        weights = [
            (n, t)
            for n, t in renamed_block_tensors(config, checkpoints["g128"])
            if not n.endswith("0.down_proj.scales")
        ]
        runner_load(layer, weights)
        with pytest.raises(RepackError) as error:
            method.process_weights_after_loading(layer)
    message = str(error.value)
    assert "\n" not in message and "w2_scales" in message and "not loaded from the checkpoint" in message


def test_a_tensor_under_the_experts_that_is_no_stack_is_one_error_line(checkpoints):
    with stand_in_vllm((0, 26)):
        _, _, layer = build((0, 26), checkpoints["g128"])
        with pytest.raises(RepackError) as error:
            runner_load(layer, [(f"{BLOCK}.experts.3.up_proj.qweight", torch.zeros(4, 4, dtype=torch.int32))])
    assert "not a tensor of this layer's expert stacks" in str(error.value)


def block_output(method, layer, x, topk_weights, topk_ids) -> torch.Tensor:
    return method.apply(layer, x, topk_weights, topk_ids, None, None).float()


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_each_rank_keeps_its_part_and_the_ranks_sum_to_the_whole_block(checkpoints, device, expert_parallel):
    checkpoint = checkpoints["tp"]
    gen = torch.Generator().manual_seed(0)
    with stand_in_vllm((0, 26)):
        config, method, layer = build((0, 26), checkpoint)
        routed = method.routed_info
        runner_load(layer, renamed_block_tensors(config, checkpoint))
        layer.to(device)
        method.process_weights_after_loading(layer)
        x = (torch.randn(5, routed.hidden_size, generator=gen) * 0.5).to(device, torch.float16)
        topk_ids = torch.stack([torch.randperm(routed.num_experts, generator=gen)[:2] for _ in range(5)]).to(device)
        topk_weights = torch.rand(5, 2, generator=gen).to(device)
        whole = block_output(method, layer, x, topk_weights, topk_ids)
        total = torch.zeros_like(whole)
        stored = stored_tensors(checkpoint)
        for rank in range(2):
            _, part, rank_layer = build((0, 26), checkpoint, tp_size=2, rank=rank, expert_parallel=expert_parallel)
            runner_load(rank_layer, renamed_block_tensors(config, checkpoint))
            shard = plan_shard(routed, tp=(0, 1) if expert_parallel else (rank, 2),
                               experts=[2 * rank, 2 * rank + 1], ep_size=2 if expert_parallel else 1)  # fmt: skip
            w13 = stored[f"{routed.prefix}.w13_qweight"]
            kept = rank_layer.w13_qweight.data[: shard.local.num_experts]
            assert torch.equal(kept, shard.cut("w13_qweight", w13))
            if expert_parallel:
                assert torch.count_nonzero(rank_layer.w13_scales.data[-1]) == 0  # the zero expert
            rank_layer.to(device)
            part.process_weights_after_loading(rank_layer)
            total += block_output(part, rank_layer, x, topk_weights, topk_ids)
    scale = float(whole.abs().max())
    relative = float((total - whole).abs().max()) / scale
    print(f"block output max |y| {scale:.3e}, ranks' sum off by {relative:.1e} relative")
    assert scale > 0 and relative < 2e-3


def test_a_data_parallel_layout_is_one_error_line(checkpoints):
    with stand_in_vllm((0, 26)):
        from repack.runtime.integrations.vllm.config import RepackVllmConfig
        from repack.runtime.integrations.vllm.moe import RepackMoEMethod
        from repack.runtime.routers import router_spec

        text_config = json.loads((checkpoints["g128"] / "config.json").read_text())
        stacks = RepackVllmConfig(text_config["quantization_config"]).blocks[BLOCK]
        layer = StandInExperts((0, 26), f"{BLOCK}.experts", 8, 256, StandInParallel(dp_size=2))
        method = RepackMoEMethod(layer.moe_config, stacks["routed"], stacks.get("shared"), router_spec(text_config))
        with pytest.raises(RepackError) as error:
            method.create_weights(layer, 8, 256, 384, torch.float16)
    assert "data-parallel size 2" in str(error.value) and "\n" not in str(error.value)


# ---------------------------------------------------------------- the stand-in of 0.26 against 0.26's own source

CARRIED_026 = Path(__file__).parents[2].parent / "shared" / "vllm-gpu" / "site.tar.xz"  # ../shared/vllm-gpu
REAL_026_METHODS = ("load_weights", "get_expert_mapping", "build_expert_params_mapping")


def real_026_experts_class():
    """A StandInExperts whose ``load_weights`` and expert mapping are vLLM 0.26.0's own ``RoutedExperts`` methods,
    compiled from the carried build's ``routed_experts.py`` (read here, never stored in this repository); None
    where the build is not carried (CI)."""
    import ast
    import logging
    import tarfile
    import types
    from collections.abc import Iterable

    if not CARRIED_026.is_file():
        return None
    with tarfile.open(CARRIED_026, "r:xz") as archive:
        source = archive.extractfile("site/vllm/model_executor/layers/fused_moe/routed_experts.py").read().decode()
    tree = ast.parse(source)
    routed = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "RoutedExperts")
    methods = [node for node in routed.body if isinstance(node, ast.FunctionDef) and node.name in REAL_026_METHODS]
    assert sorted(node.name for node in methods) == sorted(REAL_026_METHODS), "0.26's RoutedExperts changed"
    cls = ast.ClassDef("Real026Experts", [ast.Name("StandInExperts", ast.Load())], [], methods, [])
    module = ast.fix_missing_locations(ast.Module([cls], []))
    eplb = types.SimpleNamespace(build_initial_global_physical_to_logical_map=lambda n, extra: list(range(n + extra)))
    namespace = {
        "StandInExperts": StandInExperts,
        "torch": torch,
        "Iterable": Iterable,
        "logger": logging.getLogger("vllm-0.26-routed-experts"),
        "EplbState": eplb,
    }
    exec(compile(module, str(CARRIED_026), "exec"), namespace)
    return namespace["Real026Experts"]


def recorded_calls(layer, weights) -> list[tuple]:
    """What ``layer``'s own (vLLM-side) ``load_weights`` hands the parameters' weight_loader for ``weights``."""
    calls = []

    def record(param, loaded_weight, weight_name, shard_id, expert_id, return_success):
        calls.append((weight_name, tuple(loaded_weight.shape), loaded_weight.stride(), shard_id, expert_id))
        return True

    for param in layer.parameters():
        param.weight_loader = record
    list(type(layer).load_weights(layer, weights))
    return calls


@pytest.mark.skipif(not CARRIED_026.is_file(), reason="vLLM 0.26.0's build is carried in ../shared/vllm-gpu only")
def test_the_stand_in_of_vllm_026s_experts_loader_does_what_its_source_does(checkpoints):
    import types

    real = real_026_experts_class()
    with stand_in_vllm((0, 26)):
        config, _, layer = build((0, 26), checkpoints["g128"])
        weights = [
            (name.removeprefix(f"{BLOCK}.experts."), tensor)
            for name, tensor in renamed_block_tensors(config, checkpoints["g128"])
        ]
    real_layer = real.__new__(real)
    real_layer.__dict__ = layer.__dict__  # the same parameters and attributes, 0.26's own methods
    real_layer.moe_config = types.SimpleNamespace(
        num_experts=8, num_logical_experts=8, hidden_dim_unpadded=layer.hidden, **vars(layer.moe_config)
    )
    real_layer.expert_map_manager = types.SimpleNamespace(num_fused_shared_experts=0)
    real_layer.ckpt_gate_proj_name, real_layer.ckpt_down_proj_name = "gate_proj", "down_proj"
    real_layer.ckpt_up_proj_name, real_layer.lora_base_layer_prefix = "up_proj", ""
    stand_in = recorded_calls(layer, weights)
    assert stand_in and recorded_calls(real_layer, weights) == stand_in


def test_router_logits_in_route_inside_the_kernels_as_the_runtime_routes(checkpoints, device, monkeypatch):
    """REPACK_VLLM_ROUTING=repack: vLLM hands the logits over (apply_monolithic) and a softmax top-k family routes
    inside the kernels' first launch (fused_moe.routed_moe): the same as the runtime's route() and fused_moe."""
    from repack.runtime.fused_moe import fused_moe
    from repack.runtime.kernels.routing import route

    monkeypatch.setenv("REPACK_VLLM_ROUTING", "repack")
    with stand_in_vllm((0, 26)):
        config, method, layer = build((0, 26), checkpoints["qwen3"])
        runner_load(layer, renamed_block_tensors(config, checkpoints["qwen3"]))
        layer.to(device)
        method.process_weights_after_loading(layer)
        assert method.is_monolithic
        gen = torch.Generator().manual_seed(3)
        routed = method.block.routed
        x = (torch.randn(6, routed.hidden_size, generator=gen) * 0.5).to(device, torch.float16)
        logits = torch.randn(6, routed.num_experts, generator=gen).to(device)
        out = method.apply_monolithic(layer, x, logits)
    weights, ids = route(logits, method.block.spec.top_k, method.block.spec.renormalize)
    torch.testing.assert_close(out, fused_moe(x, routed, ids, weights), rtol=1e-3, atol=1e-4)
