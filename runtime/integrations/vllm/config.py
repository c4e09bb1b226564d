"""``quant_method: "repack"`` as a vLLM quantization config: which method each layer of the model gets.

- A MoE experts layer (``RoutedExperts``) of a block with stacks: :class:`~.moe.RepackMoEMethod`.
- The linears of a shared expert the converter stacked: no weights of their own (the stack runs with the
  experts, moe.py), :class:`StackedSharedLinearMethod`.
- A linear the checkpoint stores in GPTQ (a ``.qweight`` in the shards; q/k/v and gate/up that vLLM merges are
  looked up per source linear): vLLM's GPTQ method or ours (linear.py).
- Anything else is float: vLLM's unquantized method.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from repack.formats.checkpoint import parse_repack_quant_config
from repack.formats.constants import QUANT_METHOD, ROUTED, SHARED
from repack.formats.errors import RepackError
from repack.formats.families import BLOCK_ALIASES, SHARED_EXPERT_MODULES
from repack.formats.quant_config import QuantConfig, dense_linear_config, parse_quant_config
from repack.formats.stacks import StackInfo
from repack.runtime.integrations.vllm import check_vllm_version
from repack.runtime.integrations.vllm.internals import (
    request_cpu_amx,
    vllm_attribute,
    vllm_takes_checkpoint_weight_mapper,
)
from repack.runtime.integrations.vllm.linear import GptqLinearMethod
from repack.runtime.integrations.vllm.moe import RepackMoEMethod, stack_weight_mapper
from repack.runtime.routers import router_spec

WHERE = "config.json quantization_config"  # vLLM hands us the dict, not the folder
# vLLM's Mixtral names its MoE block ``block_sparse_moe`` (the older checkpoints' name); transformers 5 saves ``mlp``.
MIXTRAL_BLOCK = tuple(reversed(BLOCK_ALIASES[0]))  # (".mlp.", ".block_sparse_moe."), from formats/families.py


class StackedSharedLinearMethod(LinearMethodBase):
    """A linear of a shared expert that the converter stacked: no weights here, never run by vLLM.

    The experts method claims the shared expert (``mk_can_overlap_shared_experts``), so vLLM's runner never
    calls the module these linears belong to."""

    def __init__(self, name: str) -> None:
        self.name = name

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs) -> None:  # fmt: skip
        return None

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise RepackError(f"{self.name}: the stacked shared expert runs with the experts; this linear has no weights")


class RepackVllmConfig(QuantizationConfig):
    """The converted checkpoint's ``quantization_config`` (formats/SPEC.md section 4), kept as read."""

    def __init__(self, fields: dict[str, Any]) -> None:
        super().__init__()
        self.fields = fields
        self.stacks = parse_repack_quant_config(fields, WHERE)
        self.blocks: dict[str, dict[str, StackInfo]] = {}
        for info in self.stacks:
            self.blocks.setdefault(info.prefix.rpartition(".")[0], {})[info.kind] = info
        self.source: QuantConfig = parse_quant_config(dense_linear_config(fields), f"{WHERE} (its GPTQ linears)")
        self.gptq_modules: set[str] = set()  # source linears stored in GPTQ; read from the shards' headers
        self.gptq_methods: list[tuple[list[str], GptqLinearMethod]] = []  # (source linears, their method)
        self.model_type: str | None = None

    # ------------------------------------------------------------------------------------ vLLM's questions

    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # the Triton kernels use tensor-core dots of Ampere and later

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # everything is in config.json

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> RepackVllmConfig:
        check_vllm_version()
        request_cpu_amx()  # before vLLM's CPU attention runs on AMX tiles (internals.request_cpu_amx)
        return cls(config)

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None) -> None:
        """Which source linears the shards store in GPTQ (a ``.qweight``), from the safetensors headers only."""
        from vllm.transformers_utils.config import get_safetensors_params_metadata

        if hf_config is not None:
            self.model_type = hf_config.get_text_config().model_type
        stacked = {info.prefix for info in self.stacks}
        names = get_safetensors_params_metadata(model_name, revision=revision)
        self.gptq_modules = {
            name.removesuffix(".qweight")
            for name in names
            if name.endswith(".qweight") and name.rpartition(".")[0] not in stacked
        }

    def get_checkpoint_weight_mapper(self):
        """Our stack tensors to the names that reach the experts' parameters whole (moe.stack_weight_mapper).

        Unlike vLLM's default, ``g_idx`` is dropped only for the linears vLLM's GPTQ method runs (0.32's has no such
        parameter; 0.26's ignores it without act-order): ours reads act-order from it. vLLM 0.32's weight loader
        calls this after the model is built, so every method is chosen; 0.26's, at the same place, calls only
        :meth:`get_cache_scale_mapper`."""
        return self._checkpoint_mapper()

    def get_cache_scale_mapper(self):
        """vLLM's renames of KV-cache scales; on a vLLM without ``get_checkpoint_weight_mapper`` (0.26) also ours,
        which its weight loader takes from nowhere else (internals.vllm_takes_checkpoint_weight_mapper)."""
        mapper = QuantizationConfig.get_cache_scale_mapper()
        return mapper if vllm_takes_checkpoint_weight_mapper() else mapper | self._checkpoint_mapper()

    def _checkpoint_mapper(self):
        import regex as re
        from vllm.model_executor.models.utils import WeightsMapper

        mapper = stack_weight_mapper()
        if self.model_type == "mixtral":
            old, new = MIXTRAL_BLOCK
            block = re.compile(rf"(\.layers\.\d+){re.escape(old)}")
            mapper = mapper | WeightsMapper(orig_to_new_regex={block: rf"\1{new}"})
        vllm_gptq = sorted(name for sources, method in self.gptq_methods if method.uses_vllm for name in sources)
        if vllm_gptq:
            names = "|".join(re.escape(name) for name in vllm_gptq)
            mapper = mapper | WeightsMapper(orig_to_new_regex={re.compile(rf"^(?:{names})\.g_idx$"): None})
        return mapper

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, RoutedExperts):
            return self._experts_method(layer, prefix)
        if isinstance(layer, LinearBase):
            return self._linear_method(layer, prefix)
        return None

    # ------------------------------------------------------------------------------------------- methods

    def _experts_method(self, layer: RoutedExperts, prefix: str) -> RepackMoEMethod:
        block = prefix.removesuffix(".experts")
        old, new = MIXTRAL_BLOCK
        stacks = self.blocks.get(block) or self.blocks.get(f"{block}.".replace(new, old)[:-1], {})
        if ROUTED not in stacks:
            raise RepackError(
                f"{WHERE}: vLLM's MoE layer {prefix} has no stack in the checkpoint (stacks: "
                f"{', '.join(sorted(self.blocks)) or 'none'}); re-run `repack convert` for this model"
            )
        from vllm.config import get_current_vllm_config

        text_config = get_current_vllm_config().model_config.hf_text_config.to_dict()
        grouping = (text_config.get("n_group"), text_config.get("topk_group"))
        if str(text_config.get("model_type")).startswith("deepseek") and None in grouping:
            raise RepackError(
                f"config.json: n_group={grouping[0]}, topk_group={grouping[1]}, but vLLM's DeepSeek MoE always groups "
                "its top-k; set both (1 and 1 route as ungrouped, as DeepSeek-V2-Lite's config does)"
            )
        moe_config = vllm_attribute(layer, "moe_config")
        return RepackMoEMethod(moe_config, stacks[ROUTED], stacks.get(SHARED), router_spec(text_config))

    def _linear_method(self, layer: LinearBase, prefix: str) -> LinearMethodBase:
        block, _, rest = prefix.rpartition(".")
        owner = block.rpartition(".")[0]
        if block.rpartition(".")[2] in SHARED_EXPERT_MODULES and SHARED in self.blocks.get(owner, {}):
            return StackedSharedLinearMethod(prefix)
        sources = [f"{block}.{name}" for name in self.packed_modules_mapping.get(rest, [rest])]
        stored = [source in self.gptq_modules for source in sources]
        if not any(stored):
            return UnquantizedLinearMethod()
        if not all(stored):
            raise RepackError(
                f"{WHERE}: vLLM merges {', '.join(sources)} into {prefix}, but only some are GPTQ in the shards"
            )
        schemes = {self.source.scheme_for(source) or self.source.base for source in sources}
        if len(schemes) != 1:
            raise RepackError(f"{WHERE}: {', '.join(sources)} (merged into {prefix}) have different GPTQ schemes")
        method = GptqLinearMethod(schemes.pop(), prefix, act_order=bool(self.source.raw.get("desc_act")))
        self.gptq_methods.append((sources, method))
        return method
