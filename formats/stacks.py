"""The repack-moe format (formats/SPEC.md, version :data:`FORMAT_VERSION`): expert stacks laid out for the fused
W4A16 MoE kernel.

SPEC.md beside this file is the normative description; this module is its executable form: the
constants, the stack metadata, and the two functions that move one layer's experts between the canonical int4
linears every source reader produces (formats/sources/base.py: GPTQ-packed words, scales, true zeros, g_idx) and
ours, :func:`pack_stack` and its exact inverse :func:`unpack_stack`. It knows no source format.

Layout of one stack of E experts with hidden size H, intermediate size I, ``pack = 32 / bits``:

- ``w13_qweight`` int32 ``[E, 2I, H/pack]``: row ``n < I`` is gate output ``P2[n]``, row ``I + n`` is up output
  ``P2[n]``; in the "gptq" word order field s of word r is sorted input ``k = r*pack + s``, i.e. original
  input ``P1[k]`` (the "mma128" order permutes the nibbles inside each 16-word block, see :data:`WORD_ORDERS`;
  "mma128_tiles" stores those words as ``[E, 2I/64, H/128, 64, 16]`` tiles, :func:`~.word_order.to_tiles`).
- ``w13_scales`` float16 ``[E, G1, 2I]``, ``w13_zeros`` uint8 ``[E, G1, 2I]`` (asymmetric only).
- ``w13_perm`` int32 ``[E, H]`` = P1 (act-order only): the kernel gathers activations through it.
- ``w2_qweight`` int32 ``[E, H, I/pack]`` with rows of the input sorted by P2, ``w2_scales`` float16
  ``[E, G2, H]``, ``w2_zeros`` uint8 ``[E, G2, H]`` (asymmetric only).
- ``w2_perm`` int32 ``[E, I]`` = P2 (act-order only): already folded into w13's rows, kept for the inverse.

P1/P2 are the stable sorts of ``g_idx`` so that after sorting input row k belongs to group ``k // group``.
Both qweights of a stack share its ``word_order``; version 1 checkpoints are all "gptq".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace

import torch

from .constants import (  # noqa: F401 - re-exported, so this module still names the whole format
    ACTIVATION_DTYPE_NAMES,
    CARD_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    GPTQ_ORDER,
    INDEX_FILE,
    MANIFEST_FILE,
    MMA128_BLOCK,
    MMA128_ORDER,
    MMA_ORDERS,
    QUANT_METHOD,
    ROUTED,
    SHARED,
    STACK_TENSORS,
    SUPPORTED_FORMAT_VERSIONS,
    TILE_ROWS,
    TILES_ORDER,
    WORD_ORDERS,
)
from .errors import RepackError
from .gptq import (
    GptqFormatError,
    GptqScheme,
    pack_along_rows,
    trivial_g_idx,
    unpack_along_rows,
)
from .sources.base import CanonicalLinear
from .word_order import (  # noqa: F401 - MMA128_INDEX re-exported: this module names the whole format
    MMA128_INDEX,
    from_tiles,
    from_word_order,
    to_tiles,
    to_word_order,
    transpose_from_tiles,
    transpose_from_word_order,
    transpose_to_tiles,
    transpose_to_word_order,
)

ACTIVATION_DTYPES = tuple(getattr(torch, name) for name in ACTIVATION_DTYPE_NAMES)
Expert = tuple[CanonicalLinear, CanonicalLinear, CanonicalLinear]  # (gate, up, down) of one source expert


_JSON_TYPES = {"str": str, "int": int, "bool": bool}  # StackInfo's field annotations -> the type a value must have


class StackInfoError(RepackError):
    """A ``stacks`` entry of config.json that cannot describe a stack: unknown or missing keys, or an impossible
    value. Readers prefix it with the file it came from."""


@dataclass
class StackInfo:
    """Everything needed to run a stack and to rebuild its GPTQ source tensors exactly."""

    prefix: str  # output tensor prefix, e.g. "model.layers.3.mlp.experts"
    kind: str  # ROUTED or SHARED
    num_experts: int  # experts in the stack (a shared expert split into chunks counts each chunk)
    hidden_size: int
    intermediate_size: int  # per stacked expert
    bits: int
    group_size: int
    sym: bool
    checkpoint_format: str  # the source's convention ("gptq", "gptq_v2", "awq", "pack-quantized"), for the inverse
    act_order_w13: bool
    act_order_w2: bool
    has_g_idx: bool  # the source stored g_idx tensors (the inverse writes them back only then)
    # Source module names, one triple (gate, up, down) per source expert; a shared expert split into
    # `num_experts` chunks has a single triple.
    source_modules: list[list[str]] = field(default_factory=list)
    word_order: str = GPTQ_ORDER  # nibble order of both qweights (WORD_ORDERS); absent in v1, which is all "gptq"

    def __post_init__(self) -> None:
        """Refuse a value of the wrong JSON type (``num_experts: "8"``) or a word order this stack cannot have, so a
        bad config.json fails when read, not in a kernel."""
        for item in fields(self):
            value, wanted = getattr(self, item.name), _JSON_TYPES.get(item.type)
            if wanted is not None and (not isinstance(value, wanted) or (wanted is int and isinstance(value, bool))):
                raise StackInfoError(f"stack {self.prefix!r}: {item.name} {value!r} is not a JSON {item.type}")
        if self.word_order not in WORD_ORDERS:
            raise StackInfoError(f"stack {self.prefix}: word_order {self.word_order!r} is not one of {WORD_ORDERS}")
        if self.word_order in MMA_ORDERS and not _fits_mma128(self.bits, self.hidden_size, self.intermediate_size):
            raise StackInfoError(
                f"stack {self.prefix}: word_order {self.word_order!r} needs 4 bits and H, I multiples of "
                f"{MMA128_BLOCK} (has {self.bits} bits, H={self.hidden_size}, I={self.intermediate_size})"
            )

    @property
    def scheme(self) -> GptqScheme:
        return GptqScheme(self.bits, self.group_size, self.sym, self.checkpoint_format)

    @property
    def chunks_per_source(self) -> int:
        return self.num_experts // len(self.source_modules)

    def tensor_names(self) -> list[str]:
        names = ["w13_qweight", "w13_scales", "w2_qweight", "w2_scales"]
        if not self.sym:
            names += ["w13_zeros", "w2_zeros"]
        if self.act_order_w13:
            names.append("w13_perm")
        if self.act_order_w2:
            names.append("w2_perm")
        return [f"{self.prefix}.{n}" for n in sorted(names, key=STACK_TENSORS.index)]

    def tensor_shapes(self) -> dict[str, tuple[list[int], str]]:
        """name -> (shape, dtype name) of every tensor the stack stores."""
        e, h, i, pack = self.num_experts, self.hidden_size, self.intermediate_size, 32 // self.bits
        g1, g2 = self.scheme.groups(h), self.scheme.groups(i)
        table = {
            "w13_qweight": (words_shape(self.word_order, e, 2 * i, h // pack), "int32"),
            "w13_scales": ([e, g1, 2 * i], "float16"),
            "w13_zeros": ([e, g1, 2 * i], "uint8"),
            "w13_perm": ([e, h], "int32"),
            "w2_qweight": (words_shape(self.word_order, e, h, i // pack), "int32"),
            "w2_scales": ([e, g2, h], "float16"),
            "w2_zeros": ([e, g2, h], "uint8"),
            "w2_perm": ([e, i], "int32"),
        }
        return {name: table[name.rsplit(".", 1)[1]] for name in self.tensor_names()}

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> StackInfo:
        if not isinstance(data, dict):
            raise StackInfoError(f"stack entry {data!r} is not an object")
        try:
            return cls(**data)
        except TypeError as error:  # the dataclass names the unknown or missing key
            raise StackInfoError(f"stack entry {data.get('prefix', '?')!r}: {error}") from None


def joinable(routed: StackInfo, shared: StackInfo) -> bool:
    """Whether ``shared``'s experts can extend ``routed``'s into one stack of E + C experts (SPEC.md section 5).

    True when the kernels would read both stacks the same way: same bits, group size and word order, and every
    tensor present in one is present in the other (same zeros, same act-order perms) with the same per-expert
    shape and dtype (so the same H and I). The converter then writes each shared tensor right after the routed
    one of the same name, and the runtime may view the pair as one tensor."""
    if (routed.bits, routed.group_size, routed.word_order) != (shared.bits, shared.group_size, shared.word_order):
        return False
    return _per_expert_tensors(routed) == _per_expert_tensors(shared)


def _per_expert_tensors(info: StackInfo) -> dict[str, tuple[list[int], str]]:
    """tensor kind (``w13_qweight``) -> (shape of one expert's slice, dtype name)."""
    return {name.rsplit(".", 1)[1]: (shape[1:], dtype) for name, (shape, dtype) in info.tensor_shapes().items()}


def words_shape(order: str, experts: int, rows: int, words: int) -> list[int]:
    """The stored shape of a qweight of ``experts`` x ``rows`` output rows x ``words`` words in word order ``order``:
    ``[E, rows, words]``, or for "mma128_tiles" ``[E, rows/64, words/16, 64, 16]`` (SPEC.md section 3)."""
    if order == TILES_ORDER:
        return [experts, rows // TILE_ROWS, words // 16, TILE_ROWS, 16]
    return [experts, rows, words]


def _fits_mma128(bits: int, hidden_size: int, intermediate_size: int) -> bool:
    """Whether "mma128" is defined for a stack: 4-bit words and both inputs (H of w13, I of w2) whole blocks."""
    return bits == 4 and hidden_size % MMA128_BLOCK == 0 and intermediate_size % MMA128_BLOCK == 0


def choose_word_order(bits: int, hidden_size: int, intermediate_size: int, group_size: int) -> str:
    """The word order the converter writes for a stack: "mma128_tiles" wherever "mma128" is defined and every
    128-input block lies inside one quantization group (one scale per row per block for the kernel), else "gptq"."""
    whole_groups = group_size == -1 or group_size % MMA128_BLOCK == 0
    return TILES_ORDER if _fits_mma128(bits, hidden_size, intermediate_size) and whole_groups else GPTQ_ORDER


def sort_permutation(name: str, linear: CanonicalLinear, scheme: GptqScheme) -> torch.Tensor | None:
    """The act-order permutation P (sorted row k reads original row P[k]), or None if g_idx is trivial."""
    k = linear.in_features(scheme)
    if linear.g_idx is None:
        return None
    g_idx = linear.g_idx.to(torch.int64)
    trivial = trivial_g_idx(k, scheme).to(torch.int64)
    if torch.equal(g_idx, trivial):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], trivial):
        raise GptqFormatError(
            f"{name}.g_idx: groups are not all of size {scheme.group_len(k)}, so no row order makes them "
            "contiguous; this act-order layout is not supported"
        )
    return perm.to(torch.int32)


def _identity(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int32)


def pack_stack(info: StackInfo, experts: list[Expert]) -> dict[str, torch.Tensor]:
    """GPTQ (gate, up, down) linears of each source expert -> the stack's tensors, keyed by full name.

    ``info.act_order_*`` must already say whether any expert has a non-trivial g_idx (see :func:`plan_flags`).
    A single source expert is split into ``info.num_experts`` chunks along its intermediate dimension.
    This is :func:`iter_pack_stack` with every part of a tensor concatenated.
    """
    qweights = {
        name: linear.qweight
        for names, linears in zip(info.source_modules, experts, strict=True)
        for name, linear in zip(names, linears, strict=True)
    }
    parts: dict[str, list[torch.Tensor]] = {}
    for name, part in iter_pack_stack(info, experts, qweights.__getitem__):
        parts.setdefault(name, []).append(part)
    return {name: torch.cat(chunks) for name, chunks in parts.items()}


QweightLoader = Callable[[str], torch.Tensor]


def iter_pack_stack(
    info: StackInfo, experts: list[Expert], load_qweight: QweightLoader
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(output name, part)`` in file order; the parts of one name concatenate along the expert axis.

    Streaming form of :func:`pack_stack` so a converter holds one source expert's qweights at a time:
    ``experts`` only needs real ``zeros``, ``scales`` and ``g_idx`` (small); each ``qweight`` may be a
    shape-only (meta) tensor, and ``load_qweight(module)`` is called for the real one when it is needed.
    Every permutation is validated before the first part is yielded. Without act-order the packed words
    are a transpose of the GPTQ words (no nibble unpacking); P2 alone only reorders whole w13 rows. Each
    qweight part is then put in ``info.word_order`` (a nibble shuffle inside 16-word blocks for "mma128").
    """
    scheme = info.scheme
    perms = [
        _expert_permutations(names, linears, scheme)
        for names, linears in zip(info.source_modules, experts, strict=True)
    ]
    sources = list(zip(info.source_modules, experts, perms, strict=True))
    chunks, i = info.chunks_per_source, info.intermediate_size
    wanted = {name.rsplit(".", 1)[1] for name in info.tensor_names()}
    name = lambda kind: f"{info.prefix}.{kind}"  # noqa: E731

    for (gate_name, up_name, _), _, (p1, p2) in sources:
        gate = _sorted_rows(load_qweight(gate_name), p1, scheme)
        up = _sorted_rows(load_qweight(up_name), p1, scheme)
        for chunk in range(chunks):
            yield name("w13_qweight"), _w13_qweight(gate, up, p2, chunk, i, info.word_order)
    for _, (gate, up, _), (_, p2) in sources:
        yield name("w13_scales"), _w13_columns(gate.scales, up.scales, p2, chunks, i)
    if "w13_zeros" in wanted:
        for (gate_name, up_name, _), (gate, up, _), (_, p2) in sources:
            yield name("w13_zeros"), _w13_columns(_zeros(gate_name, gate), _zeros(up_name, up), p2, chunks, i)
    if "w13_perm" in wanted:
        for _, (gate, _, _), (p1, _) in sources:
            h = gate.in_features(scheme)
            yield name("w13_perm"), (_identity(h) if p1 is None else p1).expand(chunks, h).contiguous()
    for (_, _, down_name), _, (_, p2) in sources:
        down = _sorted_rows(load_qweight(down_name), p2, scheme)
        words = down.shape[0] // chunks
        for chunk in range(chunks):  # [1, H, I/pack]: the words of one chunk, transposed (then tiled)
            rows = down[chunk * words : (chunk + 1) * words]
            yield name("w2_qweight"), _stored_words(rows, info.word_order).unsqueeze(0)
    for _, (_, _, down), _ in sources:
        yield name("w2_scales"), down.scales.reshape(chunks, -1, down.scales.shape[1])
    if "w2_zeros" in wanted:
        for (_, _, down_name), (_, _, down), _ in sources:
            zeros = _zeros(down_name, down)
            yield name("w2_zeros"), zeros.reshape(chunks, -1, zeros.shape[1])
    if "w2_perm" in wanted:
        for _, _, (_, p2) in sources:
            yield name("w2_perm"), (_identity(chunks * i) if p2 is None else p2).reshape(chunks, i)


def _zeros(name: str, linear: CanonicalLinear) -> torch.Tensor:
    if linear.zeros is None:
        raise GptqFormatError(f"{name}: an asymmetric stack needs the zero points of every linear, this one has none")
    return linear.zeros


def _expert_permutations(
    names: list[str], linears: Expert, scheme: GptqScheme
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(P1, P2) of one source expert, None where trivial; gate and up must share P1."""
    gate_name, up_name, down_name = names
    gate, up, down = linears
    p1 = sort_permutation(gate_name, gate, scheme)
    p1_up = sort_permutation(up_name, up, scheme)
    if (p1 is None) != (p1_up is None) or (p1 is not None and not torch.equal(p1, p1_up)):
        raise GptqFormatError(
            f"{gate_name} / {up_name}: gate and up have different act-order permutations; they share one "
            "input, so a merged w13 needs one order (re-quantize with the same desc_act order)"
        )
    return p1, sort_permutation(down_name, down, scheme)


def _w13_qweight(
    gate: torch.Tensor, up: torch.Tensor, p2: torch.Tensor | None, chunk: int, i: int, order: str
) -> torch.Tensor:
    """``[1, 2I, H/pack]`` of one chunk from input-sorted words: gate rows then up rows, outputs in P2 order,
    words in ``order``.

    Only whole words move (a transpose, and a column gather for P2) before the word order, so nothing is unpacked."""
    out = torch.empty(words_shape(order, 1, 2 * i, gate.shape[0]), dtype=torch.int32)
    half = i // TILE_ROWS if order == TILES_ORDER else i  # gate rows, then up rows: in bands of 64 rows when tiled
    for words, rows in ((gate, out[0, :half]), (up, out[0, half:])):
        if p2 is None:
            columns = words[:, chunk * i : (chunk + 1) * i]
        else:
            columns = torch.index_select(words, 1, p2[chunk * i : (chunk + 1) * i].long())
        _stored_words(columns, order, out=rows)
    return out


def _stored_words(words: torch.Tensor, order: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Input-major "gptq" words ``[K/pack, N]`` -> the stored words of ``order`` (into ``out`` when given): output-major
    rows ``[N, K/pack]``, or "mma128_tiles" ``[N/64, K/128, 64, 16]``, in one pass either way."""
    if order == TILES_ORDER:
        return transpose_to_tiles(words, out=out)
    return transpose_to_word_order(words, order, out=out)


def _sorted_rows(qweight: torch.Tensor, perm: torch.Tensor | None, scheme: GptqScheme) -> torch.Tensor:
    """GPTQ words with their input rows in ``perm`` order: the input order changes inside words, so
    this unpacks and repacks (only for act-order)."""
    if perm is None:
        return qweight
    return pack_along_rows(unpack_along_rows(qweight, scheme.bits)[perm.long()], scheme.bits)


def _w13_columns(gate: torch.Tensor, up: torch.Tensor, p2: torch.Tensor | None, chunks: int, i: int) -> torch.Tensor:
    """Scales or zeros ``[G1, I_total]`` of gate and up -> ``[chunks, G1, 2I]`` in w13's row order."""
    if p2 is not None:
        gate, up = gate[:, p2.long()], up[:, p2.long()]
    g = gate.shape[0]
    return (
        torch.cat([gate.reshape(g, chunks, 1, i), up.reshape(g, chunks, 1, i)], dim=2)
        .reshape(g, chunks, 2 * i)
        .transpose(0, 1)
        .contiguous()
    )


def unpack_stack(info: StackInfo, tensors: dict[str, torch.Tensor]) -> dict[str, CanonicalLinear]:
    """Exact inverse of :func:`pack_stack`: the stack's tensors -> the canonical linear of every source module, keyed
    by module name (the source's reader turns each back into its stored tensors).

    The qweights are first put back in the "gptq" word order, one expert at a time. A linear's zeros are None for a
    symmetric stack, its g_idx None unless the source stored one (``has_g_idx``)."""
    scheme, order = info.scheme, info.word_order
    get = lambda n: tensors[f"{info.prefix}.{n}"]  # noqa: E731
    # expert x's words input-major ([K/pack, N], the GPTQ layout) in the "gptq" order
    gptq_words = lambda n, x: _gptq_words(get(n)[x], order)  # noqa: E731
    h, i = info.hidden_size, info.intermediate_size
    chunks = info.chunks_per_source
    out: dict[str, CanonicalLinear] = {}
    for s, (gate_name, up_name, down_name) in enumerate(info.source_modules):
        experts = range(s * chunks, (s + 1) * chunks)
        # Without act-order on the input (P1 = identity) the GPTQ words are w13's words transposed, and
        # without it on w2's input the same holds for down: only whole words move, nothing is unpacked.
        # w13 columns: chunk c holds [gate_c | up_c]; regroup into gate and up, each [rows, I_total] sorted.
        if info.act_order_w13:
            q13 = torch.cat([unpack_along_rows(gptq_words("w13_qweight", x), scheme.bits) for x in experts], dim=1)
            rows = q13.shape[0]
            q13 = q13.view(rows, chunks, 2, i)
            q_gate, q_up = q13[:, :, 0].reshape(rows, -1), q13[:, :, 1].reshape(rows, -1)
        else:  # each chunk's gate and up words straight into their columns of the GPTQ qweights
            q_gate, q_up = _gptq_columns(get("w13_qweight"), experts, i, order)
        s13 = torch.cat([get("w13_scales")[x] for x in experts], dim=1).view(-1, chunks, 2, i)
        s_gate, s_up = s13[:, :, 0].reshape(s13.shape[0], -1), s13[:, :, 1].reshape(s13.shape[0], -1)
        if info.act_order_w2:
            q_down = torch.cat([unpack_along_rows(gptq_words("w2_qweight", x), scheme.bits) for x in experts], dim=0)
        else:
            w2 = get("w2_qweight")  # each chunk's words are rows of down's GPTQ qweight [I_total/8, H]
            words = i // (32 // info.bits)
            q_down = torch.empty((len(experts) * words, h), dtype=w2.dtype)
            for x, piece in zip(experts, q_down.split(words), strict=True):
                _gptq_words(w2[x], order, out=piece)
        s_down = torch.cat([get("w2_scales")[x] for x in experts], dim=0)
        if info.sym:
            z_gate = z_up = z_down = None
        else:
            z13 = torch.cat([get("w13_zeros")[x] for x in experts], dim=1).view(-1, chunks, 2, i)
            z_down = torch.cat([get("w2_zeros")[x] for x in experts], dim=0).contiguous()
            z_gate, z_up = z13[:, :, 0].reshape(z13.shape[0], -1), z13[:, :, 1].reshape(z13.shape[0], -1)
        p1 = get("w13_perm")[experts[0]].long() if info.act_order_w13 else _identity(h).long()
        if info.act_order_w2:
            p2 = torch.cat([get("w2_perm")[x] for x in experts]).long()
        else:
            p2 = _identity(chunks * i).long()
        inv1, inv2 = torch.argsort(p1), torch.argsort(p2)

        columns = inv2 if info.act_order_w2 else slice(None)  # the identity as a slice: a view, not a gather
        for name, q, sc, zp in ((gate_name, q_gate, s_gate, z_gate), (up_name, q_up, s_up, z_up)):
            if info.act_order_w13:
                qweight = pack_along_rows(q[inv1][:, inv2], scheme.bits)
            else:
                qweight = q[:, columns].contiguous()
            out[name] = CanonicalLinear(
                qweight=qweight,
                scales=sc[:, columns].contiguous(),
                zeros=None if zp is None else zp[:, columns].contiguous(),
                g_idx=trivial_g_idx(h, scheme)[inv1].contiguous() if info.has_g_idx else None,
            )
        if info.act_order_w2:
            q_down = pack_along_rows(q_down[inv2], scheme.bits)
        out[down_name] = CanonicalLinear(
            qweight=q_down.contiguous(),
            scales=s_down.contiguous(),
            zeros=z_down,
            g_idx=trivial_g_idx(chunks * i, scheme)[inv2].contiguous() if info.has_g_idx else None,
        )
    return out


def _gptq_words(words: torch.Tensor, order: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """One expert's stored words (rows ``[N, K/pack]``, or "mma128_tiles" ``[N/64, K/128, 64, 16]``) -> input-major
    "gptq" words ``[K/pack, N]`` (into ``out`` when given): the inverse of :func:`_stored_words`, in one pass."""
    if order == TILES_ORDER:
        return transpose_from_tiles(words, out=out)
    return transpose_from_word_order(words, order, out=out)


def _gptq_columns(w13: torch.Tensor, experts: range, i: int, order: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up GPTQ qweights ``[K/8, I_total]`` of one source expert from its chunks' w13 words ``w13[x]``
    (gate rows, then up rows, in ``order``; in bands of 64 rows when tiled), each chunk written straight into its
    columns."""
    half = i // TILE_ROWS if order == TILES_ORDER else i
    rows = w13.shape[2] * 16 if order == TILES_ORDER else w13.shape[2]  # K/8 words
    q_gate = torch.empty((rows, len(experts) * i), dtype=w13.dtype)
    q_up = torch.empty_like(q_gate)
    for c, x in enumerate(experts):
        _gptq_words(w13[x, :half], order, out=q_gate[:, c * i : (c + 1) * i])
        _gptq_words(w13[x, half:], order, out=q_up[:, c * i : (c + 1) * i])
    return q_gate, q_up


def split_by_source(info: StackInfo) -> Iterator[tuple[StackInfo, slice]]:
    """One (stack info, rows of the E axis) per source expert: what :func:`unpack_stack` needs to rebuild that
    expert alone, so a verifier holds one expert in memory instead of a whole layer."""
    chunks = info.chunks_per_source
    for s, triple in enumerate(info.source_modules):
        yield replace(info, num_experts=chunks, source_modules=[triple]), slice(s * chunks, (s + 1) * chunks)


def plan_flags(names: list[tuple[str, str, str]], experts: list[Expert], scheme: GptqScheme) -> tuple[bool, bool, bool]:
    """(act_order_w13, act_order_w2, has_g_idx) of a stack, read from the g_idx tensors themselves."""
    w13 = w2 = False
    present = [lin.g_idx is not None for triple in experts for lin in triple]
    if any(present) and not all(present):
        missing = next(name for triple_names, triple in zip(names, experts, strict=True)
                       for name, lin in zip(triple_names, triple, strict=True) if lin.g_idx is None)  # fmt: skip
        raise GptqFormatError(
            f"{missing}.g_idx: missing while other experts of the stack have one; every expert linear must store "
            "g_idx, or none (re-save the checkpoint)"
        )
    has_g_idx = all(present)
    for (gate_name, _, down_name), (gate, _, down) in zip(names, experts, strict=True):
        w13 = w13 or sort_permutation(gate_name, gate, scheme) is not None
        w2 = w2 or sort_permutation(down_name, down, scheme) is not None
    return w13, w2, has_g_idx


def stack_info(
    prefix: str,
    kind: str,
    names: list[tuple[str, str, str]],
    experts: list[Expert],
    scheme: GptqScheme,
    *,
    hidden: int,
    inter: int,
    num_experts: int | None = None,
    word_order: str | None = None,
) -> StackInfo:
    """The StackInfo of the stack made of ``experts`` (gate, up, down) named ``names``, as the converter plans it:
    act-order read from their g_idx (:func:`plan_flags`), the word order :func:`choose_word_order` picks unless
    given. ``num_experts`` counts stacked experts where a source expert is split into chunks (default: one each)."""
    act_w13, act_w2, has_g_idx = plan_flags(names, experts, scheme)
    return StackInfo(
        prefix=prefix,
        kind=kind,
        num_experts=len(names) if num_experts is None else num_experts,
        hidden_size=hidden,
        intermediate_size=inter,
        bits=scheme.bits,
        group_size=scheme.group_size,
        sym=scheme.sym,
        checkpoint_format=scheme.checkpoint_format,
        act_order_w13=act_w13,
        act_order_w2=act_w2,
        has_g_idx=has_g_idx,
        source_modules=[list(n) for n in names],
        word_order=word_order or choose_word_order(scheme.bits, hidden, inter, scheme.group_size),
    )


def dequantize_stack(info: StackInfo, tensors: dict[str, torch.Tensor], dtype=torch.float32):
    """Reference dequantization of a stack in OUR layout: (w13 [E, 2I, H] in original input order, w2 [E, H, I]).

    w2's input is in the sorted (P2) order, matching w13's output rows; w13 is returned with its input
    columns scattered back to the original order so ``x @ w13[e].T`` needs no gather.
    """
    scheme = info.scheme
    get = lambda n: tensors[f"{info.prefix}.{n}"]  # noqa: E731
    # expert x's words input-major ([K/pack, N], the GPTQ layout) in the "gptq" order
    gptq_words = lambda n, x: _gptq_words(get(n)[x], info.word_order)  # noqa: E731
    e, h, i = info.num_experts, info.hidden_size, info.intermediate_size
    glen1, glen2 = scheme.group_len(h), scheme.group_len(i)
    w13s, w2s = [], []
    for x in range(e):
        q13 = unpack_along_rows(gptq_words("w13_qweight", x), scheme.bits).to(torch.int32)  # [H, 2I] sorted rows
        q2 = unpack_along_rows(gptq_words("w2_qweight", x), scheme.bits).to(torch.int32)  # [I, H]
        g1 = torch.arange(h) // glen1
        g2 = torch.arange(i) // glen2
        z13 = (
            get("w13_zeros")[x].int() if not info.sym else torch.full_like(get("w13_scales")[x], scheme.sym_zero).int()
        )
        z2 = get("w2_zeros")[x].int() if not info.sym else torch.full_like(get("w2_scales")[x], scheme.sym_zero).int()
        w13 = get("w13_scales")[x].to(dtype)[g1] * (q13 - z13[g1]).to(dtype)  # [H sorted, 2I]
        if info.act_order_w13:
            unsorted = torch.empty_like(w13)
            unsorted[get("w13_perm")[x].long()] = w13
            w13 = unsorted
        w2 = get("w2_scales")[x].to(dtype)[g2] * (q2 - z2[g2]).to(dtype)  # [I sorted, H]
        w13s.append(w13.t())
        w2s.append(w2.t())
    return torch.stack(w13s), torch.stack(w2s)
