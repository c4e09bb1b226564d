"""The whole sparse-MoE block of one decoder layer, computed as the source model does, on our kernels.

Why a module of its own: a serving stack (or the transformers drop-in) swaps the model's MoE block for
this one. It runs the router (``mlp.gate``), the routed experts through ``fused_moe`` and the shared
expert, which the converter stored as a stack of C always-selected chunks, through ``fused_moe`` too:
Qwen2-MoE scales it by ``sigmoid(shared_expert_gate(x))``, DeepSeek adds it as is, Qwen3-MoE and Mixtral
have none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from repack.errors import RepackError
from repack.formats.repack_v1 import ROUTED, SHARED
from repack.runtime.router_reference import DEEPSEEK_V3, SOFTMAX_TOPK, RouterSpec, route_reference, router_spec
from repack.runtime.weights import MoeWeights

if TYPE_CHECKING:
    from repack.runtime.loader import RepackCheckpoint

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)


def block_prefix(routed_prefix: str) -> str:
    """``model.layers.3.mlp.experts`` -> ``model.layers.3.mlp`` (the source MoE block's module path)."""
    return routed_prefix.removesuffix(".experts")


class MoeBlock(nn.Module):
    """Router + routed experts + optional shared expert: ``[..., H] -> [..., H]`` in fp16 or bf16."""

    def __init__(
        self,
        routed: MoeWeights,
        router_weight: torch.Tensor,
        spec: RouterSpec,
        *,
        shared: MoeWeights | None = None,
        shared_gate_weight: torch.Tensor | None = None,
        correction_bias: torch.Tensor | None = None,
        name: str = "moe block",
    ) -> None:
        super().__init__()
        if router_weight.shape != (routed.num_experts, routed.hidden_size):
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
        self.correction_bias = correction_bias
        self._cast_cache: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    @classmethod
    def from_checkpoint(cls, ckpt: RepackCheckpoint, layer: int) -> MoeBlock:
        """Gather a layer's stacks and router tensors from a loaded checkpoint (views, nothing copied)."""
        routed_info = ckpt.stack_info(layer, ROUTED)
        prefix = block_prefix(routed_info.prefix)

        def tensor(name: str, required: bool) -> torch.Tensor | None:
            found = ckpt.tensors.get(f"{prefix}.{name}")
            if found is None and required:
                raise RepackError(f"{ckpt.path}: tensor {prefix}.{name} is missing; re-run `repack convert`")
            return found

        spec = router_spec(ckpt.text_config)
        shared = ckpt.moe_weights(layer, SHARED)
        if shared is None:
            float_shared = [
                n for n in ckpt.tensors if n.startswith((f"{prefix}.shared_expert.", f"{prefix}.shared_experts."))
            ]
            if float_shared:  # SPEC section 2: a float shared expert is copied through and gets no stack
                raise RepackError(
                    f"{ckpt.path}: layer {layer}'s shared expert is stored in float ({float_shared[0]}), which "
                    "moe_block does not run; use repack.runtime.load_hf_model, which runs it"
                )
        return cls(
            ckpt.moe_weights(layer, ROUTED),
            tensor("gate.weight", required=True),
            spec,
            shared=shared,
            shared_gate_weight=tensor("shared_expert_gate.weight", required=False) if shared is not None else None,
            correction_bias=tensor("gate.e_score_correction_bias", required=spec.method == DEEPSEEK_V3),
            name=prefix,
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
        if self.spec.method == SOFTMAX_TOPK:
            from repack.runtime.routing import route

            logits = F.linear(x, self._as("gate", self.router_weight, x.dtype))
            return route(logits, self.spec.top_k, self.spec.renormalize)
        logits = F.linear(x.float(), self._as("gate", self.router_weight, torch.float32))
        weights, ids = route_reference(logits, self.spec, self.correction_bias)
        return weights.contiguous(), ids.to(torch.int32).contiguous()

    def shared_weights(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [M, C]: every token's weight on each of the shared expert's C chunks."""
        chunks = self.shared.num_experts
        if self.shared_gate_weight is None:
            return torch.ones(x.shape[0], chunks, dtype=torch.float32, device=x.device)
        gate = F.linear(x, self._as("shared_gate", self.shared_gate_weight, x.dtype))
        return torch.sigmoid(gate.float()).expand(-1, chunks).contiguous()

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
        from repack.runtime.fused_moe import fused_moe

        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).contiguous()
        topk_weights, topk_ids = self.route(x)
        out = fused_moe(x, self.routed, topk_ids, topk_weights)
        if self.shared is not None:
            chunks = self.shared.num_experts
            ids = torch.arange(chunks, dtype=torch.int32, device=x.device).expand(x.shape[0], -1).contiguous()
            out = out + fused_moe(x, self.shared, ids, self.shared_weights(x))
        return out.reshape(shape)

    def extra_repr(self) -> str:
        shared = f", shared chunks={self.shared.num_experts}" if self.shared is not None else ""
        return f"{self.name}: experts={self.routed.num_experts}, top_k={self.spec.top_k}, {self.spec.method}{shared}"
