"""Write complete synthetic GPTQ MoE checkpoints: the shapes and names of real ones, random weights.

Tests, the demo and benchmarks need GPTQ MoE checkpoints of every supported family without network
access or a quantizer. A folder written here looks like what GPTQModel saves: ``config.json`` with the
family's real keys and GPTQModel's ``quantization_config``, ``quantize_config.json``, a generation config,
a tiny tokenizer and safetensors (one file, or shards with an index) holding every tensor the real model
has, under the real names. Quantized linears come from :func:`repack.synthetic_linear.quantize_linear`
(round-to-nearest of a normal weight, std 0.02), so they follow GPTQ's conventions exactly; norms are 1 so
that a forward pass stays well-behaved. Everything is a function of ``seed``.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from repack.formats.errors import RepackError
from repack.formats.families import GATE_UP_DOWN, family_for
from repack.formats.gptq import GptqLinear, GptqScheme, dtype_name
from repack.synthetic_linear import quantize_linear

ARCHITECTURES = {
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
MIXTRAL_NAMINGS = ("v4", "v5")
WEIGHT_STD = 0.02
ROUTER_STD = 0.1  # wider than the rest so that top-k choices are well separated
EOS_TOKEN = "<|endoftext|>"
GPTQMODEL_VERSION = "gptqmodel:7.7.0"

# Multi-head latent attention sizes (DeepSeek) for the synthetic models: small, multiples of 8 and 32.
MLA_Q_LORA_RANK = 128
MLA_KV_LORA_RANK = 64
MLA_QK_NOPE_HEAD_DIM = 32
MLA_QK_ROPE_HEAD_DIM = 16
MLA_V_HEAD_DIM = 32


@dataclass(frozen=True)
class SyntheticModel:
    """The sizes and naming of one synthetic checkpoint, and where each module lives in it."""

    family: str
    num_layers: int
    hidden_size: int
    intermediate_size: int  # one routed expert
    num_experts: int
    top_k: int
    shared_intermediate_size: int | None
    vocab_size: int
    dense_first_layers: int
    mixtral_naming: str
    kv_lora_rank: int = MLA_KV_LORA_RANK  # DeepSeek's MLA latent; attention backends accept only some
    qk_rope_head_dim: int = MLA_QK_ROPE_HEAD_DIM  # kv_lora_rank + qk_rope_head_dim (vLLM's MLA: 320, 512, 576)
    qk_nope_head_dim: int = MLA_QK_NOPE_HEAD_DIM  # with rope and v: the head dims vLLM's MLA prefill must take
    v_head_dim: int = MLA_V_HEAD_DIM
    num_heads: int = 4

    @property
    def num_kv_heads(self) -> int:
        """DeepSeek's MLA has one latent for all heads (config says kv heads = heads); others use GQA 2:1."""
        return self.num_heads if self.family.startswith("deepseek") else self.num_heads // 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def dense_intermediate_size(self) -> int:
        """Size of the plain MLP of dense layers (``mlp_only_layers`` / ``first_k_dense_replace``)."""
        return 2 * self.intermediate_size

    @property
    def _v4_names(self) -> bool:
        """Mixtral's older checkpoint naming: the family table's first block and projection spellings."""
        return self.family == "mixtral" and self.mixtral_naming == "v4"

    @property
    def expert_names(self) -> tuple[str, str, str]:
        """Module names of (gate, up, down) inside one routed expert."""
        return family_for(self.family).projection_sets[0] if self._v4_names else GATE_UP_DOWN

    def moe_block(self, layer: int) -> str:
        """Module path of a layer's sparse-MoE block (or dense MLP)."""
        family = family_for(self.family)
        return f"model.layers.{layer}.{family.block_modules[0] if self._v4_names else family.model_block}"

    def is_sparse(self, layer: int) -> bool:
        return layer >= self.dense_first_layers

    @property
    def shared_block_name(self) -> str | None:
        """Module name of the shared expert inside the MoE block; ``None`` for families without one."""
        return family_for(self.family).shared_expert


def write_synthetic_checkpoint(
    path: Path,
    *,
    family: str,
    scheme: GptqScheme,
    act_order: bool = False,
    num_layers: int = 2,
    hidden_size: int = 128,
    intermediate_size: int = 64,
    num_experts: int = 4,
    top_k: int = 2,
    shared_intermediate_size: int | None = None,
    vocab_size: int = 256,
    seed: int = 0,
    dtype: torch.dtype = torch.float16,
    shard_size: int | None = None,
    mixtral_naming: str = "v4",
    dense_first_layers: int = 0,
    kv_lora_rank: int = MLA_KV_LORA_RANK,
    qk_rope_head_dim: int = MLA_QK_ROPE_HEAD_DIM,
    qk_nope_head_dim: int = MLA_QK_NOPE_HEAD_DIM,
    v_head_dim: int = MLA_V_HEAD_DIM,
) -> Path:
    """Write a GPTQ MoE checkpoint folder of ``family`` to ``path`` and return ``path``.

    ``shared_intermediate_size`` defaults to ``2 * intermediate_size`` for families with a shared expert
    (Qwen2-MoE, DeepSeek); DeepSeek needs a whole multiple of ``intermediate_size`` (``n_shared_experts``).
    ``shard_size`` (bytes) splits the weights into ``model-0000k-of-0000N.safetensors`` plus an index.
    ``mixtral_naming`` picks the expert names of Mixtral checkpoints: "v4" (``block_sparse_moe`` with
    ``w1/w3/w2``, as older GPTQ repos) or "v5" (``mlp.experts.{j}.gate_proj/...``, GPTQModel under
    transformers 5). ``dense_first_layers`` makes the first layers plain MLPs (DeepSeek's
    ``first_k_dense_replace``, Qwen's ``mlp_only_layers``). ``kv_lora_rank`` and ``qk_rope_head_dim`` size
    DeepSeek's MLA latent (vLLM's MLA attention takes only latents of 320, 512 or 576 = their sum);
    ``qk_nope_head_dim``, ``qk_rope_head_dim`` and ``v_head_dim`` its heads (vLLM 0.26's MLA prefill on an H200,
    FlashAttention, takes only a few triples, DeepSeek's 128/64/128 among them).
    """
    model = _checked_model(
        family=family,
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_experts=num_experts,
        top_k=top_k,
        shared_intermediate_size=shared_intermediate_size,
        vocab_size=vocab_size,
        dense_first_layers=dense_first_layers,
        mixtral_naming=mixtral_naming,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        qk_nope_head_dim=qk_nope_head_dim,
        v_head_dim=v_head_dim,
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    quantization_config = gptqmodel_quantization_config(scheme, act_order=act_order)
    config = model_config(model, dtype) | {"quantization_config": quantization_config}
    _write_json(path / "config.json", config)
    _write_json(path / "quantize_config.json", quantization_config)
    _write_json(path / "generation_config.json", generation_config())
    write_tokenizer(path, vocab_size)
    maker = _TensorMaker(scheme=scheme, act_order=act_order, dtype=dtype, seed=seed)
    _write_weights(path, dict(_model_tensors(model, maker)), shard_size)
    return path


def write_demo_checkpoint(path: Path) -> Path:
    """The built-in example of ``make demo``: a 2-layer Qwen2-MoE, 4-bit act-order group 32, symmetric.

    Its shared expert (256) is twice the routed size (128), so the converter stores it as two extra
    routed-size experts, like Qwen2-57B's 20480 = 8 x 2560.
    """
    return write_synthetic_checkpoint(
        path,
        family="qwen2_moe",
        scheme=GptqScheme(bits=4, group_size=32, sym=True, checkpoint_format="gptq"),
        act_order=True,
        num_layers=2,
        hidden_size=256,
        intermediate_size=128,
        num_experts=8,
        top_k=2,
        shared_intermediate_size=256,
        vocab_size=512,
        seed=0,
    )


def _checked_model(*, family: str, shared_intermediate_size: int | None, **sizes) -> SyntheticModel:
    """Validate the arguments (one-line RepackError each) and fill in family defaults."""
    if family not in ARCHITECTURES:
        raise RepackError(f"synthetic checkpoint: unknown family '{family}'; use one of {', '.join(ARCHITECTURES)}")
    if sizes["mixtral_naming"] not in MIXTRAL_NAMINGS:
        raise RepackError(f"synthetic checkpoint: unknown mixtral_naming '{sizes['mixtral_naming']}'; use 'v4' or 'v5'")
    has_shared = family in ("qwen2_moe", "deepseek_v2", "deepseek_v3")
    if shared_intermediate_size is not None and not has_shared:
        raise RepackError(f"synthetic checkpoint: {family} has no shared expert; leave shared_intermediate_size unset")
    if has_shared and shared_intermediate_size is None:
        shared_intermediate_size = 2 * sizes["intermediate_size"]
    if family.startswith("deepseek") and shared_intermediate_size % sizes["intermediate_size"]:
        raise RepackError(
            f"synthetic checkpoint: {family} shared_intermediate_size {shared_intermediate_size} must be a "
            f"multiple of intermediate_size {sizes['intermediate_size']} (n_shared_experts); pick another size"
        )
    if family == "mixtral" and sizes["dense_first_layers"]:
        raise RepackError("synthetic checkpoint: mixtral has no dense layers; set dense_first_layers=0")
    if not 0 <= sizes["dense_first_layers"] < sizes["num_layers"]:
        raise RepackError(
            f"synthetic checkpoint: dense_first_layers={sizes['dense_first_layers']} leaves no MoE layer among "
            f"{sizes['num_layers']}; use fewer dense layers"
        )
    if not 0 < sizes["top_k"] <= sizes["num_experts"]:
        raise RepackError(
            f"synthetic checkpoint: top_k={sizes['top_k']} must lie in [1, num_experts={sizes['num_experts']}]"
        )
    return SyntheticModel(family=family, shared_intermediate_size=shared_intermediate_size, **sizes)


def gptqmodel_quantization_config(scheme: GptqScheme, *, act_order: bool) -> dict:
    """``quantization_config`` as GPTQModel 7.7 saves it (``format`` and ``checkpoint_format`` agree)."""
    return {
        "bits": scheme.bits,
        "checkpoint_format": scheme.checkpoint_format,
        "desc_act": act_order,
        "format": scheme.checkpoint_format,
        "group_size": scheme.group_size,
        "lm_head": False,
        "meta": {
            "act_group_aware": False,
            "damp_auto_increment": 0.01,
            "damp_percent": 0.05,
            "mse": 0.0,
            "quantizer": [GPTQMODEL_VERSION],
            "static_groups": False,
            "true_sequential": True,
            "uri": "https://github.com/modelcloud/gptqmodel",
        },
        "method": "gptq",
        "pack_dtype": "int32",
        "quant_method": "gptq",
        "sym": scheme.sym,
    }


def model_config(model: SyntheticModel, dtype: torch.dtype) -> dict:
    """config.json without quantization: the keys transformers 5 config classes define for the family."""
    common = {
        "architectures": [ARCHITECTURES[model.family]],
        "model_type": model.family,
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "initializer_range": WEIGHT_STD,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "num_experts_per_tok": model.top_k,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "bos_token_id": None,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "dtype": dtype_name(dtype),
        "transformers_version": "5.24.0",
    }
    return common | _family_config(model)


def _family_config(model: SyntheticModel) -> dict:
    dense_layers = list(range(model.dense_first_layers))
    if model.family in ("qwen2_moe", "qwen3_moe"):
        qwen = {
            "intermediate_size": model.dense_intermediate_size,
            "moe_intermediate_size": model.intermediate_size,
            "num_experts": model.num_experts,
            "decoder_sparse_step": 1,
            "mlp_only_layers": dense_layers,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": model.num_layers,
        }
        if model.family == "qwen3_moe":
            return qwen | {"head_dim": model.head_dim, "attention_bias": False, "norm_topk_prob": True}
        return qwen | {
            "shared_expert_intermediate_size": model.shared_intermediate_size,
            "norm_topk_prob": False,
            "qkv_bias": True,
            "layer_types": ["full_attention"] * model.num_layers,
        }
    if model.family == "mixtral":
        return {
            "intermediate_size": model.intermediate_size,
            "num_local_experts": model.num_experts,
            "rms_norm_eps": 1e-5,
            "sliding_window": None,
            "router_jitter_noise": 0.0,
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        }
    deepseek = {
        "intermediate_size": model.dense_intermediate_size,
        "moe_intermediate_size": model.intermediate_size,
        "n_routed_experts": model.num_experts,
        "n_shared_experts": model.shared_intermediate_size // model.intermediate_size,
        "first_k_dense_replace": model.dense_first_layers,
        "moe_layer_freq": 1,
        "kv_lora_rank": model.kv_lora_rank,
        "qk_nope_head_dim": model.qk_nope_head_dim,
        "qk_rope_head_dim": model.qk_rope_head_dim,
        "v_head_dim": model.v_head_dim,
        "attention_bias": False,
    }
    if model.family == "deepseek_v2":
        return deepseek | {
            "q_lora_rank": None,
            "topk_method": "greedy",
            "n_group": 1,  # as DeepSeek-V2-Lite's config; vLLM needs both (its DeepSeek MoE always groups)
            "topk_group": 1,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
            "mlp_bias": False,
        }
    return deepseek | {
        "q_lora_rank": MLA_Q_LORA_RANK,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 0,
        "rope_interleave": True,
    }


def synthetic_linear_weight(seed: int, name: str, in_features: int, out_features: int) -> torch.Tensor:
    """The float32 weight ``[out, in]`` that linear ``name`` of a checkpoint written with ``seed`` was
    quantized from. Drawn from its own generator (seed and name), so tests can rebuild it and measure
    the quantization error of any one linear without replaying the whole checkpoint.
    """
    generator = torch.Generator().manual_seed(seed * 0x1_0000_0000 + zlib.crc32(name.encode()))
    return torch.randn(out_features, in_features, generator=generator) * WEIGHT_STD


class _TensorMaker:
    """Draws the checkpoint's tensors: float ones and act-order input orders from one seeded generator in
    the order the model lists them, linear weights from :func:`synthetic_linear_weight`."""

    def __init__(self, *, scheme: GptqScheme, act_order: bool, dtype: torch.dtype, seed: int) -> None:
        self.scheme = scheme
        self.act_order = act_order
        self.dtype = dtype
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def normal(self, *shape: int, std: float = WEIGHT_STD, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.generator) * std).to(dtype or self.dtype)

    def ones(self, size: int) -> torch.Tensor:
        return torch.ones(size, dtype=self.dtype)

    def input_order(self, in_features: int) -> torch.Tensor | None:
        """A random stand-in for the Hessian order of one input (shared by linears that read it)."""
        return torch.randperm(in_features, generator=self.generator) if self.act_order else None

    def linear(
        self, name: str, in_features: int, out_features: int, *, bias: bool = False, order: torch.Tensor | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The stored tensors of one GPTQ linear ``name`` (qweight, qzeros, scales, g_idx, maybe bias)."""
        weight = synthetic_linear_weight(self.seed, name, in_features, out_features)
        if order is None:
            order = self.input_order(in_features)
        quantized: GptqLinear = quantize_linear(weight, self.scheme, act_order=self.act_order, order=order)
        yield f"{name}.qweight", quantized.qweight
        yield f"{name}.qzeros", quantized.qzeros
        yield f"{name}.scales", quantized.scales
        yield f"{name}.g_idx", quantized.g_idx
        if bias:
            yield f"{name}.bias", self.normal(out_features)

    def mlp(
        self, prefix: str, names: tuple[str, str, str], hidden: int, intermediate: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """gate, up (sharing one act-order g_idx, as they share their input) and down of one MLP."""
        gate, up, down = names
        order = self.input_order(hidden)
        yield from self.linear(f"{prefix}.{gate}", hidden, intermediate, order=order)
        yield from self.linear(f"{prefix}.{up}", hidden, intermediate, order=order)
        yield from self.linear(f"{prefix}.{down}", intermediate, hidden)


def _model_tensors(model: SyntheticModel, maker: _TensorMaker) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, named as the family's real checkpoints name them, layer by layer."""
    hidden = model.hidden_size
    yield "model.embed_tokens.weight", maker.normal(model.vocab_size, hidden)
    for layer in range(model.num_layers):
        prefix = f"model.layers.{layer}"
        yield f"{prefix}.input_layernorm.weight", maker.ones(hidden)
        yield from _attention_tensors(model, maker, f"{prefix}.self_attn")
        yield f"{prefix}.post_attention_layernorm.weight", maker.ones(hidden)
        if model.is_sparse(layer):
            yield from _moe_tensors(model, maker, model.moe_block(layer))
        else:
            yield from maker.mlp(
                model.moe_block(layer), ("gate_proj", "up_proj", "down_proj"), hidden, model.dense_intermediate_size
            )
    yield "model.norm.weight", maker.ones(hidden)
    yield "lm_head.weight", maker.normal(model.vocab_size, hidden)


def _attention_tensors(model: SyntheticModel, maker: _TensorMaker, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    hidden, heads = model.hidden_size, model.num_heads
    if model.family.startswith("deepseek"):
        yield from _mla_tensors(model, maker, prefix)
        return
    q_out, kv_out = heads * model.head_dim, model.num_kv_heads * model.head_dim
    bias = model.family == "qwen2_moe"
    order = maker.input_order(hidden)  # q, k and v read the same input
    yield from maker.linear(f"{prefix}.q_proj", hidden, q_out, bias=bias, order=order)
    yield from maker.linear(f"{prefix}.k_proj", hidden, kv_out, bias=bias, order=order)
    yield from maker.linear(f"{prefix}.v_proj", hidden, kv_out, bias=bias, order=order)
    yield from maker.linear(f"{prefix}.o_proj", q_out, hidden)
    if model.family == "qwen3_moe":
        yield f"{prefix}.q_norm.weight", maker.ones(model.head_dim)
        yield f"{prefix}.k_norm.weight", maker.ones(model.head_dim)


def _mla_tensors(model: SyntheticModel, maker: _TensorMaker, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """DeepSeek multi-head latent attention: V2 (Lite) projects q directly, V3 through a q LoRA."""
    hidden, heads = model.hidden_size, model.num_heads
    qk_head_dim = model.qk_nope_head_dim + model.qk_rope_head_dim
    order = maker.input_order(hidden)
    if model.family == "deepseek_v2":
        yield from maker.linear(f"{prefix}.q_proj", hidden, heads * qk_head_dim, order=order)
    else:
        yield from maker.linear(f"{prefix}.q_a_proj", hidden, MLA_Q_LORA_RANK, order=order)
        yield f"{prefix}.q_a_layernorm.weight", maker.ones(MLA_Q_LORA_RANK)
        yield from maker.linear(f"{prefix}.q_b_proj", MLA_Q_LORA_RANK, heads * qk_head_dim)
    kv_a_out = model.kv_lora_rank + model.qk_rope_head_dim
    yield from maker.linear(f"{prefix}.kv_a_proj_with_mqa", hidden, kv_a_out, order=order)
    yield f"{prefix}.kv_a_layernorm.weight", maker.ones(model.kv_lora_rank)
    kv_b_out = heads * (model.qk_nope_head_dim + model.v_head_dim)
    yield from maker.linear(f"{prefix}.kv_b_proj", model.kv_lora_rank, kv_b_out)
    yield from maker.linear(f"{prefix}.o_proj", heads * model.v_head_dim, hidden)


def _moe_tensors(model: SyntheticModel, maker: _TensorMaker, block: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Router (float), routed experts and shared expert (GPTQ) of one sparse-MoE block."""
    hidden = model.hidden_size
    yield f"{block}.gate.weight", maker.normal(model.num_experts, hidden, std=ROUTER_STD)
    if model.family == "deepseek_v3":
        yield f"{block}.gate.e_score_correction_bias", maker.normal(model.num_experts, dtype=torch.float32)
    for expert in range(model.num_experts):
        yield from maker.mlp(f"{block}.experts.{expert}", model.expert_names, hidden, model.intermediate_size)
    if model.shared_block_name is not None:
        shared = f"{block}.{model.shared_block_name}"
        yield from maker.mlp(shared, GATE_UP_DOWN, hidden, model.shared_intermediate_size)
    shared_gate = family_for(model.family).shared_expert_gate
    if shared_gate is not None:
        yield f"{block}.{shared_gate}.weight", maker.normal(1, hidden)


def _write_weights(path: Path, tensors: dict[str, torch.Tensor], shard_size: int | None) -> None:
    """One ``model.safetensors``, or shards filled in order up to ``shard_size`` bytes plus an index."""
    metadata = {"format": "pt"}
    if shard_size is None:
        save_file(tensors, str(path / "model.safetensors"), metadata=metadata)
        return
    shards = _split_in_order(tensors, shard_size)
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / filename), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, filename))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(path / "model.safetensors.index.json", index)


def _split_in_order(tensors: dict[str, torch.Tensor], shard_size: int) -> list[dict[str, torch.Tensor]]:
    """Greedy split keeping tensor order; a tensor larger than ``shard_size`` gets a shard of its own."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and used + size > shard_size:
            shards.append({})
            used = 0
        shards[-1][name] = tensor
        used += size
    return shards


def generation_config() -> dict:
    return {
        "_from_model_config": True,
        "bos_token_id": None,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "transformers_version": "5.24.0",
        "use_cache": True,
    }


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over ``<|endoftext|>, t1 .. t{V-1}``: every id lies inside the embedding."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {EOS_TOKEN: 0} | {f"t{i}": i for i in range(1, vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([EOS_TOKEN])
    tokenizer.save(str(path / "tokenizer.json"))
    _write_json(
        path / "tokenizer_config.json",
        {
            "backend": "tokenizers",
            "eos_token": EOS_TOKEN,
            "model_max_length": 4096,
            "pad_token": EOS_TOKEN,
            "tokenizer_class": "TokenizersBackendFast",
            "unk_token": EOS_TOKEN,
        },
    )


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
