"""The conversion as data: every output tensor, the source tensors it comes from, grouped per layer.

Building a :class:`Plan` reads only safetensors headers and the small ``g_idx`` tensors (to decide
act-order), and validates every expert linear's shapes with ``check_linear``; nothing large is loaded.
``repack convert --dry-run`` prints it (:mod:`repack.plan_view`), and :mod:`repack.convert` executes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import torch

from repack.families import MoeLayer, detect_family, find_moe_layers
from repack.formats.checkpoint import CONFIG_FILE, CheckpointReader, PlannedTensor
from repack.formats.errors import RepackError
from repack.formats.gptq import GptqLinear, GptqScheme, check_linear
from repack.formats.quant_config import QuantConfig, parse_quant_config
from repack.formats.stacks import (
    INDEX_FILE,
    MANIFEST_FILE,
    ROUTED,
    SHARED,
    StackInfo,
    choose_word_order,
    joinable,
    stack_info,
)
from repack.model_files import CopiedFile, select_model_files
from repack.source import SourceCheckpoint

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")
_OUTPUT_WEIGHT_FILE = re.compile(r"^model(-\d+-of-\d+)?\.safetensors(\.partial)?$")
_SAFETENSORS_CODE = {"int32": "I32", "float16": "F16", "uint8": "U8"}


@dataclass(frozen=True)
class CopyTensor:
    """An output tensor copied byte for byte from the source."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors code
    source_file: str
    nbytes: int

    @property
    def sources(self) -> list[str]:
        return [self.name]

    def planned_tensors(self) -> list[PlannedTensor]:
        return [PlannedTensor(self.name, self.dtype, tuple(self.shape))]


@dataclass
class PackStack:
    """One expert stack: the source expert linears -> the stack's tensors (formats/SPEC.md section 3)."""

    info: StackInfo
    sources: list[str]
    outputs: dict[str, tuple[list[int], str]]  # name -> (shape, dtype name)
    source_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.planned_tensors())

    @property
    def stacks(self) -> list[PackStack]:
        return [self]

    def planned_tensors(self) -> list[PlannedTensor]:
        """The stack's tensors in the order the converter writes them (formats.stacks.iter_pack_stack's)."""
        outputs = self.outputs.items()
        return [PlannedTensor(name, _SAFETENSORS_CODE[dtype], tuple(shape)) for name, (shape, dtype) in outputs]


@dataclass
class JoinedStacks:
    """A layer's routed and shared stacks written as pairs: each shared tensor right after the routed tensor of the
    same name, in the same shard (formats/SPEC.md section 5).

    Why: the runtime can then view each pair as one ``[E + C, ...]`` tensor and run the whole MoE block, routed
    experts and shared chunks, in one fused_moe call without copying a byte at load. Only for stacks that
    ``formats.stacks.joinable`` accepts (same scheme, tensors and per-expert shapes).
    """

    routed: PackStack
    shared: PackStack

    @property
    def stacks(self) -> list[PackStack]:
        return [self.routed, self.shared]

    @property
    def sources(self) -> list[str]:
        return self.routed.sources + self.shared.sources

    @property
    def source_bytes(self) -> int:
        return self.routed.source_bytes + self.shared.source_bytes

    @property
    def nbytes(self) -> int:
        return self.routed.nbytes + self.shared.nbytes

    def planned_tensors(self) -> list[PlannedTensor]:
        """Routed tensor, then the shared tensor of the same kind (marked to follow it), kind by kind."""
        pairs = zip(self.routed.planned_tensors(), self.shared.planned_tensors(), strict=True)
        return [tensor for routed, shared in pairs for tensor in (routed, replace(shared, follows=routed.name))]


Step = CopyTensor | PackStack | JoinedStacks


@dataclass
class LayerGroup:
    """The steps of one decoder layer (or of the tensors outside the layers), executed together."""

    label: str
    steps: list[Step] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(step.nbytes for step in self.steps)


@dataclass
class Plan:
    source: SourceCheckpoint
    quant: QuantConfig
    family: str
    groups: list[LayerGroup]
    weight_files: list[str]
    files_to_copy: tuple[CopiedFile, ...]
    files_left_behind: tuple[str, ...] = ()

    @property
    def stacks(self) -> list[StackInfo]:
        return [stack.info for group in self.groups for step in group.steps for stack in _stacks_of(step)]

    @property
    def output_bytes(self) -> int:
        return sum(group.nbytes for group in self.groups)

    def output_tensors(self) -> list[PlannedTensor]:
        """Every output tensor in the order the converter writes it (what the shard layout is built from)."""
        return [tensor for group in self.groups for step in group.steps for tensor in step.planned_tensors()]

    def copied_file_bytes(self) -> int:
        return sum((self.source.path / copied.source).stat().st_size for copied in self.files_to_copy)


def _stacks_of(step: Step) -> list[PackStack]:
    return [] if isinstance(step, CopyTensor) else step.stacks


def build_plan(
    source: SourceCheckpoint, reader: CheckpointReader, include: list[str] = (), exclude: list[str] = ()
) -> Plan:
    """Plan the conversion of ``source``; raises :class:`RepackError` for anything it cannot convert.

    ``include``/``exclude`` change which of the source's other files are copied (:mod:`repack.model_files`)."""
    where = str(source.path / (source.quantization_config_file or CONFIG_FILE))
    quant = parse_quant_config(source.quantization_config, where)
    family = detect_family(source.config, str(source.path / CONFIG_FILE))
    layers = find_moe_layers(family, source.config, reader.names(), str(source.path))
    stacks_by_layer: dict[int, list[PackStack | JoinedStacks]] = {}
    consumed: set[str] = set()
    for layer in layers:
        stacks_by_layer[layer.layer] = _layer_stacks(layer, quant, reader)
        consumed |= layer.consumed
    layer_groups: dict[int, LayerGroup] = {}
    others: list[CopyTensor] = []  # tensors outside the decoder layers (embeddings, final norm, lm_head)
    for name in reader.names():
        if name in consumed:
            continue
        entry = reader.entry(name)
        step = CopyTensor(name, entry.shape, entry.dtype, entry.file, entry.nbytes)
        match = _LAYER_INDEX.search(name)
        if match:
            layer_groups.setdefault(int(match[1]), LayerGroup(f"layer {match[1]}")).steps.append(step)
        else:
            others.append(step)
    for index, stacks in stacks_by_layer.items():
        layer_groups.setdefault(index, LayerGroup(f"layer {index}")).steps.extend(stacks)
    for group in layer_groups.values():
        copies = sorted((s for s in group.steps if isinstance(s, CopyTensor)), key=lambda s: s.name)
        group.steps = copies + [s for s in group.steps if not isinstance(s, CopyTensor)]
    skip = {*reader.files, INDEX_FILE, CONFIG_FILE, MANIFEST_FILE}
    # Stray weight files the index does not name would collide with (or pass for) our output shards.
    skip |= {f for f in source.files if _OUTPUT_WEIGHT_FILE.match(f)}
    selection = select_model_files(source.files, skip, include, exclude)
    return Plan(
        source=source,
        quant=quant,
        family=family.name,
        groups=_in_source_order(reader, [layer_groups[index] for index in sorted(layer_groups)], others),
        weight_files=list(reader.files),
        files_to_copy=selection.copied,
        files_left_behind=selection.left_behind,
    )


def _in_source_order(reader: CheckpointReader, layers: list[LayerGroup], others: list[CopyTensor]) -> list[LayerGroup]:
    """The layers in index order, with the tensors outside them (embeddings, final norm, lm_head) in a group "other"
    before them where they lie before every layer's bytes in the source files (file order, then offset), and in a
    group "other" after them otherwise.

    Why: the source hasher reads the files front to back and the converter reads each step once the hasher has
    passed it. Checkpoints store lm_head after the last layer; converted first, it was read cold from the end of the
    last file while the hasher read the first, and read again by the hasher later."""
    rank = {file: index for index, file in enumerate(reader.files)}

    def position(name: str) -> tuple[int, int]:
        entry = reader.entry(name)
        return rank[entry.file], entry.offset

    layer_names = [name for group in layers for step in group.steps for name in step.sources]
    first_layer_byte = min(map(position, layer_names), default=(len(rank), 0))
    front = LayerGroup("other", [step for step in others if position(step.name) < first_layer_byte])
    back = LayerGroup("other", [step for step in others if position(step.name) >= first_layer_byte])
    return [group for group in (front, *layers, back) if group.steps]


def _header_linear(reader: CheckpointReader, module: str) -> GptqLinear:
    """A GPTQ linear whose big tensors are shape-only (meta) and whose g_idx is loaded (it is small)."""

    def meta(suffix: str) -> torch.Tensor:
        entry = reader.entry(f"{module}.{suffix}")
        return torch.empty(entry.shape, dtype=entry.torch_dtype, device="meta")

    g_idx_name = f"{module}.g_idx"
    g_idx = reader.read(g_idx_name) if g_idx_name in reader else None
    return GptqLinear(qweight=meta("qweight"), qzeros=meta("qzeros"), scales=meta("scales"), g_idx=g_idx)


def _stack_scheme(quant: QuantConfig, triples: list[tuple[str, str, str]], prefix: str) -> GptqScheme:
    schemes = {}
    for module in (m for triple in triples for m in triple):
        scheme = quant.scheme_for(module)
        if scheme is None:
            raise RepackError(
                f"{quant.where}: {module} holds GPTQ tensors but the config marks it not quantized "
                "(dynamic '-:' or modules_in_block_to_quantize); fix the quantization config"
            )
        schemes.setdefault(scheme, module)
    if len(schemes) > 1:
        (a, ma), (b, mb) = list(schemes.items())[:2]
        raise RepackError(
            f"{quant.where}: experts of {prefix} use different schemes ({ma}: {a}; {mb}: {b}); one stack needs "
            "one scheme, fix the dynamic overrides"
        )
    return next(iter(schemes))


def _checked_experts(
    reader: CheckpointReader, triples: list[tuple[str, str, str]], scheme: GptqScheme
) -> tuple[list[tuple[GptqLinear, GptqLinear, GptqLinear]], int, int]:
    """Header linears of every expert, shape-checked against each other; returns (linears, H, I)."""
    experts = []
    hidden = inter = None
    for triple in triples:
        linears = tuple(_header_linear(reader, module) for module in triple)
        for module, linear in zip(triple, linears, strict=True):
            check_linear(module, linear, scheme)
        gate, up, down = linears
        if hidden is None:
            hidden, inter = gate.in_features(scheme), gate.out_features
        expected = ((hidden, inter), (hidden, inter), (inter, hidden))
        for module, linear, (k, n) in zip(triple, linears, expected, strict=True):
            if (linear.in_features(scheme), linear.out_features) != (k, n):
                raise RepackError(
                    f"misshapen expert tensor {module}.qweight: {list(linear.qweight.shape)} is a "
                    f"{linear.in_features(scheme)}x{linear.out_features} linear, but {triple[0].rsplit('.', 2)[0]} "
                    f"and its siblings need {k}x{n} ({triples[0][0]} sets H={hidden}, I={inter}); re-export it"
                )
        experts.append(linears)
    return experts, hidden, inter


def _stack(
    reader: CheckpointReader,
    quant: QuantConfig,
    prefix: str,
    kind: str,
    triples: list[tuple[str, str, str]],
    consumed: set[str],
) -> PackStack:
    scheme = _stack_scheme(quant, triples, prefix)
    experts, hidden, inter = _checked_experts(reader, triples, scheme)
    info = stack_info(prefix, kind, triples, experts, scheme, hidden=hidden, inter=inter)
    modules = {module for triple in triples for module in triple}
    sources = sorted(name for name in consumed if name.rsplit(".", 1)[0] in modules)
    source_bytes = sum(reader.entry(name).nbytes for name in sources)
    return PackStack(info=info, sources=sources, outputs=info.tensor_shapes(), source_bytes=source_bytes)


def shared_chunks(shared_inter: int, routed_inter: int, group_size: int) -> int:
    """C pseudo-experts of the routed size when I_s is a multiple of I and I a multiple of the group."""
    if group_size == -1 or shared_inter % routed_inter or routed_inter % group_size:
        return 1
    return shared_inter // routed_inter


def _layer_stacks(layer: MoeLayer, quant: QuantConfig, reader: CheckpointReader) -> list[PackStack | JoinedStacks]:
    """The layer's stack steps: routed, then shared; as one :class:`JoinedStacks` step when they are joinable."""
    routed = _stack(reader, quant, layer.routed_prefix, ROUTED, layer.routed, layer.consumed)
    if layer.shared is None:
        return [routed]
    shared = _stack(reader, quant, layer.shared_prefix, SHARED, [layer.shared], layer.consumed)
    info = shared.info
    chunks = shared_chunks(info.intermediate_size, routed.info.intermediate_size, info.group_size)
    if chunks > 1:
        info.num_experts = chunks
        info.intermediate_size //= chunks
        # The word order depends on the stacked expert's size, which is now the chunk's.
        info.word_order = choose_word_order(info.bits, info.hidden_size, info.intermediate_size, info.group_size)
        shared.outputs = info.tensor_shapes()
    if joinable(routed.info, shared.info):
        return [JoinedStacks(routed, shared)]
    return [routed, shared]
