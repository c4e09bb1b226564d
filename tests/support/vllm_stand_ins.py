"""Stand-ins for the parts of vLLM the plugin touches, so its code runs here without vLLM (CI installs one vLLM,
the CPU build 0.32; the GPU build 0.26 runs only on the H200).

Two layers:
- :func:`install_stand_ins`: ``vllm`` modules that hold exactly the names ``internals.VLLM_API`` lists for one
  version, plain classes except where the plugin needs behaviour (a quantization config base, a weights mapper
  that renames as vLLM's does, an experts-method base that keeps its config).
- The loading paths of vLLM's MoE models as each tested version runs them, written from their sources (vLLM
  0.26.0 ``routed_experts.py`` and ``runner/moe_runner.py``, 0.32.0 the same files, both versions'
  ``models/deepseek_v2.py``): :class:`StandInExperts` is an experts layer whose ``load_weights`` behaves as that
  version's ``RoutedExperts.load_weights``, :func:`runner_load` is ``MoERunner.load_weights`` handing it the
  ``(name, tensor)`` pairs under ``<block>.experts.``, and :func:`deepseek_load` is DeepSeek's own loader, which
  calls the parameter's ``weight_loader`` directly. tests/runtime/test_vllm_loading.py checks the stand-in of
  0.26 against the one failure seen on the H200 (its message, shapes and all), so it is not just a guess.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import regex
import torch

from repack.runtime.integrations.vllm.internals import VLLM_API

# ------------------------------------------------------------------------------------------------ vllm modules


class StandInWeightsMapper:
    """vLLM's ``WeightsMapper`` as the plugin uses it: regex renames in order, ``None`` drops the tensor."""

    def __init__(self, orig_to_new_regex=None) -> None:
        self.orig_to_new_regex = dict(orig_to_new_regex or {})

    def __or__(self, other: StandInWeightsMapper) -> StandInWeightsMapper:
        return StandInWeightsMapper({**self.orig_to_new_regex, **other.orig_to_new_regex})

    def _map_name(self, key: str) -> str | None:
        for pattern, new in self.orig_to_new_regex.items():
            if pattern.search(key):
                if new is None:
                    return None
                key = pattern.sub(new, key)
        return key

    def apply(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            mapped = self._map_name(name)
            if mapped is not None:
                yield mapped, tensor


class StandInQuantizationConfig:
    def __init__(self) -> None:
        self.packed_modules_mapping: dict = {}

    @staticmethod
    def get_cache_scale_mapper() -> StandInWeightsMapper:
        return StandInWeightsMapper({regex.compile(r"\.kv_scale$"): ".attn.k_scale"})


class StandInMethodBase:
    """``FusedMoEMethodBase``: keeps the layer's FusedMoEConfig as ``self.moe``."""

    def __init__(self, moe=None, *args, **kwargs) -> None:
        self.moe = moe


class StandInBase:
    def __init__(self, *args, **kwargs) -> None:
        pass


def install_stand_ins(version: tuple[int, int]) -> None:
    """``vllm`` modules holding exactly the names of ``VLLM_API[version]`` (behaviour only where the plugin calls)."""
    special = {
        "WeightsMapper": StandInWeightsMapper,
        "QuantizationConfig": StandInQuantizationConfig,
        "FusedMoEMethodBase": StandInMethodBase,
        "register_quantization_config": lambda name: lambda cls: cls,
        "register_weight_loader_v2_supported_method": lambda cls: cls,
        "current_platform": types.SimpleNamespace(is_cpu=lambda: False),
    }

    def module(name: str) -> types.ModuleType:
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name)
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(module(parent), child, sys.modules[name])
        return sys.modules[name]

    module("vllm").__version__ = f"{version[0]}.{version[1]}.0"
    for entry in VLLM_API[version]:
        module_name, _, path = entry.partition(":")
        owner = module(module_name)
        if not path:
            continue
        head, _, attribute = path.partition(".")
        if not hasattr(owner, head):
            setattr(owner, head, special.get(head) or type(head, (StandInBase,), {}))
        if attribute and attribute not in vars(getattr(owner, head)):
            setattr(getattr(owner, head), attribute, None)


PLUGIN_MODULES = ("config", "moe", "linear")  # the plugin's modules that import vLLM when imported


@contextmanager
def stand_in_vllm(version: tuple[int, int]) -> Iterator[None]:
    """The stand-in ``vllm`` of ``version`` in ``sys.modules`` for the block, the plugin's vLLM-importing modules
    imported fresh against it; both removed afterwards (the next test sees no ``vllm``)."""
    before = set(sys.modules)
    prefix = "repack.runtime.integrations.vllm."
    for name in PLUGIN_MODULES:
        sys.modules.pop(prefix + name, None)
    install_stand_ins(version)
    try:
        yield
    finally:
        for name in set(sys.modules) - before:
            if name == "vllm" or name.startswith("vllm.") or name.startswith(prefix):
                del sys.modules[name]
        for name in PLUGIN_MODULES:
            sys.modules.pop(prefix + name, None)


# ------------------------------------------------------------------------------------------------ loading paths


@dataclass(frozen=True)
class StandInParallel:
    """vLLM's FusedMoEParallelConfig: the fields the plugin reads."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    use_ep: bool = False
    dp_size: int = 1
    pcp_size: int = 1


@dataclass
class StandInMoeConfig:
    """vLLM's FusedMoEConfig: the one field the plugin reads."""

    moe_parallel_config: StandInParallel


def parallel_layout(tp_size: int, rank: int, expert_parallel: bool) -> StandInParallel:
    """What vLLM builds for one rank of ``tp_size`` (one data-parallel rank): TP as is, or, with expert parallelism,
    TP flattened into EP (``FusedMoEParallelConfig.make`` in both versions)."""
    if expert_parallel and tp_size > 1:
        return StandInParallel(ep_rank=rank, ep_size=tp_size, use_ep=True)
    return StandInParallel(tp_rank=rank, tp_size=tp_size)


def linear_expert_map(num_experts: int, layout: StandInParallel) -> torch.Tensor | None:
    """vLLM's default ("linear") placement: rank r holds experts [r E/n, (r + 1) E/n); global id -> local or -1."""
    if not layout.use_ep:
        return None
    per_rank = num_experts // layout.ep_size
    mapping = torch.full((num_experts,), -1, dtype=torch.int32)
    first = layout.ep_rank * per_rank
    mapping[first : first + per_rank] = torch.arange(per_rank, dtype=torch.int32)
    return mapping


CHECKPOINT_NAMES = {"gate_proj": ("gate_proj", "down_proj", "up_proj"), "w1": ("w1", "w2", "w3")}


def expert_mapping(num_experts: int, gate: str = "gate_proj") -> list[tuple[str, str, int, str]]:
    """``RoutedExperts.get_expert_mapping(include_fused=True)`` (both versions) for a model whose expert
    projections are named ``gate_proj/down_proj/up_proj`` or (Mixtral in vLLM) ``w1/w2/w3``: (parameter prefix,
    checkpoint name part, expert id, shard id), the fused entries first."""
    gate, down, up = CHECKPOINT_NAMES[gate]
    fused_gate_up = "gate_up_proj" if gate == "gate_proj" else "w13"
    fused = [
        ("experts.w13_weight", f"experts.{fused_gate_up}", 0, "w1"),
        ("experts.w13_weight", f"experts.{fused_gate_up}", 1, "w3"),
        ("experts.w2_weight", f"experts.{down}", 0, "w2"),
    ]
    per_expert = [
        ("experts.w13_" if proj != down else "experts.w2_", f"experts.{e}.{proj}.", e, shard)
        for e in range(num_experts)
        for shard, proj in (("w1", gate), ("w2", down), ("w3", up))
    ]
    return fused + per_expert


class StandInExperts(torch.nn.Module):
    """vLLM's ``RoutedExperts`` as the plugin meets it: the attributes it reads, and ``load_weights`` as
    ``version``'s (:meth:`load_weights_026`, :meth:`load_weights_032`)."""

    def __init__(
        self, version, layer_name: str, num_experts: int, hidden: int, layout: StandInParallel, gate: str = "gate_proj"
    ) -> None:
        super().__init__()
        self.version = version
        self.layer_name = layer_name
        self.num_experts = num_experts
        self.hidden = hidden
        self.moe_config = StandInMoeConfig(layout)
        self.expert_map = linear_expert_map(num_experts, layout)
        self.routed_scaling_factor = 1.0
        self.e_score_correction_bias = None
        self.ckpt_gate_proj_name, self.ckpt_down_proj_name, _ = CHECKPOINT_NAMES[gate]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[str]:
        loader = self.load_weights_026 if self.version == (0, 26) else self.load_weights_032
        return loader(weights)

    def load_weights_026(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[str]:
        """vLLM 0.26.0: any 3-D tensor is a fused [E, N, K] checkpoint tensor. Each mapping entry whose name part
        is in the tensor's name is taken, and for a fused tensor the first run of matches only; a gate/up tensor
        is transposed unless its last axis is H, then halved along axis 1 (the entry's expert id picks the half),
        a down tensor transposed unless axis -2 is H; then unbound, expert e to the parameter's weight_loader
        with expert id e. A tensor of another rank is one expert: expert id from the entry."""
        mapping = expert_mapping(self.num_experts, self.ckpt_gate_proj_name)
        for name, tensor in weights:
            qual_name = f"{self.layer_name}.{name}"
            fused = tensor.dim() == 3
            matched = False
            for param_prefix, part, expert_id, shard_id in mapping:
                if part not in qual_name:
                    if matched and fused:
                        break
                    continue
                matched = True
                weight_name = qual_name.replace(part, param_prefix)
                param = getattr(self, weight_name.removeprefix(f"{self.layer_name}."))
                if fused:
                    if shard_id in ("w1", "w3"):
                        oriented = tensor if tensor.shape[-1] == self.hidden else tensor.transpose(-1, -2)
                        experts, start = oriented.chunk(2, dim=1)[expert_id], 0
                    else:
                        experts = tensor if tensor.shape[-2] == self.hidden else tensor.transpose(-1, -2)
                        start = 0
                else:
                    experts, start = tensor.unsqueeze(0), expert_id
                for index, one in enumerate(experts.unbind(), start=start):
                    if self._hand(param, one, weight_name, shard_id, index):
                        yield weight_name.removeprefix(f"{self.layer_name}.")

    def load_weights_032(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[str]:
        """vLLM 0.32.0: a tensor whose name carries an expert id (``experts.<j>.``) is that expert's, whatever its
        rank: it reaches the weight_loader whole, expert id j, through that expert's entries only."""
        mapping = expert_mapping(self.num_experts, self.ckpt_gate_proj_name)
        for name, tensor in weights:
            qual_name = f"{self.layer_name}.{name}"
            key = qual_name.partition("experts.")[2].partition(".")[0]
            if not key.isdecimal():
                raise NotImplementedError("fused checkpoint tensors: not what a converted checkpoint holds")
            for param_prefix, part, expert_id, shard_id in mapping:
                if part not in qual_name:
                    continue
                weight_name = qual_name.replace(part, param_prefix)
                param = getattr(self, weight_name.removeprefix(f"{self.layer_name}."))
                if self._hand(param, tensor, weight_name, shard_id, expert_id):
                    yield weight_name.removeprefix(f"{self.layer_name}.")

    @staticmethod
    def _hand(param, tensor: torch.Tensor, weight_name: str, shard_id: str, expert_id: int) -> bool:
        """The call both versions make: the parameter's weight_loader, by keyword, asked whether it loaded."""
        return param.weight_loader(
            param=param,
            loaded_weight=tensor,
            weight_name=weight_name,
            shard_id=shard_id,
            expert_id=expert_id,
            return_success=True,
        )


def runner_load(experts: StandInExperts, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """``AutoWeightsLoader`` reaching a MoE block's ``experts`` (vLLM's MoERunner): every ``(name, tensor)`` under
    ``<block>.experts.``, names relative to it, to ``MoERunner.load_weights``, which hands them all to
    ``self.routed_experts.load_weights`` (an attribute looked up on the instance: the plugin's, once it took it)."""
    prefix = f"{experts.layer_name}."
    relative = ((name.removeprefix(prefix), tensor) for name, tensor in weights if name.startswith(prefix))
    return list(experts.load_weights(relative))


def deepseek_load(experts: StandInExperts, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """DeepSeek's own ``load_weights`` (both versions) on the experts' tensors: the first per-expert mapping entry
    whose name part is in the name gives the parameter, whose ``weight_loader`` gets the tensor whole."""
    loaded = []
    per_expert = expert_mapping(experts.num_experts)[3:]  # DeepSeek builds the per-expert entries only
    for name, tensor in weights:
        for param_prefix, part, expert_id, shard_id in per_expert:
            if part not in name:
                continue
            param_name = name.replace(part, param_prefix).rpartition(".")[2]
            param = getattr(experts, param_name)
            if param.weight_loader(param, tensor, name, shard_id=shard_id, expert_id=expert_id, return_success=True):
                loaded.append(param_name)
                break
    return loaded
