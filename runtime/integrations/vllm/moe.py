"""The sparse-MoE experts under vLLM: parameters that are the stored stacks, run by ``repack.runtime.fused_moe``.

Loading. vLLM's MoE loaders go expert by expert: a checkpoint tensor named ``<block>.experts.{j}.<proj>.<x>``
reaches ``param.weight_loader`` of the experts layer's parameter ``<w13|w2>_<x>`` with expert id j. Our stacks
hold every expert in one tensor, so :func:`stack_weight_mapper` (the config's checkpoint mapper) renames each
stored stack tensor as if it were "expert 0" of its projection. DeepSeek's own ``load_weights`` then hands the
whole ``[E, ...]`` tensor to the parameter's ``weight_loader``, :meth:`RepackMoEMethod.load_stack`; the other
families reach the experts layer through vLLM's ``RoutedExperts.load_weights``, which the method replaces on its
layer by :meth:`RepackMoEMethod.load_layer_weights` (vLLM 0.26's would cut a stack apart as a fused checkpoint
tensor, internals.take_experts_loading), which hands each tensor whole to ``load_stack`` too. ``load_stack``
keeps this rank's part (sharding.StackShard: all of it, a tensor-parallel slice of every expert, or whole
experts under expert parallelism) and copies it into the parameter of that shape: one copy per tensor, no
reshuffle. Every parameter must have been loaded by ``process_weights_after_loading`` (vLLM checks nothing of a
quantized model's weights), else one RepackError line.

Running. vLLM routes (its own top-k, the "topk already computed" form :meth:`RepackMoEMethod.apply`) and the
method runs the runtime's :class:`~repack.runtime.moe_block.MoeBlock` on those ids: the routed experts, and a
shared expert the converter stacked, in one launch where ``MoeBlock`` joins them (routed and shared parameters
are views of one buffer per tensor, as the converter lays the files out) or two. The "router logits in" form
(:meth:`RepackMoEMethod.apply_monolithic`, used when ``REPACK_VLLM_ROUTING=repack``) routes with the runtime's
own router instead. A stacked shared expert is computed here, so vLLM's shared-expert module (which has no
weights: the converter replaced its linears by the stack) is handed to us rather than run by vLLM's runner.
Under tensor or expert parallelism each rank computes its part (its slice of every expert and of the shared
expert; or its experts, the pairs routed elsewhere sent to a zero expert, and its slice of the shared expert)
and vLLM's runner all-reduces the block's output over the ranks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEConfig, FusedMoEMethodBase
from vllm.model_executor.models.utils import WeightsMapper

from repack.formats.errors import RepackError
from repack.formats.stacks import StackInfo, joinable
from repack.runtime.integrations.vllm.internals import (
    hand_shared_output,
    local_experts,
    moe_parallel,
    shared_expert_module,
    take_experts_loading,
    vllm_attribute,
)
from repack.runtime.integrations.vllm.sharding import StackShard, plan_shard
from repack.runtime.moe_block import SEPARATE, MoeBlock
from repack.runtime.routers import SOFTMAX_TOPK, RouterSpec
from repack.runtime.weights import TENSOR_FIELDS, MoeWeights

ROUTING_ENV = "REPACK_VLLM_ROUTING"  # "vllm" (default): vLLM's top-k; "repack": the runtime's router on the logits
PROJECTION = {"w13": "gate_proj", "w2": "down_proj"}  # the per-expert checkpoint name each stack tensor poses as
SHARED_TAG = "shared_"


def param_name(kind: str, shared: bool) -> str:
    """The experts layer's parameter for stack tensor ``kind`` (``w13_qweight``): that name, or ``w13_shared_qweight``
    for the shared stack."""
    stem, rest = kind.split("_", 1)
    return f"{stem}_{SHARED_TAG if shared else ''}{rest}"


def stack_pose(kind: str, shared: bool, projections: dict[str, str] = PROJECTION) -> str:
    """The name (relative to ``<block>.experts``) under which stack tensor ``kind`` reaches the experts layer:
    ``w13_qweight`` -> ``0.gate_proj.qweight``, shared ``w2_scales`` -> ``0.down_proj.shared_scales``
    (what :func:`stack_weight_mapper` renames it to), or with the model's own projection names where its loader
    renames ours (vLLM 0.32's Mixtral: ``0.w1.qweight``)."""
    stem, rest = kind.split("_", 1)
    return f"0.{projections[stem]}.{SHARED_TAG if shared else ''}{rest}"


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
        self.moe_config = moe
        self.routed_info = routed
        self.shared_info = shared
        self.spec = spec
        self.block: MoeBlock | None = None
        self.shards: dict[bool, StackShard] = {}  # shared? -> this rank's part of that stack (create_weights)
        self.params: dict[str, torch.nn.Parameter] = {}  # stack_pose(kind, shared) -> the parameter
        self.projections: list[dict[str, str]] = [PROJECTION]  # the poses' projection names (create_weights)
        self.id_map: torch.Tensor | None = None  # expert parallelism: global expert id -> local id
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
        """One parameter per stored stack tensor, of its dtype and of this rank's shape (shared ones tagged
        ``shared_``), and the layer's loading taken over (module doc).

        A joinable shared stack (formats.stacks.joinable) gets views of one ``[E + C, ...]`` buffer per tensor,
        routed rows first, like the converter's files, so ``MoeBlock`` can run both in one launch.
        """
        self.shards = self._plan(layer)
        own = {"w13": vllm_attribute(layer, "ckpt_gate_proj_name"), "w2": vllm_attribute(layer, "ckpt_down_proj_name")}
        self.projections = [PROJECTION, own]
        routed_shard = self.shards[False]
        info = routed_shard.local
        expected = (info.num_experts, info.hidden_size, info.intermediate_size)
        if (num_experts, hidden_size, intermediate_size_per_partition) != expected:
            raise RepackError(
                f"{info.prefix}: vLLM builds {num_experts} experts (H={hidden_size}, "
                f"I={intermediate_size_per_partition}) on this rank but this rank's part of the checkpoint's stack "
                f"is {expected[0]} (H={expected[1]}, I={expected[2]}); check config.json against the stack"
            )
        routed = self._shapes(routed_shard)
        shared_shard = self.shards.get(True)
        shared = self._shapes(shared_shard) if shared_shard is not None else {}
        join = (
            shared_shard is not None
            and routed_shard.experts is None
            and joinable(info, shared_shard.local)
            and routed.keys() == shared.keys()
        )
        for kind, (shape, dtype) in routed.items():
            rows = shape[0] + (shared[kind][0][0] if join else 0)
            buffer = torch.empty((rows, *shape[1:]), dtype=dtype)
            if routed_shard.absent_expert is not None:  # the zero expert: scales 0, so its output is exactly 0
                buffer[routed_shard.absent_expert].zero_()
            self._register(layer, kind, False, buffer[: shape[0]])
            if join:
                self._register(layer, kind, True, buffer[shape[0] :])
        if not join:
            for kind, (shape, dtype) in shared.items():
                self._register(layer, kind, True, torch.empty(shape, dtype=dtype))
        take_experts_loading(layer, self.load_layer_weights)

    def _plan(self, layer: torch.nn.Module) -> dict[bool, StackShard]:
        """This rank's part of the routed stack and of the shared one, from vLLM's rank layout for the layer."""
        parallel = moe_parallel(self.moe_config)
        prefix = self.routed_info.prefix
        if parallel.dp_size > 1 or parallel.pcp_size > 1:
            raise RepackError(
                f"{prefix}: the repack plugin serves tensor- and expert-parallel ranks only (data-parallel size "
                f"{parallel.dp_size}, context-parallel size {parallel.pcp_size}); serve with "
                "--data-parallel-size 1 and no context parallelism"
            )
        if parallel.use_ep:
            experts = local_experts(layer, self.routed_info.num_experts)
            shards = {False: plan_shard(self.routed_info, experts=experts, ep_size=parallel.ep_size)}
        else:
            shards = {False: plan_shard(self.routed_info, tp=(parallel.tp_rank, parallel.tp_size))}
        if self.shared_info is not None:  # the shared expert is a slice per rank of the group vLLM all-reduces
            shards[True] = plan_shard(self.shared_info, tp=parallel.group)
        return shards

    @staticmethod
    def _shapes(shard: StackShard) -> dict[str, tuple[list[int], torch.dtype]]:
        """The parameters' shapes and dtypes, of the tensors the kernels read (w2_perm is dropped by the mapper)."""
        return {kind: shape for kind, shape in shard.shapes().items() if kind in TENSOR_FIELDS}

    def _register(self, layer: torch.nn.Module, kind: str, shared: bool, data: torch.Tensor) -> None:
        param = torch.nn.Parameter(data, requires_grad=False)
        param.weight_loader = self.load_stack  # type: ignore[attr-defined]
        param.repack_stack = (kind, shared)  # type: ignore[attr-defined]
        param.repack_loaded = False  # type: ignore[attr-defined]
        layer.register_parameter(param_name(kind, shared), param)
        for projections in self.projections:
            self.params[stack_pose(kind, shared, projections)] = param

    def load_layer_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[str]:
        """The experts layer's ``load_weights`` (in place of vLLM's): each stack tensor, named as
        :func:`stack_pose` (relative to ``<block>.experts``), whole to :meth:`load_stack`; yields the parameters'
        names. Anything else under the experts is no tensor of a converted checkpoint: one RepackError line."""
        for name, tensor in weights:
            param = self.params.get(name)
            if param is None:
                raise RepackError(
                    f"{self.routed_info.prefix}.{name}: not a tensor of this layer's expert stacks (a converted "
                    "checkpoint stores its experts only as stacks); re-run `repack convert` on the GPTQ source"
                )
            self.load_stack(param, tensor, weight_name=f"{self.routed_info.prefix}.{name}")
            yield param_name(*param.repack_stack)

    def load_stack(
        self,
        param: torch.nn.Parameter,
        loaded_weight: torch.Tensor,
        weight_name: str = "",
        shard_id: str | None = None,
        expert_id: int | None = None,
        return_success: bool = False,
    ) -> bool | None:
        """Copy this rank's part of a whole stored stack tensor into its parameter (it arrives as "expert 0",
        see the module doc)."""
        kind, shared = param.repack_stack
        shard = self.shards[shared]
        shape, dtype = shard.stored_shape(kind)
        if list(loaded_weight.shape) != shape or loaded_weight.dtype != dtype:
            raise RepackError(
                f"{weight_name or shard.stored.prefix}: stored {loaded_weight.dtype} {list(loaded_weight.shape)} "
                f"but the stack needs {dtype} {shape}; re-run `repack convert`"
            )
        part = shard.cut(kind, loaded_weight)
        target = param.data if shard.absent_expert is None else param.data[: shard.absent_expert]
        target.copy_(part)
        param.repack_loaded = True
        return True if return_success else None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Build the runtime block over the parameters (views, nothing copied).

        Where vLLM's runner scales the routed output itself (DeepSeek's ``routed_scaling_factor`` applied to the
        output) the shared expert must stay a separate term, so the block never joins there."""
        missing = {param_name(*p.repack_stack) for p in self.params.values() if not p.repack_loaded}
        if missing:
            raise RepackError(
                f"{self.routed_info.prefix}: {', '.join(sorted(missing))} not loaded from the checkpoint (vLLM's "
                "loader never handed these stack tensors to the plugin); re-run `repack convert`, and serve with a "
                "tested vLLM"
            )
        routed = self._weights(layer, self.shards[False].local, shared=False)
        shared = self._weights(layer, self.shards[True].local, shared=True) if self.shared_info is not None else None
        self.id_map = self.shards[False].id_map(routed.w13_qweight.device)
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
        """Router logits in: the runtime's router for this family, then the same experts. A softmax top-k over
        all experts on this rank (no shared expert here: refused at init) routes inside the kernels' first launch
        (``fused_moe.routed_moe``); the other routers run in torch, and expert-parallel ids need this rank's map."""
        block = self.block
        if block.spec.method == SOFTMAX_TOPK and self.id_map is None:
            from repack.runtime.fused_moe import routed_moe

            spec = block.spec
            return routed_moe(x.contiguous(), block.routed, router_logits, spec.top_k, spec.renormalize)
        topk_weights, topk_ids = block.route_logits(router_logits)
        return self._run(x, topk_weights, topk_ids, None)

    def _run(self, x, topk_weights, topk_ids, shared_experts) -> torch.Tensor:
        block = self.block
        if block.shared is not None and block.shared_gate is None:
            block.shared_gate = shared_gate(shared_experts)
        ids = topk_ids.to(torch.int32) if self.id_map is None else self.id_map[topk_ids.long()]
        out, shared = block.apply_parts(x.contiguous(), topk_weights.float().contiguous(), ids)
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
