"""The whole sparse-MoE block of one decoder layer, computed as the source model does, on our kernels.

Why a module of its own: a serving stack (or the transformers drop-in) swaps the model's MoE block for
this one. It runs the router (``mlp.gate``), the routed experts through ``fused_moe`` and the shared
expert, which the converter stored as a stack of C always-selected chunks, through ``fused_moe`` too:
Qwen2-MoE scales it by ``sigmoid(shared_expert_gate(x))``, DeepSeek adds it as is, Qwen3-MoE and Mixtral
have none.

Shared modes. "joined": one fused_moe call over the routed stack extended by the shared chunks (experts E ..
E + C - 1 of a view the converter's file layout allows, runtime.weights.join_adjacent), each token taking its
top-k plus the C chunks; where no such view exists the block runs "separate": a routed call, then a shared call.
"auto" (the default) joins while a call has at most JOINED_MAX_TOKENS tokens and runs separate above: one launch
wins at decode and small batches, two launches win at prefill, where the joined call's tiles, tuned for the routed
experts' rows, fit chunks that every token takes poorly (measured: benchmarks/KERNEL_NOTES.md item 12).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from repack.formats.errors import RepackError
from repack.formats.stacks import ACTIVATION_DTYPES, StackInfo
from repack.runtime.routers import DEEPSEEK_V3, SOFTMAX_TOPK, RouterSpec, route_reference
from repack.runtime.weights import MoeWeights, join_adjacent

JOINED = "joined"  # one fused_moe call: routed experts and shared chunks as one stack (falls back to SEPARATE)
SEPARATE = "separate"  # a fused_moe call for the routed experts, another for the shared chunks
AUTO = "auto"  # JOINED for calls of at most JOINED_MAX_TOKENS tokens, SEPARATE above
SHARED_MODES = (AUTO, JOINED, SEPARATE)
DEFAULT_SHARED_MODE = AUTO  # what every entry point (load, load_hf_model, MoeBlock) takes when given none
JOINED_MAX_TOKENS = 32  # the smaller of the measured crossovers (KERNEL_NOTES.md item 12)


def resolve_shared_mode(mode: str | None) -> str:
    """``mode``, or DEFAULT_SHARED_MODE for None; anything else is a one-line error."""
    mode = DEFAULT_SHARED_MODE if mode is None else mode
    if mode not in SHARED_MODES:
        raise RepackError(f"shared_mode {mode!r} is not one of {', '.join(map(repr, SHARED_MODES))}")
    return mode


def block_prefix(routed_prefix: str) -> str:
    """``model.layers.3.mlp.experts`` -> ``model.layers.3.mlp`` (the source MoE block's module path)."""
    return routed_prefix.removesuffix(".experts")


class MoeBlock(nn.Module):
    """Router + routed experts + optional shared expert: ``[..., H] -> [..., H]`` in fp16 or bf16.

    ``router_weight`` None builds a block whose caller routes (vLLM computes the top-k and calls
    :meth:`apply_experts`, or hands logits to :meth:`route_logits`).
    """

    def __init__(
        self,
        routed: MoeWeights,
        router_weight: torch.Tensor | None,
        spec: RouterSpec,
        *,
        shared: MoeWeights | None = None,
        shared_gate_weight: torch.Tensor | None = None,
        correction_bias: torch.Tensor | None = None,
        name: str = "moe block",
        shared_mode: str | None = None,
    ) -> None:
        super().__init__()
        if router_weight is not None and router_weight.shape != (routed.num_experts, routed.hidden_size):
            raise RepackError(
                f"{name}.gate.weight: shape {list(router_weight.shape)} does not match the expert stack "
                f"[{routed.num_experts}, {routed.hidden_size}]; re-run `repack convert`"
            )
        self.routed = routed
        self.shared = shared
        self.spec = spec
        self.name = name
        self.router_weight = router_weight
        self.shared_gate_weight = shared_gate_weight
        # Or the gate as a function x -> [M, 1] logits, for a serving stack whose gate layer keeps its weight in a
        # layout of its own (vLLM's CPU linears repack theirs).
        self.shared_gate: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.correction_bias = correction_bias
        self.shared_mode = resolve_shared_mode(shared_mode)
        # Routed experts then shared chunks as one stack (views), when asked for and the storage allows it.
        joins = shared is not None and self.shared_mode != SEPARATE
        self.joined = join_adjacent(routed, shared) if joins else None
        self._cast_cache: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor],
        routed: StackInfo,
        shared: StackInfo | None,
        spec: RouterSpec,
        *,
        block: str = "",
        where: str = "",
        shared_mode: str | None = None,
    ) -> MoeBlock:
        """The block over its stored tensors, named as in the checkpoint (formats/SPEC.md section 2): the stacks'
        tensors and ``{block}.gate.weight`` (``{block}.`` left out when ``block`` is empty). Views, nothing copied;
        a missing tensor is a one-line error naming ``where``. The loader (a whole checkpoint) and the transformers
        integration (a block's buffers) both build their blocks here."""

        def tensor(leaf: str, required: bool) -> torch.Tensor | None:
            name = f"{block}.{leaf}" if block else leaf
            found = tensors.get(name)
            if found is None and required:
                raise RepackError(f"{where}: tensor {name} is missing; re-run `repack convert`")
            return found

        for info in (routed, shared):
            missing = [name for name in info.tensor_names() if name not in tensors] if info is not None else []
            if missing:
                raise RepackError(f"{where}: tensor {missing[0]} is missing from the shards; re-run `repack convert`")
        shared_weights = MoeWeights.from_tensors(shared, tensors) if shared is not None else None
        return cls(
            MoeWeights.from_tensors(routed, tensors),
            tensor("gate.weight", required=True),
            spec,
            shared=shared_weights,
            shared_gate_weight=tensor("shared_expert_gate.weight", required=False) if shared is not None else None,
            correction_bias=tensor("gate.e_score_correction_bias", required=spec.method == DEEPSEEK_V3),
            name=block or where,
            shared_mode=shared_mode,
        )

    def _as(self, key: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``tensor`` in ``dtype``, converted once per dtype (router weights are tiny; the stored one stays)."""
        if tensor.dtype == dtype:
            return tensor
        if (key, dtype) not in self._cast_cache:
            self._cast_cache[(key, dtype)] = tensor.to(dtype)
        return self._cast_cache[(key, dtype)]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights float32 [M, k], topk_ids int32 [M, k]) for tokens ``x`` [M, H]."""
        if self.router_weight is None:
            raise RepackError(f"{self.name}: built without a router weight; route outside and call apply_experts")
        if self.spec.method == SOFTMAX_TOPK:
            return self.route_logits(F.linear(x, self._as("gate", self.router_weight, x.dtype)))
        return self.route_logits(F.linear(x.float(), self._as("gate", self.router_weight, torch.float32)))

    def route_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The family's top-k from router logits [M, E] (a serving stack that computed the logits itself)."""
        if self.spec.method == SOFTMAX_TOPK:
            from repack.runtime.kernels.routing import route

            return route(logits, self.spec.top_k, self.spec.renormalize)
        weights, ids = route_reference(logits.float(), self.spec, self.correction_bias)
        return weights.contiguous(), ids.to(torch.int32).contiguous()

    def shared_weights(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [M, C]: every token's weight on each of the shared expert's C chunks."""
        chunks = self.shared.num_experts
        if self.shared_gate is not None:
            gate = self.shared_gate(x)
        elif self.shared_gate_weight is not None:
            gate = F.linear(x, self._as("shared_gate", self.shared_gate_weight, x.dtype))
        else:
            return torch.ones(x.shape[0], chunks, dtype=torch.float32, device=x.device)
        return torch.sigmoid(gate.float()).expand(-1, chunks).contiguous()

    def shared_ids(self, tokens: int, first: int, device: torch.device) -> torch.Tensor:
        """int32 [M, C]: the shared chunks' expert ids ``first .. first + C - 1`` for every token."""
        ids = torch.arange(first, first + self.shared.num_experts, dtype=torch.int32, device=device)
        return ids.expand(tokens, -1).contiguous()

    def with_shared_chunks(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids int32 [M, k + C], weights float32 [M, k + C]) for the joined stack: each token's top-k routed
        experts, then the C shared chunks (experts E .. E + C - 1) with their weights.

        A few small torch ops per call; a routing kernel that wrote these rows directly would save them."""
        ids = torch.cat([topk_ids, self.shared_ids(x.shape[0], self.routed.num_experts, x.device)], dim=1)
        return ids, torch.cat([topk_weights, self.shared_weights(x)], dim=1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype not in ACTIVATION_DTYPES:
            raise RepackError(
                f"{self.name}: input dtype {hidden_states.dtype} is not supported by the W4A16 kernel; "
                "cast the activations to torch.float16 or torch.bfloat16"
            )
        if hidden_states.shape[-1] != self.routed.hidden_size:
            raise RepackError(
                f"{self.name}: input hidden size {hidden_states.shape[-1]} != the checkpoint's "
                f"{self.routed.hidden_size}; pass [..., {self.routed.hidden_size}] activations"
            )
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).contiguous()
        if self._routes_in_kernel(x):
            return self._routed_in_kernel(x).reshape(shape)
        topk_weights, topk_ids = self.route(x)
        return self.apply_experts(x, topk_weights, topk_ids).reshape(shape)

    def _joins(self, tokens: int) -> bool:
        """Whether a call of ``tokens`` tokens runs the routed experts and the shared chunks as one stack."""
        return self.joined is not None and (self.shared_mode == JOINED or tokens <= JOINED_MAX_TOKENS)

    def _routes_in_kernel(self, x: torch.Tensor) -> bool:
        """Softmax top-k over the routed stack alone: the kernels route inside their first launch
        (fused_moe.routed_moe), one launch fewer than routing first. A joined call needs the shared chunks' ids
        beside the routed ones, and the other routers run in torch."""
        return self.spec.method == SOFTMAX_TOPK and self.router_weight is not None and not self._joins(x.shape[0])

    def _routed_in_kernel(self, x: torch.Tensor) -> torch.Tensor:
        from repack.runtime.fused_moe import fused_moe, routed_moe

        logits = F.linear(x, self._as("gate", self.router_weight, x.dtype))
        out = routed_moe(x, self.routed, logits, self.spec.top_k, self.spec.renormalize)
        if self.shared is None:
            return out
        shared_ids = self.shared_ids(x.shape[0], 0, x.device)
        return out + fused_moe(x, self.shared, shared_ids, self.shared_weights(x))

    def apply_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """[M, H]: the routed experts' weighted sum plus the shared expert for tokens ``x`` [M, H] routed to
        ``topk_ids``, in one fused_moe call (joined) or two (separate). What ``forward`` runs after the router;
        benchmarks/bench_moe.py times it from precomputed routing."""
        routed, shared = self.apply_parts(x, topk_weights, topk_ids)
        return routed if shared is None else routed + shared

    def apply_parts(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(experts [M, H], shared expert [M, H] or None): a joined call returns both in the first, a separate
        one the shared call's output apart (a serving stack that adds the shared expert itself takes it so)."""
        from repack.runtime.fused_moe import fused_moe

        if self._joins(x.shape[0]):
            return fused_moe(x, self.joined, *self.with_shared_chunks(x, topk_ids, topk_weights)), None
        out = fused_moe(x, self.routed, topk_ids, topk_weights)
        if self.shared is None:
            return out, None
        return out, fused_moe(x, self.shared, self.shared_ids(x.shape[0], 0, x.device), self.shared_weights(x))

    def extra_repr(self) -> str:
        shared = ""
        if self.shared is not None:
            shared = f", shared chunks={self.shared.num_experts} ({JOINED if self.joined is not None else SEPARATE})"
        return f"{self.name}: experts={self.routed.num_experts}, top_k={self.spec.top_k}, {self.spec.method}{shared}"
