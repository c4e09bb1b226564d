"""The conversion as data: every output tensor, the source tensors it comes from, grouped per layer.

Building a :class:`Plan` reads only safetensors headers and the small ``g_idx`` tensors (to decide
act-order), and validates every quantized linear's shapes through the checkpoint's source-format reader
(formats/sources/); nothing large is loaded. The plan itself knows no source format: it asks the reader.
``repack convert --dry-run`` prints it (:mod:`repack.plan_view`), and :mod:`repack.convert` executes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from repack.families import MoeLayer, detect_family, find_moe_layers
from repack.formats.checkpoint import CONFIG_FILE, CheckpointReader, PlannedTensor
from repack.formats.errors import RepackError
from repack.formats.families import ROUTER_MODULE, SHARED_GATE_MODULES
from repack.formats.quant_config import DENSE_LINEAR_FORMAT
from repack.formats.sources import CanonicalLinear, LinearScheme, SourceFormat, source_format
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


@dataclass
class ConvertLinear:
    """A non-expert quantized linear of a source whose layout the runtime does not read (AWQ, compressed-tensors):
    its tensors become the GPTQ tensors of the same module (``gptq_v2`` zero points), which the runtime's dense
    GPTQ linear runs and verify turns back into the source's."""

    module: str
    scheme: LinearScheme  # the source's scheme of this linear
    sources: list[str]  # the source tensors it reads
    outputs: dict[str, tuple[list[int], str]]  # name -> (shape, dtype name), in write order
    source_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.planned_tensors())

    def planned_tensors(self) -> list[PlannedTensor]:
        return [PlannedTensor(n, _SAFETENSORS_CODE[dtype], tuple(shape)) for n, (shape, dtype) in self.outputs.items()]


Step = CopyTensor | PackStack | JoinedStacks | ConvertLinear


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
    source_format: SourceFormat
    family: str
    groups: list[LayerGroup]
    weight_files: list[str]
    files_to_copy: tuple[CopiedFile, ...]
    files_left_behind: tuple[str, ...] = ()

    @property
    def stacks(self) -> list[StackInfo]:
        return [stack.info for group in self.groups for step in group.steps for stack in _stacks_of(step)]

    @property
    def converted_linears(self) -> list[ConvertLinear]:
        return [step for group in self.groups for step in group.steps if isinstance(step, ConvertLinear)]

    @property
    def output_bytes(self) -> int:
        return sum(group.nbytes for group in self.groups)

    def output_tensors(self) -> list[PlannedTensor]:
        """Every output tensor in the order the converter writes it (what the shard layout is built from)."""
        return [tensor for group in self.groups for step in group.steps for tensor in step.planned_tensors()]

    def copied_file_bytes(self) -> int:
        return sum((self.source.path / copied.source).stat().st_size for copied in self.files_to_copy)


def _stacks_of(step: Step) -> list[PackStack]:
    return step.stacks if isinstance(step, PackStack | JoinedStacks) else []


def build_plan(
    source: SourceCheckpoint, reader: CheckpointReader, include: list[str] = (), exclude: list[str] = ()
) -> Plan:
    """Plan the conversion of ``source``; raises :class:`RepackError` for anything it cannot convert.

    ``include``/``exclude`` change which of the source's other files are copied (:mod:`repack.model_files`)."""
    where = str(source.path / (source.quantization_config_file or CONFIG_FILE))
    fmt = source_format(source.quantization_config, where)
    family = detect_family(source.config, str(source.path / CONFIG_FILE))
    layers = find_moe_layers(family, source.config, reader.names(), str(source.path), fmt)
    stacks_by_layer: dict[int, list[PackStack | JoinedStacks]] = {}
    consumed: set[str] = set()
    for layer in layers:
        stacks_by_layer[layer.layer] = _layer_stacks(layer, fmt, reader)
        consumed |= layer.consumed
    linears = [] if fmt.stores_gptq_linears else _dense_linears(fmt, reader, consumed)
    consumed |= {name for step in linears for name in step.sources}
    layer_groups: dict[int, LayerGroup] = {}
    others: list[Step] = []  # tensors outside the decoder layers (embeddings, final norm, lm_head)
    steps: list[Step] = [*linears]
    for name in reader.names():
        if name in consumed:
            continue
        entry = reader.entry(name)
        steps.append(CopyTensor(name, entry.shape, entry.dtype, entry.file, entry.nbytes))
    for step in steps:
        label = step.name if isinstance(step, CopyTensor) else step.module
        match = _LAYER_INDEX.search(label)
        if match:
            layer_groups.setdefault(int(match[1]), LayerGroup(f"layer {match[1]}")).steps.append(step)
        else:
            others.append(step)
    for index, stacks in stacks_by_layer.items():
        layer_groups.setdefault(index, LayerGroup(f"layer {index}")).steps.extend(stacks)
    for group in layer_groups.values():
        singles = sorted((s for s in group.steps if _is_single(s)), key=_step_name)
        group.steps = singles + [s for s in group.steps if not _is_single(s)]
    skip = {*reader.files, INDEX_FILE, CONFIG_FILE, MANIFEST_FILE}
    # Stray weight files the index does not name would collide with (or pass for) our output shards.
    skip |= {f for f in source.files if _OUTPUT_WEIGHT_FILE.match(f)}
    selection = select_model_files(source.files, skip, include, exclude)
    return Plan(
        source=source,
        source_format=fmt,
        family=family.name,
        groups=_in_source_order(reader, [layer_groups[index] for index in sorted(layer_groups)], others),
        weight_files=list(reader.files),
        files_to_copy=selection.copied,
        files_left_behind=selection.left_behind,
    )


def _is_single(step: Step) -> bool:
    return isinstance(step, CopyTensor | ConvertLinear)


def _step_name(step: Step) -> str:
    return step.name if isinstance(step, CopyTensor) else f"{step.module}."


def _dense_linears(fmt: SourceFormat, reader: CheckpointReader, consumed: set[str]) -> list[ConvertLinear]:
    """Every quantized linear outside the expert stacks, planned as GPTQ tensors of the same module name."""
    modules = sorted(
        name.removesuffix(f".{fmt.marker}")
        for name in reader.names()
        if name.endswith(f".{fmt.marker}") and name not in consumed
    )
    steps = []
    for module in modules:
        if module.rsplit(".", 1)[-1] in (ROUTER_MODULE, *SHARED_GATE_MODULES):
            raise RepackError(
                f"{module} is a MoE router (or shared-expert gate) stored {fmt.name}-quantized; routers run in float, "
                "so re-quantize with it left out (ignore / modules_to_not_convert)"
            )
        scheme = fmt.scheme_for(module)
        if scheme is None:
            raise RepackError(
                f"{fmt.where}: {module} holds {fmt.name} tensors but the config marks it not quantized (ignore / "
                "modules_to_not_convert); fix the quantization config"
            )
        missing = [s for s in fmt.required if f"{module}.{s}" not in reader]
        if missing:
            raise RepackError(f"missing tensor {module}.{missing[0]}; the checkpoint is incomplete, re-download it")
        linear = fmt.header_linear(reader, module, scheme)
        k, n = linear.in_features(scheme), linear.out_features
        groups, pack = scheme.groups(k), scheme.pack_factor
        outputs = {
            f"{module}.qweight": ([k // pack, n], "int32"),
            f"{module}.qzeros": ([groups, n // pack], "int32"),
            f"{module}.scales": ([groups, n], "float16"),
        }
        if linear.g_idx is not None:
            outputs[f"{module}.g_idx"] = ([k], "int32")
        sources = fmt.module_tensors(module, lambda name: name in reader)
        source_bytes = sum(reader.entry(name).nbytes for name in sources)
        steps.append(ConvertLinear(module, scheme, sources, outputs, source_bytes))
    return steps


def dense_linear_config(plan: Plan) -> dict | None:
    """The GPTQ quantization config of the linears the plan converts into GPTQ tensors, for a source whose linears
    the runtime does not read as they are (None for GPTQ: its own config describes them): the most common scheme as
    the base, a ``dynamic`` override per module of another scheme (GPTQModel's syntax, which the runtime's dense GPTQ
    linear reads)."""
    if plan.source_format.stores_gptq_linears:
        return None
    linears = plan.converted_linears
    key = lambda scheme: (scheme.bits, scheme.group_size, scheme.sym)  # noqa: E731
    counts: dict[tuple, int] = {}
    for scheme in [step.scheme for step in linears] or [info.scheme for info in plan.stacks]:
        counts[key(scheme)] = counts.get(key(scheme), 0) + 1
    bits, group, sym = max(counts, key=counts.get)
    dynamic = {
        f"+:^{re.escape(step.module)}$": {"bits": step.scheme.bits, "group_size": step.scheme.group_size,
                                          "sym": step.scheme.sym}
        for step in linears
        if key(step.scheme) != (bits, group, sym)
    }  # fmt: skip
    act_order = any(name.endswith(".g_idx") for step in linears for name in step.outputs)
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": act_order,
              "checkpoint_format": DENSE_LINEAR_FORMAT}  # fmt: skip
    if dynamic:
        config["dynamic"] = dynamic
    return config


def _in_source_order(reader: CheckpointReader, layers: list[LayerGroup], others: list[Step]) -> list[LayerGroup]:
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
    front = LayerGroup("other", [step for step in others if position(step.sources[0]) < first_layer_byte])
    back = LayerGroup("other", [step for step in others if position(step.sources[0]) >= first_layer_byte])
    return [group for group in (front, *layers, back) if group.steps]


def _stack_scheme(fmt: SourceFormat, triples: list[tuple[str, str, str]], prefix: str) -> LinearScheme:
    schemes = {}
    for module in (m for triple in triples for m in triple):
        scheme = fmt.scheme_for(module)
        if scheme is None:
            raise RepackError(
                f"{fmt.where}: {module} holds {fmt.name} tensors but the config marks it not quantized "
                "(dynamic '-:', modules_in_block_to_quantize, ignore or modules_to_not_convert); fix the "
                "quantization config"
            )
        schemes.setdefault(scheme, module)
    if len(schemes) > 1:
        (a, ma), (b, mb) = list(schemes.items())[:2]
        raise RepackError(
            f"{fmt.where}: experts of {prefix} use different schemes ({ma}: {a}; {mb}: {b}); one stack needs "
            "one scheme, fix the quantization config"
        )
    return next(iter(schemes))


def _checked_experts(
    reader: CheckpointReader, fmt: SourceFormat, triples: list[tuple[str, str, str]], scheme: LinearScheme
) -> tuple[list[tuple[CanonicalLinear, CanonicalLinear, CanonicalLinear]], int, int]:
    """Header linears of every expert, shape-checked against each other; returns (linears, H, I)."""
    experts = []
    hidden = inter = None
    for triple in triples:
        linears = tuple(fmt.header_linear(reader, module, scheme) for module in triple)
        gate, up, down = linears
        if hidden is None:
            hidden, inter = gate.in_features(scheme), gate.out_features
        expected = ((hidden, inter), (hidden, inter), (inter, hidden))
        for module, linear, (k, n) in zip(triple, linears, expected, strict=True):
            if (linear.in_features(scheme), linear.out_features) != (k, n):
                raise RepackError(
                    f"misshapen expert tensor {module}.{fmt.marker}: a {linear.in_features(scheme)}x"
                    f"{linear.out_features} linear, but {triple[0].rsplit('.', 2)[0]} and its siblings need {k}x{n} "
                    f"({triples[0][0]} sets H={hidden}, I={inter}); re-export it"
                )
        experts.append(linears)
    return experts, hidden, inter


def _stack(
    reader: CheckpointReader,
    fmt: SourceFormat,
    prefix: str,
    kind: str,
    triples: list[tuple[str, str, str]],
    consumed: set[str],
) -> PackStack:
    scheme = _stack_scheme(fmt, triples, prefix)
    experts, hidden, inter = _checked_experts(reader, fmt, triples, scheme)
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


def _layer_stacks(layer: MoeLayer, fmt: SourceFormat, reader: CheckpointReader) -> list[PackStack | JoinedStacks]:
    """The layer's stack steps: routed, then shared; as one :class:`JoinedStacks` step when they are joinable."""
    routed = _stack(reader, fmt, layer.routed_prefix, ROUTED, layer.routed, layer.consumed)
    if layer.shared is None:
        return [routed]
    shared = _stack(reader, fmt, layer.shared_prefix, SHARED, [layer.shared], layer.consumed)
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
