"""The MoE block of every family: routing vs transformers' own routers, whole block vs a float32 reference.

The routing references are the source models' router modules from transformers, run in float32. The
block reference dequantizes the SOURCE GPTQ checkpoint (not our format) with the GPTQ reader and computes
router + experts + shared expert in float32 torch.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from repack.formats.errors import RepackError
from repack.formats.gptq import GptqLinear, GptqScheme, dequantize
from repack.runtime import MoeWeights, load
from repack.runtime.moe_block import AUTO, JOINED, SEPARATE, SHARED_MODES, MoeBlock
from repack.runtime.routers import router_spec
from repack.synthetic import write_synthetic_checkpoint
from tests.support.checkpoints import convert_fixture, relative_error
from tests.support.fixtures import FIXTURES_DIR

HIDDEN, EXPERTS = 64, 16
ROUTERS = {
    "qwen2_moe": (Qwen2MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=4), Qwen2MoeTopKRouter),
    "qwen2_moe_norm": (
        Qwen2MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=4, norm_topk_prob=True),
        Qwen2MoeTopKRouter,
    ),
    "qwen3_moe": (
        Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=1, norm_topk_prob=True),
        Qwen3MoeTopKRouter,
    ),
    "mixtral": (MixtralConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS, num_experts_per_tok=2), MixtralTopKRouter),
    "deepseek_v2_greedy": (
        DeepseekV2Config(
            hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=3, routed_scaling_factor=16.0
        ),
        DeepseekV2TopkRouter,
    ),
    "deepseek_v2_group_limited": (
        DeepseekV2Config(
            hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=3, topk_method="group_limited_greedy",
            n_group=4, topk_group=2, routed_scaling_factor=16.0,
        ),
        DeepseekV2TopkRouter,
    ),
    "deepseek_v3": (
        DeepseekV3Config(
            hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=4, n_group=4, topk_group=2,
            norm_topk_prob=True, routed_scaling_factor=2.5,
        ),
        DeepseekV3TopkRouter,
    ),
}  # fmt: skip


def dummy_stack(num_experts: int, hidden: int) -> MoeWeights:
    """A stack of the right sizes for building a block whose routing alone is tested."""
    empty = torch.zeros(num_experts, 64, hidden // 8, dtype=torch.int32)
    return MoeWeights(
        empty, torch.zeros(1), torch.zeros(num_experts, hidden, 4, dtype=torch.int32), torch.zeros(1), 4, 32
    )


def sorted_by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both tensors reordered per token by expert id (routers may return top-k in any order)."""
    order = ids.long().argsort(dim=1)
    return weights.float().gather(1, order), ids.long().gather(1, order)


@pytest.mark.parametrize("family", list(ROUTERS))
def test_block_routing_matches_transformers_router(family, device):
    config, router_class = ROUTERS[family]
    generator = torch.Generator().manual_seed(7)
    router = router_class(config)
    weight = torch.randn(EXPERTS, HIDDEN, generator=generator) * 0.3
    bias = torch.randn(EXPERTS, generator=generator) * 0.1
    with torch.no_grad():
        router.weight.copy_(weight.half().float())
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(bias)
    x = torch.randn(40, HIDDEN, generator=generator).half()
    _, expected_weights, expected_ids = router(x.float())

    block = MoeBlock(
        dummy_stack(EXPERTS, HIDDEN),
        weight.half().to(device),
        router_spec(config.to_dict()),
        correction_bias=bias.to(device),
    )
    weights, ids = block.route(x.to(device))
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    weights, ids = sorted_by_expert(weights.cpu(), ids.cpu())
    expected_weights, expected_ids = sorted_by_expert(expected_weights, expected_ids)
    assert torch.equal(ids, expected_ids)
    # Softmax families compute the router linear in fp16 (as the source model run in fp16 does).
    tolerance = 1e-5 if config.model_type.startswith("deepseek") else 2e-3
    torch.testing.assert_close(weights, expected_weights, rtol=tolerance, atol=tolerance)


def test_unsupported_family_is_a_one_line_error():
    with pytest.raises(RepackError, match="model_type 'llama' has no MoE router") as info:
        router_spec({"model_type": "llama", "num_experts_per_tok": 2})
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------ whole block


def source_linear(tensors: dict[str, torch.Tensor], module: str, scheme: GptqScheme) -> torch.Tensor:
    """fp32 [out, in] weight of a source GPTQ linear."""
    return dequantize(GptqLinear.from_tensors(tensors, module), scheme, torch.float32)


def source_mlp(tensors, module: str, names: tuple[str, str, str], scheme: GptqScheme, x: torch.Tensor) -> torch.Tensor:
    gate, up, down = (source_linear(tensors, f"{module}.{n}", scheme) for n in names)
    return (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()


def reference_block(source: Path, layer: int, x: torch.Tensor) -> torch.Tensor:
    """float32 MoE block output computed from the SOURCE checkpoint with transformers' router."""
    config = json.loads((source / "config.json").read_text())
    quant = config["quantization_config"]
    scheme = GptqScheme(quant["bits"], quant["group_size"], quant["sym"], quant["checkpoint_format"])
    tensors = load_file(source / "model.safetensors")
    family = config["model_type"]
    block = f"model.layers.{layer}.block_sparse_moe" if family == "mixtral" else f"model.layers.{layer}.mlp"
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    config_class, router_class = {
        "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeTopKRouter),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeTopKRouter),
        "mixtral": (MixtralConfig, MixtralTopKRouter),
        "deepseek_v2": (DeepseekV2Config, DeepseekV2TopkRouter),
        "deepseek_v3": (DeepseekV3Config, DeepseekV3TopkRouter),
    }[family]
    router = router_class(config_class(**{k: v for k, v in config.items() if k != "quantization_config"}))
    with torch.no_grad():
        router.weight.copy_(tensors[f"{block}.gate.weight"].float())
        if family == "deepseek_v3":
            router.e_score_correction_bias.copy_(tensors[f"{block}.gate.e_score_correction_bias"])
        _, weights, ids = router(x)
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for weight, expert in zip(weights[token].float(), ids[token].tolist(), strict=True):
            out[token] += (
                weight * source_mlp(tensors, f"{block}.experts.{expert}", names, scheme, x[token : token + 1])[0]
            )
    if family == "qwen2_moe":
        gate = torch.sigmoid(x @ tensors[f"{block}.shared_expert_gate.weight"].float().t())
        out += gate * source_mlp(tensors, f"{block}.shared_expert", names, scheme, x)
    elif family.startswith("deepseek"):
        out += source_mlp(tensors, f"{block}.shared_experts", names, scheme, x)
    return out


SHARED_FAMILIES = ("qwen2_moe", "deepseek_v2", "deepseek_v3")


def inter_sizes(intermediate: int, shared: int | None = None) -> dict[str, int]:
    return {"intermediate_size": intermediate} | ({"shared_intermediate_size": shared} if shared else {})


SYNTHETIC = {
    # case: (family, scheme, act_order, sizes). Every shared expert here is joinable with its routed stack: C = 2
    # chunks (qwen2_moe, its mma128 variant, deepseek_v2) or one expert of the routed size (deepseek_v3, asymmetric).
    "qwen2_moe": ("qwen2_moe", GptqScheme(4, 32, True, "gptq"), True, inter_sizes(64, 128)),
    "qwen2_moe_mma128": ("qwen2_moe", GptqScheme(4, 128, True, "gptq"), False, inter_sizes(128, 256)),
    "qwen3_moe": ("qwen3_moe", GptqScheme(4, 64, False, "gptq"), False, inter_sizes(128)),
    "mixtral": ("mixtral", GptqScheme(4, 128, True, "gptq_v2"), False, inter_sizes(128)),
    "deepseek_v2": ("deepseek_v2", GptqScheme(4, 64, True, "gptq"), False, inter_sizes(64, 128)),
    "deepseek_v3": ("deepseek_v3", GptqScheme(4, 32, False, "gptq"), True, inter_sizes(64, 64)),
}
# Both shared modes where there is a shared expert; the mode does not matter for the others.
BLOCK_CASES = [
    (case, mode)
    for case, (family, *_) in SYNTHETIC.items()
    for mode in ((JOINED, SEPARATE) if family in SHARED_FAMILIES else (JOINED,))
]


@pytest.mark.parametrize("case,shared_mode", BLOCK_CASES, ids=[f"{c}-{m}" for c, m in BLOCK_CASES])
def test_block_matches_float32_reference_from_source(case, shared_mode, device, tmp_path):
    family, scheme, act_order, sizes = SYNTHETIC[case]
    source = write_synthetic_checkpoint(
        tmp_path / "src", family=family, scheme=scheme, act_order=act_order, num_layers=1, hidden_size=128,
        num_experts=8, top_k=2, seed=3, **sizes,
    )  # fmt: skip
    ckpt = load(convert_fixture(source, tmp_path / "out"), device=device)
    x = (torch.randn(24, 128, generator=torch.Generator().manual_seed(11))).half()
    expected = reference_block(source, 0, x.float())
    block = ckpt.moe_block(0, shared_mode=shared_mode)
    has_shared = family in SHARED_FAMILIES
    assert (block.shared is not None) == has_shared
    assert (block.joined is not None) == (has_shared and shared_mode == JOINED)  # one fused_moe call
    actual = block(x.to(device)).cpu()
    error = relative_error(actual, expected)
    assert error <= 5e-3, f"{case} ({shared_mode}): relative error {error:.2e} vs the float32 source reference"
    if block.joined is not None:  # the same block in two calls: only the fp16 sum of the two halves differs
        separate = ckpt.moe_block(0, shared_mode=SEPARATE)(x.to(device)).cpu()
        assert relative_error(actual, separate) <= 2e-3


def test_shared_mode_defaults_and_refuses_unknown_modes(tmp_path):
    from repack.runtime import moe_block

    spec = router_spec(ROUTERS["mixtral"][0].to_dict())
    block = MoeBlock(dummy_stack(EXPERTS, HIDDEN), torch.zeros(EXPERTS, HIDDEN), spec)
    assert block.shared_mode == moe_block.DEFAULT_SHARED_MODE and block.shared_mode in SHARED_MODES
    with pytest.raises(RepackError, match="shared_mode 'fused' is not one of"):
        MoeBlock(dummy_stack(EXPERTS, HIDDEN), torch.zeros(EXPERTS, HIDDEN), spec, shared_mode="fused")
    with pytest.raises(RepackError, match="shared_mode 'fused' is not one of"):
        load(tmp_path, device="cpu", shared_mode="fused")


def test_auto_mode_joins_small_calls_and_splits_large_ones(monkeypatch):
    """AUTO: one fused_moe call over the joined stack up to JOINED_MAX_TOKENS tokens, two calls above."""
    from repack.runtime import fused_moe as fused_moe_module
    from repack.runtime import moe_block

    chunks = 2
    calls: list[int] = []

    def fake_fused_moe(x, weights, ids, route_weights):
        assert ids.shape == route_weights.shape and int(ids.max()) < weights.num_experts
        calls.append(weights.num_experts)
        return torch.zeros_like(x)

    monkeypatch.setattr(fused_moe_module, "fused_moe", fake_fused_moe)
    spec = router_spec(ROUTERS["mixtral"][0].to_dict())
    shared = dummy_stack(chunks, HIDDEN)
    block = MoeBlock(dummy_stack(EXPERTS, HIDDEN), torch.zeros(EXPERTS, HIDDEN), spec, shared=shared, shared_mode=AUTO)
    block.joined = dataclasses.replace(dummy_stack(EXPERTS + chunks, HIDDEN), routed_experts=EXPERTS)  # as loaded
    for tokens, expected in ((1, [EXPERTS + chunks]), (moe_block.JOINED_MAX_TOKENS, [EXPERTS + chunks]),
                             (moe_block.JOINED_MAX_TOKENS + 1, [EXPERTS, chunks])):  # fmt: skip
        calls.clear()
        x = torch.zeros(tokens, HIDDEN, dtype=torch.float16)
        block.apply_experts(x, torch.ones(tokens, 2), torch.zeros(tokens, 2, dtype=torch.int32))
        assert calls == expected, f"{tokens} tokens"


def test_block_keeps_batch_shape_and_refuses_float32(device, tmp_path):
    ckpt_dir = convert_fixture(FIXTURES_DIR / "qwen3moe-g128-sym", tmp_path / "out")
    block = load(ckpt_dir, device=device).moe_block(0)
    x = torch.randn(2, 3, 256, dtype=torch.float16, device=device)
    assert block(x).shape == (2, 3, 256)
    with pytest.raises(RepackError, match="float32 is not supported"):
        block(x.float())


def test_a_float_shared_expert_is_refused_not_dropped(tmp_path):
    """A shared expert left in float has no stack (SPEC section 2): moe_block must say so, never skip it."""
    from repack.convert import convert
    from repack.runtime import load
    from tests.support.fixtures import FIXTURES_DIR

    out = tmp_path / "out"
    convert(str(FIXTURES_DIR / "qwen3moe-g128-sym"), out, quiet=True)
    ckpt = load(out, device="cpu")
    ckpt.tensors["model.layers.0.mlp.shared_expert.gate_proj.weight"] = torch.zeros(8, 256, dtype=torch.float16)
    with pytest.raises(RepackError, match="shared expert is stored in float"):
        ckpt.moe_block(0)
