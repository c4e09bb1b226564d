"""The synthetic GPTQ MoE writer produces checkpoints that look and load like real ones."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from repack.formats.errors import RepackError
from repack.formats.gptq import GptqLinear, GptqScheme, check_linear, check_zero_points, dequantize
from repack.synthetic import (
    ARCHITECTURES,
    synthetic_linear_weight,
    write_demo_checkpoint,
    write_synthetic_checkpoint,
)

transformers = pytest.importorskip("transformers")

SCHEMES = {
    "sym-g128-v1": GptqScheme(bits=4, group_size=128, sym=True, checkpoint_format="gptq"),
    "sym-g32-v1": GptqScheme(bits=4, group_size=32, sym=True, checkpoint_format="gptq"),
    "asym-g64-v1": GptqScheme(bits=4, group_size=64, sym=False, checkpoint_format="gptq"),
    "asym-g32-v2": GptqScheme(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2"),
    "sym-channel-v2": GptqScheme(bits=4, group_size=-1, sym=True, checkpoint_format="gptq_v2"),
    "asym-g32-8bit": GptqScheme(bits=8, group_size=32, sym=False, checkpoint_format="gptq"),
}
FAMILY_CASES = {
    "qwen2_moe": {"family": "qwen2_moe", "dense_first_layers": 1},
    "qwen3_moe": {"family": "qwen3_moe"},
    "mixtral-v4": {"family": "mixtral", "mixtral_naming": "v4"},
    "mixtral-v5": {"family": "mixtral", "mixtral_naming": "v5"},
    "deepseek_v2": {"family": "deepseek_v2", "dense_first_layers": 1},
    "deepseek_v3": {"family": "deepseek_v3", "dense_first_layers": 1, "shared_intermediate_size": 64},
}
EXPERT_PREFIXES = {
    "qwen2_moe": "model.layers.{layer}.mlp.experts.{expert}.{{}}_proj",
    "qwen3_moe": "model.layers.{layer}.mlp.experts.{expert}.{{}}_proj",
    "mixtral-v5": "model.layers.{layer}.mlp.experts.{expert}.{{}}_proj",
}


def _write(tmp_path: Path, case: str, scheme_name: str = "sym-g32-v1", act_order: bool = True, **extra) -> Path:
    kwargs = FAMILY_CASES[case] | {"num_layers": 3} | extra
    return write_synthetic_checkpoint(
        tmp_path / case, scheme=SCHEMES[scheme_name], act_order=act_order, seed=7, **kwargs
    )


def _quantized_linears(tensors: dict[str, torch.Tensor]) -> dict[str, GptqLinear]:
    """Every GPTQ linear of a checkpoint, by module name."""
    return {
        name.removesuffix(".qweight"): GptqLinear(
            qweight=tensors[name],
            qzeros=tensors[name.replace(".qweight", ".qzeros")],
            scales=tensors[name.replace(".qweight", ".scales")],
            g_idx=tensors[name.replace(".qweight", ".g_idx")],
            bias=tensors.get(name.replace(".qweight", ".bias")),
        )
        for name in tensors
        if name.endswith(".qweight")
    }


def _dequantized_copy(source: Path, target: Path, scheme: GptqScheme) -> Path:
    """A float16 copy of the checkpoint (GPTQ linears dequantized to ``.weight``) without quantization_config."""
    tensors = load_file(source / "model.safetensors")
    linears = _quantized_linears(tensors)
    gptq_parts = {f"{name}.{suffix}" for name in linears for suffix in ("qweight", "qzeros", "scales", "g_idx")}
    plain = {name: tensor for name, tensor in tensors.items() if name not in gptq_parts}
    plain |= {f"{name}.weight": dequantize(linear, scheme, torch.float16) for name, linear in linears.items()}
    target.mkdir()
    save_file(plain, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config")
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_config_loads_with_transformers_config_class(tmp_path: Path, case: str) -> None:
    path = _write(tmp_path, case)
    config = transformers.AutoConfig.from_pretrained(path)
    family = FAMILY_CASES[case]["family"]
    assert type(config).__name__ == ARCHITECTURES[family].replace("ForCausalLM", "Config")
    assert config.architectures == [ARCHITECTURES[family]]
    assert config.num_hidden_layers == 3 and config.hidden_size == 128 and config.num_experts_per_tok == 2
    quant = config.quantization_config
    assert {k: quant[k] for k in ("bits", "group_size", "sym", "desc_act", "quant_method", "format")} == {
        "bits": 4,
        "group_size": 32,
        "sym": True,
        "desc_act": True,
        "quant_method": "gptq",
        "format": "gptq",
    }
    assert quant["checkpoint_format"] == "gptq"
    assert json.loads((path / "quantize_config.json").read_text()) == quant
    if family in ("qwen2_moe", "qwen3_moe"):
        assert config.num_experts == 4 and config.moe_intermediate_size == 64
    if family == "qwen2_moe":
        assert config.shared_expert_intermediate_size == 128 and config.mlp_only_layers == [0]
    if family == "mixtral":
        assert config.num_local_experts == 4 and config.intermediate_size == 64
    if family.startswith("deepseek"):
        assert config.n_routed_experts == 4 and config.first_k_dense_replace == 1
        assert config.n_shared_experts == (1 if family == "deepseek_v3" else 2)


@pytest.mark.parametrize("case", [c for c in FAMILY_CASES if c != "mixtral-v5"])
def test_tensor_names_load_into_transformers_model_and_forward_is_finite(tmp_path: Path, case: str) -> None:
    """Dequantized, the checkpoint loads into the family's transformers model with no missing or extra key.

    Mixtral "v5" names (per-expert gate_proj/up_proj/down_proj under mlp) are what GPTQModel writes; plain
    transformers only converts the v4 names of float Mixtral checkpoints, so that case is checked by name.
    """
    scheme = SCHEMES["sym-g32-v1"]
    fp16 = _dequantized_copy(_write(tmp_path, case), tmp_path / "fp16", scheme)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(fp16, output_loading_info=True, dtype=torch.float32)
    assert not any(info.values()), info
    input_ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids).logits
    assert torch.isfinite(logits).all()
    assert 0.01 < float(logits.std()) < 10


def test_mixtral_v5_names_experts_under_mlp(tmp_path: Path) -> None:
    v4 = set(load_file(_write(tmp_path, "mixtral-v4") / "model.safetensors"))
    v5 = set(load_file(_write(tmp_path, "mixtral-v5") / "model.safetensors"))
    renames = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
    converted = set()
    for name in v4:
        for old, new in renames.items():
            name = name.replace(old, new)
        converted.add(name)
    assert converted == v5
    assert "model.layers.0.block_sparse_moe.experts.3.w2.qweight" in v4
    assert "model.layers.0.mlp.gate.weight" in v5


@pytest.mark.parametrize("scheme_name", list(SCHEMES))
@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_every_quantized_linear_has_gptq_shapes_and_zeros(tmp_path: Path, case: str, scheme_name: str) -> None:
    scheme = SCHEMES[scheme_name]
    tensors = load_file(_write(tmp_path, case, scheme_name) / "model.safetensors")
    linears = _quantized_linears(tensors)
    assert len(linears) > 3 * 4 * 3  # experts, shared experts, dense MLPs and attention of 3 layers
    for name, linear in linears.items():
        check_linear(name, linear, scheme)
        check_zero_points(name, linear, scheme)
    floats = [n for n, t in tensors.items() if t.dtype == torch.float16 and not n.endswith(".scales")]
    assert "lm_head.weight" in floats and "model.embed_tokens.weight" in floats


@pytest.mark.parametrize("case", ["qwen2_moe", "qwen3_moe", "mixtral-v5"])
@pytest.mark.parametrize("scheme_name", ["sym-g128-v1", "asym-g64-v1", "asym-g32-v2", "sym-channel-v2"])
def test_expert_dequantizes_within_rtn_error(tmp_path: Path, case: str, scheme_name: str) -> None:
    """|W - dequantize(GPTQ(W))| <= scale / 2 (plus fp16 rounding of the scale) for every routed expert."""
    scheme = SCHEMES[scheme_name]
    tensors = load_file(_write(tmp_path, case, scheme_name) / "model.safetensors")
    linears = _quantized_linears(tensors)
    for layer in range(FAMILY_CASES[case].get("dense_first_layers", 0), 3):
        for expert in range(4):
            for proj in ("gate", "up", "down"):
                name = EXPERT_PREFIXES[case].format(layer=layer, expert=expert).format(proj)
                linear = linears[name]
                k = linear.in_features(scheme)
                weight = synthetic_linear_weight(7, name, k, linear.out_features)
                error = (dequantize(linear, scheme) - weight).abs()
                step = linear.scales.float()[linear.g_idx.long()].t()  # [N, K] scale of each element
                assert bool((error <= 0.51 * step + 1e-7).all()), name
                assert float(error.max()) > 0  # really quantized, not a copy


def test_act_order_gate_and_up_share_g_idx(tmp_path: Path) -> None:
    scheme = SCHEMES["sym-g32-v1"]
    tensors = load_file(_write(tmp_path, "qwen2_moe") / "model.safetensors")
    trivial = torch.arange(128, dtype=torch.int32) // 32
    for expert in ("experts.0", "experts.3", "shared_expert"):
        block = f"model.layers.2.mlp.{expert}"
        gate, up = tensors[f"{block}.gate_proj.g_idx"], tensors[f"{block}.up_proj.g_idx"]
        assert torch.equal(gate, up)
        assert not torch.equal(gate, trivial)
        assert torch.equal(torch.bincount(gate), torch.full((4,), 32))
        down = tensors[f"{block}.down_proj.g_idx"]
        assert torch.equal(torch.bincount(down), torch.full((down.numel() // 32,), 32))
    first, second = (
        tensors["model.layers.2.mlp.experts.0.gate_proj.g_idx"],
        tensors["model.layers.2.mlp.experts.1.gate_proj.g_idx"],
    )
    assert not torch.equal(first, second)
    without = load_file(_write(tmp_path / "plain", "qwen2_moe", act_order=False) / "model.safetensors")
    for name, linear in _quantized_linears(without).items():
        assert torch.equal(linear.g_idx, torch.arange(linear.in_features(scheme), dtype=torch.int32) // 32), name


def test_deterministic_from_seed(tmp_path: Path) -> None:
    first = _write(tmp_path / "a", "deepseek_v3")
    second = _write(tmp_path / "b", "deepseek_v3")
    for filename in ("model.safetensors", "config.json", "quantize_config.json", "tokenizer.json"):
        assert (first / filename).read_bytes() == (second / filename).read_bytes(), filename
    reseeded = write_synthetic_checkpoint(
        tmp_path / "d", family="deepseek_v3", scheme=SCHEMES["sym-g32-v1"], act_order=True, seed=8, num_layers=3
    )
    assert (reseeded / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()


def test_sharded_checkpoint_has_complete_index(tmp_path: Path) -> None:
    single = load_file(_write(tmp_path / "one", "qwen2_moe") / "model.safetensors")
    sharded = _write(tmp_path / "many", "qwen2_moe", shard_size=64 * 1024)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (sharded / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(single)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())
    for filename in files:
        with safe_open(sharded / filename, "pt") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                assert index["weight_map"][name] == filename
                assert torch.equal(shard.get_tensor(name), single[name])


def test_bf16_float_tensors_keep_fp16_scales(tmp_path: Path) -> None:
    path = _write(tmp_path, "qwen3_moe", dtype=torch.bfloat16)
    tensors = load_file(path / "model.safetensors")
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.0.mlp.experts.0.up_proj.scales"].dtype == torch.float16
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"family": "llama"}, "unknown family 'llama'"),
        ({"family": "mixtral", "dense_first_layers": 1}, "mixtral has no dense layers"),
        ({"family": "mixtral", "mixtral_naming": "v6"}, "unknown mixtral_naming"),
        ({"family": "qwen3_moe", "shared_intermediate_size": 128}, "qwen3_moe has no shared expert"),
        ({"family": "deepseek_v2", "shared_intermediate_size": 96}, "must be a multiple of intermediate_size"),
        ({"family": "qwen2_moe", "dense_first_layers": 2}, "leaves no MoE layer"),
        ({"family": "qwen2_moe", "top_k": 5}, "top_k=5"),
    ],
)
def test_bad_arguments_are_one_line_repack_errors(tmp_path: Path, kwargs: dict, fragment: str) -> None:
    with pytest.raises(RepackError, match=fragment) as caught:
        write_synthetic_checkpoint(tmp_path / "x", scheme=SCHEMES["sym-g128-v1"], **kwargs)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "x").exists()


def test_demo_checkpoint_is_qwen2_moe_act_order_with_chunkable_shared_expert(tmp_path: Path) -> None:
    path = write_demo_checkpoint(tmp_path / "demo")
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.model_type == "qwen2_moe" and config.num_hidden_layers == 2
    assert config.shared_expert_intermediate_size % config.moe_intermediate_size == 0
    assert config.shared_expert_intermediate_size > config.moe_intermediate_size
    assert config.moe_intermediate_size % config.quantization_config["group_size"] == 0
    assert config.quantization_config["desc_act"] is True
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer("t1 t2 t511")["input_ids"]
    assert ids == [1, 2, 511] and max(tokenizer.get_vocab().values()) < config.vocab_size
    scheme = GptqScheme(bits=4, group_size=32, sym=True, checkpoint_format="gptq")
    for name, linear in _quantized_linears(load_file(path / "model.safetensors")).items():
        check_linear(name, linear, scheme)
        check_zero_points(name, linear, scheme)


def _load_benchmark_generator():
    """benchmarks/ is not a package: load make_synthetic_57b.py by path."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "make_synthetic_57b.py"
    spec = importlib.util.spec_from_file_location("make_synthetic_57b", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_synthetic_57b", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_57b_plan_has_the_real_names_shapes_and_size() -> None:
    """Full-size plan (no data written): Qwen2-57B-A14B-Instruct-GPTQ-Int4's tensors, ~31 GB, ~4 GB shards."""
    gen = _load_benchmark_generator()
    specs = {spec.name: spec for spec in gen.model_specs(gen.FULL)}
    expert = "model.layers.27.mlp.experts.63"
    expected = {
        f"{expert}.gate_proj.qweight": ("int32", (448, 2560)),
        f"{expert}.gate_proj.qzeros": ("int32", (28, 320)),
        f"{expert}.gate_proj.scales": ("float16", (28, 2560)),
        f"{expert}.down_proj.qweight": ("int32", (320, 3584)),
        f"{expert}.down_proj.g_idx": ("int32", (2560,)),
        "model.layers.0.mlp.shared_expert.up_proj.qweight": ("int32", (448, 20480)),
        "model.layers.0.mlp.shared_expert.down_proj.scales": ("float16", (160, 3584)),
        "model.layers.0.mlp.shared_expert_gate.weight": ("float16", (1, 3584)),
        "model.layers.0.mlp.gate.weight": ("float16", (64, 3584)),
        "model.layers.0.self_attn.k_proj.qweight": ("int32", (448, 512)),
        "model.layers.0.self_attn.k_proj.bias": ("float16", (512,)),
        "model.embed_tokens.weight": ("float16", (151936, 3584)),
        "lm_head.weight": ("float16", (151936, 3584)),
    }
    assert {name: (specs[name].dtype, specs[name].shape) for name in expected} == expected
    assert "model.layers.28.input_layernorm.weight" not in specs
    assert sum(name.endswith(".qweight") for name in specs) == 28 * (64 * 3 + 3 + 4)
    total = sum(spec.nbytes for spec in specs.values())
    assert 30e9 < total < 32e9
    shards = gen.plan_shards(list(specs.values()), gen.DEFAULT_SHARD_BYTES)
    assert len(shards) == 8 and all(sum(s.nbytes for s in shard) <= 4e9 for shard in shards)


def test_57b_generator_small_scale_reads_back_as_valid_gptq(tmp_path: Path) -> None:
    gen = _load_benchmark_generator()
    out = tmp_path / "small"
    gen.main([str(out), "--layers", "2", "--scale", "small", "--shard-size", str(1 << 20)])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    planned = {spec.name: spec for spec in gen.model_specs(gen.SMALL) if not spec.name.startswith("model.layers.")}
    planned |= {spec.name: spec for spec in gen.model_specs(gen.SMALL) if spec.name.startswith("model.layers.0.")}
    tensors: dict[str, torch.Tensor] = {}
    for filename in sorted(set(index["weight_map"].values())):
        with safe_open(out / filename, "pt") as shard:
            tensors |= {name: shard.get_tensor(name) for name in shard.keys()}  # noqa: SIM118
    assert set(tensors) == set(index["weight_map"]) and len(set(index["weight_map"].values())) > 2
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert any(name.startswith("model.layers.1.") for name in tensors)
    for name, spec in planned.items():
        assert (str(tensors[name].dtype).removeprefix("torch."), tuple(tensors[name].shape)) == (
            spec.dtype,
            spec.shape,
        )
    scheme = GptqScheme(bits=4, group_size=128, sym=True, checkpoint_format="gptq")
    linears = _quantized_linears(tensors)
    assert len(linears) == 2 * (16 * 3 + 3 + 4)
    for name, linear in linears.items():
        check_linear(name, linear, scheme)
        check_zero_points(name, linear, scheme)
        assert torch.isfinite(linear.scales).all() and bool((linear.scales > 0).all())
    words = tensors["model.layers.1.mlp.experts.15.up_proj.qweight"]
    assert words.unique().numel() > words.numel() // 2  # random, not a constant pattern
    assert torch.isfinite(tensors["lm_head.weight"]).all()
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.num_experts == 16 and config.shared_expert_intermediate_size == 8 * config.moe_intermediate_size


def test_qwen3_30b_plan_has_its_shapes_and_loads_into_transformers_config() -> None:
    """``--scale qwen3-30b`` (the end-to-end benchmark's shapes): 128 experts of 768, 32 heads of 128 over H=2048
    with 4 KV heads, q/k norms, no shared expert, no attention bias; its config.json is a valid Qwen3-MoE config."""
    from transformers import Qwen3MoeConfig

    gen = _load_benchmark_generator()
    specs = {spec.name: spec for spec in gen.model_specs(gen.QWEN3_30B)}
    expected = {
        "model.layers.47.mlp.experts.127.gate_proj.qweight": ("int32", (256, 768)),
        "model.layers.0.mlp.experts.0.down_proj.qweight": ("int32", (96, 2048)),
        "model.layers.0.self_attn.q_proj.qweight": ("int32", (256, 4096)),
        "model.layers.0.self_attn.k_proj.qweight": ("int32", (256, 512)),
        "model.layers.0.self_attn.o_proj.qweight": ("int32", (512, 2048)),
        "model.layers.0.self_attn.q_norm.weight": ("float16", (128,)),
        "model.layers.0.mlp.gate.weight": ("float16", (128, 2048)),
    }
    assert {name: (specs[name].dtype, specs[name].shape) for name in expected} == expected
    assert not any("shared_expert" in name or name.endswith(".bias") for name in specs)
    assert sum(name.endswith(".qweight") for name in specs) == 48 * (128 * 3 + 4)
    config = gen.qwen3_30b_config(gen.QWEN3_30B)
    hf = Qwen3MoeConfig(**{k: v for k, v in config.items() if k != "quantization_config"})
    assert (hf.head_dim, hf.num_experts, hf.moe_intermediate_size, hf.num_experts_per_tok) == (128, 128, 768, 8)
