"""Each supported family's router decision (which experts, with what weight), in plain torch float32.

Why it exists: the Triton ``route`` kernel covers the softmax families (Qwen2-MoE, Qwen3-MoE, Mixtral);
DeepSeek's routers (group-limited top-k, sigmoid scores with a correction bias, a scaling factor) are rare
enough to run in torch. The same functions are the float32 reference that the kernel is tested against.
The semantics follow the source models (transformers' modeling code, DeepSeek's own for V2's
``norm_topk_prob``); :func:`router_spec` reads them from ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from repack.formats.errors import RepackError

SOFTMAX_TOPK = "softmax_topk"  # Qwen2-MoE, Qwen3-MoE, Mixtral
DEEPSEEK_V2 = "deepseek_v2"  # softmax, greedy or group_limited_greedy top-k, scaling factor
DEEPSEEK_V3 = "deepseek_v3"  # sigmoid + correction bias for selection, group-limited top-k (noaux_tc)


@dataclass(frozen=True)
class RouterSpec:
    """What a family's router does, as read from the model config."""

    method: str  # SOFTMAX_TOPK, DEEPSEEK_V2 or DEEPSEEK_V3
    top_k: int
    renormalize: bool
    scaling_factor: float = 1.0
    topk_method: str = "greedy"  # DeepSeek-V2: "greedy" or "group_limited_greedy"
    n_group: int = 1
    topk_group: int = 1
    fp32_logits: bool = False  # DeepSeek computes the router linear in float32


def router_spec(config: dict) -> RouterSpec:
    """The router of a (text) model config; an unsupported ``model_type``, a missing key or a value of the wrong
    type is a one-line RepackError."""
    if not isinstance(config, dict):
        raise RepackError(f"config.json: the text config is {type(config).__name__}, not an object; fix config.json")
    try:
        return _router_spec(config)
    except KeyError as error:
        raise RepackError(
            f"config.json: {error.args[0]!r} is missing; the MoE router needs it (fix config.json)"
        ) from None
    except (TypeError, ValueError) as error:
        cause = " ".join(str(error).split())
        raise RepackError(f"config.json: a router setting has the wrong type ({cause}); fix config.json") from None


def _router_spec(config: dict) -> RouterSpec:
    model_type = config.get("model_type")
    top_k = int(config["num_experts_per_tok"])
    if model_type in ("qwen2_moe", "qwen3_moe"):
        return RouterSpec(SOFTMAX_TOPK, top_k, bool(config.get("norm_topk_prob", False)))
    if model_type == "mixtral":
        return RouterSpec(SOFTMAX_TOPK, top_k, True)
    if model_type == "deepseek_v2":
        topk_method = config.get("topk_method") or "greedy"
        if topk_method not in ("greedy", "group_limited_greedy"):
            raise RepackError(
                f"config.json: DeepSeek-V2 topk_method {topk_method!r} is not supported; "
                "supported: greedy, group_limited_greedy"
            )
        return RouterSpec(
            DEEPSEEK_V2,
            top_k,
            bool(config.get("norm_topk_prob", False)),
            scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            topk_method=topk_method,
            n_group=int(config.get("n_group") or 1),
            topk_group=int(config.get("topk_group") or 1),
            fp32_logits=True,
        )
    if model_type == "deepseek_v3":
        return RouterSpec(
            DEEPSEEK_V3,
            top_k,
            bool(config.get("norm_topk_prob", True)),
            # A key the config leaves out takes transformers' DeepseekV3Config default.
            scaling_factor=float(config.get("routed_scaling_factor", 2.5)),
            topk_method="noaux_tc",
            n_group=int(config.get("n_group", 8) or 1),
            topk_group=int(config.get("topk_group", 4) or 1),
            fp32_logits=True,
        )
    raise RepackError(
        f"config.json: model_type {model_type!r} has no MoE router in this runtime; "
        "supported: qwen2_moe, qwen3_moe, mixtral, deepseek_v2, deepseek_v3"
    )


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in float32, top-k, optional renormalisation (Qwen2/Qwen3-MoE, Mixtral)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """bool [M, E]: True for the experts of each token's ``topk_group`` best groups."""
    n_group = group_scores.shape[-1]
    chosen = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    return mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts)


def deepseek_v2_topk(logits: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2: softmax scores, greedy or group-limited top-k, then renormalise or scale.

    Like DeepSeek's own code: with ``norm_topk_prob`` (and top_k > 1) the weights are renormalised,
    otherwise multiplied by ``routed_scaling_factor`` (released V2 configs set norm_topk_prob false).
    """
    scores = torch.softmax(logits.float(), dim=-1)
    num_experts = scores.shape[-1]
    if spec.topk_method == "group_limited_greedy":
        group_scores = scores.view(-1, spec.n_group, num_experts // spec.n_group).amax(dim=-1)
        scores = scores.masked_fill(~_group_mask(group_scores, spec.topk_group, num_experts), 0.0)
    weights, ids = torch.topk(scores, spec.top_k, dim=-1)
    if spec.renormalize and spec.top_k > 1:
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20), ids
    return weights * spec.scaling_factor, ids


def deepseek_v3_topk(
    logits: torch.Tensor, spec: RouterSpec, correction_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 (noaux_tc): sigmoid scores; selection on scores + bias within the best groups (a group
    scores the sum of its two best experts); weights are the unbiased scores, renormalised per
    ``norm_topk_prob``, times ``routed_scaling_factor``."""
    scores = torch.sigmoid(logits.float())
    num_experts = scores.shape[-1]
    choice = scores + correction_bias.float()
    group_scores = choice.view(-1, spec.n_group, num_experts // spec.n_group).topk(2, dim=-1).values.sum(dim=-1)
    choice = choice.masked_fill(~_group_mask(group_scores, spec.topk_group, num_experts), float("-inf"))
    ids = torch.topk(choice, spec.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.scaling_factor, ids


def route_reference(
    logits: torch.Tensor, spec: RouterSpec, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [M, k], topk_ids int64 [M, k]) of any supported family, in torch."""
    if spec.method == SOFTMAX_TOPK:
        return softmax_topk(logits, spec.top_k, spec.renormalize)
    if spec.method == DEEPSEEK_V2:
        return deepseek_v2_topk(logits, spec)
    if correction_bias is None:
        correction_bias = torch.zeros(logits.shape[-1], device=logits.device)
    return deepseek_v3_topk(logits, spec, correction_bias)
