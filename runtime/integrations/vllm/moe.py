"""The sparse-MoE experts under vLLM: parameters that are the stored stacks, run by ``repack.runtime.fused_moe``.

Loading. vLLM's MoE loaders go expert by expert: a checkpoint tensor named ``<block>.experts.{j}.<proj>.<x>``
reaches ``param.weight_loader`` of the experts layer's parameter ``<w13|w2>_<x>`` with expert id j. Our stacks
hold every expert in one tensor, so :func:`stack_weight_mapper` (the config's checkpoint mapper) renames each
stored stack tensor as if it were "expert 0" of its projection; every family's ``load_weights`` (the generic
one and DeepSeek's own) then hands the whole ``[E, ...]`` tensor, untouched, to :meth:`RepackMoEMethod.load_stack`,
which copies it into the parameter of the same shape: one copy per tensor, no reshuffle, no per-expert split.

Running. vLLM routes (its own top-k, the "topk already computed" form :meth:`RepackMoEMethod.apply`) and the
method runs the runtime's :class:`~repack.runtime.moe_block.MoeBlock` on those ids: the routed experts, and a
shared expert the converter stacked, in one launch where ``MoeBlock`` joins them (routed and shared parameters
are views of one buffer per tensor, as the converter lays the files out) or two. The "router logits in" form
(:meth:`RepackMoEMethod.apply_monolithic`, used when ``REPACK_VLLM_ROUTING=repack``) routes with the runtime's
own router instead. A stacked shared expert is computed here, so vLLM's shared-expert module (which has no
weights: the converter replaced its linears by the stack) is handed to us rather than run by vLLM's runner.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEConfig, FusedMoEMethodBase
from vllm.model_executor.models.utils import WeightsMapper

from repack.formats.errors import RepackError
from repack.formats.stacks import StackInfo, joinable
from repack.runtime.integrations.vllm.internals import hand_shared_output, shared_expert_module, vllm_attribute
from repack.runtime.moe_block import SEPARATE, MoeBlock
from repack.runtime.routers import RouterSpec
from repack.runtime.weights import TENSOR_FIELDS, MoeWeights

ROUTING_ENV = "REPACK_VLLM_ROUTING"  # "vllm" (default): vLLM's top-k; "repack": the runtime's router on the logits
PROJECTION = {"w13": "gate_proj", "w2": "down_proj"}  # the per-expert checkpoint name each stack tensor poses as
SHARED_TAG = "shared_"


def param_name(kind: str, shared: bool) -> str:
    """The experts layer's parameter for stack tensor ``kind`` (``w13_qweight``): that name, or ``w13_shared_qweight``
    for the shared stack."""
    stem, rest = kind.split("_", 1)
    return f"{stem}_{SHARED_TAG if shared else ''}{rest}"


def stack_weight_mapper() -> WeightsMapper:
    """Checkpoint names of the stacks -> names every family's MoE loader sends to our parameters whole.

    ``<block>.experts.w13_qweight`` -> ``<block>.experts.0.gate_proj.qweight`` (-> parameter ``w13_qweight``),
    ``<block>.shared_experts.w2_scales`` -> ``<block>.experts.0.down_proj.shared_scales`` (-> ``w2_shared_scales``).
    ``w2_perm`` only serves ``repack verify``'s inverse and is not loaded.
    """
    import regex as re  # vLLM's WeightsMapper takes patterns of the ``regex`` package

    table: dict = {re.compile(r"\.(shared_)?experts\.w2_perm$"): None}
    for stem, projection in PROJECTION.items():
        table[re.compile(rf"\.experts\.{stem}_(\w+)$")] = rf".experts.0.{projection}.\1"
        table[re.compile(rf"\.shared_experts\.{stem}_(\w+)$")] = rf".experts.0.{projection}.{SHARED_TAG}\1"
    return WeightsMapper(orig_to_new_regex=table)


class RepackMoEMethod(FusedMoEMethodBase):
    """One MoE block's experts: routed stack (and stacked shared expert) as stored, run by fused_moe."""

    def __init__(self, moe: FusedMoEConfig, routed: StackInfo, shared: StackInfo | None, spec: RouterSpec) -> None:
        super().__init__(moe)
        self.routed_info = routed
        self.shared_info = shared
        self.spec = spec
        self.block: MoeBlock | None = None
        routing = os.environ.get(ROUTING_ENV, "vllm")
        if routing not in ("vllm", "repack"):
            raise RepackError(f"{ROUTING_ENV}={routing!r} is not a routing; use 'vllm' or 'repack'")
        self.own_routing = routing == "repack"
        if self.own_routing and shared is not None:
            raise RepackError(
                f"{routed.prefix}: {ROUTING_ENV}=repack runs blocks without a stacked shared expert only (vLLM's "
                "logits-in call does not hand over the shared expert); unset it"
            )

    # ------------------------------------------------------------------------------------------- weights

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        """One parameter per stored stack tensor, of its stored dtype and shape (shared ones tagged ``shared_``).

        A joinable shared stack (formats.stacks.joinable) gets views of one ``[E + C, ...]`` buffer per tensor,
        routed rows first, like the converter's files, so ``MoeBlock`` can run both in one launch.
        """
        info = self.routed_info
        expected = (info.num_experts, info.hidden_size, info.intermediate_size)
        if (num_experts, hidden_size, intermediate_size_per_partition) != expected:
            raise RepackError(
                f"{info.prefix}: vLLM builds {num_experts} experts (H={hidden_size}, "
                f"I={intermediate_size_per_partition}) but the checkpoint stores {expected[0]} (H={expected[1]}, "
                f"I={expected[2]}); serve with --tensor-parallel-size 1 and no expert parallelism; check config.json"
            )
        routed = self._shapes(info)
        shared = self._shapes(self.shared_info) if self.shared_info is not None else {}
        join = self.shared_info is not None and joinable(info, self.shared_info) and routed.keys() == shared.keys()
        for kind, (shape, dtype) in routed.items():
            rows = shape[0] + (shared[kind][0][0] if join else 0)
            buffer = torch.empty((rows, *shape[1:]), dtype=dtype)
            self._register(layer, param_name(kind, False), buffer[: shape[0]])
            if join:
                self._register(layer, param_name(kind, True), buffer[shape[0] :])
        if not join:
            for kind, (shape, dtype) in shared.items():
                self._register(layer, param_name(kind, True), torch.empty(shape, dtype=dtype))

    @staticmethod
    def _shapes(info: StackInfo) -> dict[str, tuple[list[int], torch.dtype]]:
        dtypes = {"int32": torch.int32, "float16": torch.float16, "uint8": torch.uint8}
        shapes = {}
        for name, (shape, dtype) in info.tensor_shapes().items():
            kind = name.rsplit(".", 1)[1]
            if kind in TENSOR_FIELDS:  # w2_perm is dropped by the mapper
                shapes[kind] = (shape, dtypes[dtype])
        return shapes

    def _register(self, layer: torch.nn.Module, name: str, data: torch.Tensor) -> None:
        param = torch.nn.Parameter(data, requires_grad=False)
        param.weight_loader = self.load_stack  # type: ignore[attr-defined]
        layer.register_parameter(name, param)

    def load_stack(
        self,
        param: torch.nn.Parameter,
        loaded_weight: torch.Tensor,
        weight_name: str = "",
        shard_id: str | None = None,
        expert_id: int | None = None,
        return_success: bool = False,
    ) -> bool | None:
        """Copy a whole stored stack tensor into its parameter (it arrives as "expert 0", see the module doc)."""
        if tuple(loaded_weight.shape) != tuple(param.shape) or loaded_weight.dtype != param.dtype:
            raise RepackError(
                f"{weight_name or self.routed_info.prefix}: stored {loaded_weight.dtype} {list(loaded_weight.shape)} "
                f"but the stack needs {param.dtype} {list(param.shape)}; re-run `repack convert`"
            )
        param.data.copy_(loaded_weight)
        return True if return_success else None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Build the runtime block over the parameters (views, nothing copied).

        Where vLLM's runner scales the routed output itself (DeepSeek's ``routed_scaling_factor`` applied to the
        output) the shared expert must stay a separate term, so the block never joins there."""
        routed = self._weights(layer, self.routed_info, shared=False)
        shared = self._weights(layer, self.shared_info, shared=True) if self.shared_info is not None else None
        runner_scales = self.spec.scaling_factor != 1.0 and vllm_attribute(layer, "routed_scaling_factor") == 1.0
        self.block = MoeBlock(
            routed,
            None,
            self.spec,
            shared=shared,
            correction_bias=vllm_attribute(layer, "e_score_correction_bias"),
            name=self.routed_info.prefix,
            shared_mode=SEPARATE if runner_scales else None,
        )

    @staticmethod
    def _weights(layer: torch.nn.Module, info: StackInfo, shared: bool) -> MoeWeights:
        tensors = {f"{info.prefix}.{kind}": getattr(layer, param_name(kind, shared), None) for kind in TENSOR_FIELDS}
        return MoeWeights.from_tensors(info, {name: p.data for name, p in tensors.items() if p is not None})

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None

    # ------------------------------------------------------------------------------------------- running

    @property
    def is_monolithic(self) -> bool:
        return self.own_routing

    @property
    def mk_can_overlap_shared_experts(self) -> bool:
        """True for a stacked shared expert: vLLM's runner then leaves it to :meth:`apply` (computed here)."""
        return self.shared_info is not None

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input) -> torch.Tensor:
        """vLLM's top-k in, the block's output out (routed, plus a stacked shared expert)."""
        return self._run(x, topk_weights, topk_ids, shared_experts)

    def apply_monolithic(self, layer, x, router_logits, input_ids=None) -> torch.Tensor:
        """Router logits in: the runtime's router for this family, then the same experts."""
        topk_weights, topk_ids = self.block.route_logits(router_logits)
        return self._run(x, topk_weights, topk_ids, None)

    def _run(self, x, topk_weights, topk_ids, shared_experts) -> torch.Tensor:
        block = self.block
        if block.shared is not None and block.shared_gate is None:
            block.shared_gate = shared_gate(shared_experts)
        out, shared = block.apply_parts(x.contiguous(), topk_weights.float().contiguous(), topk_ids.to(torch.int32))
        if block.shared is not None and shared_experts is not None:
            hand_shared_output(shared_experts, out.new_zeros(()) if shared is None else shared)
        elif shared is not None:
            out = out + shared
        return out


def shared_gate(shared_experts) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Qwen2-MoE scales its shared expert by ``sigmoid(shared_expert_gate(x))``; vLLM keeps that gate (loaded from
    the checkpoint as usual) on its shared-expert module, which the runner hands us. DeepSeek has none."""
    if shared_experts is None:
        return None
    gate = getattr(shared_expert_module(shared_experts), "expert_gate", None)  # a model's module: None is DeepSeek
    if gate is None:
        return None
    return lambda x: gate(x)[0]
