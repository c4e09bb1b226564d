"""Load a repack-moe checkpoint onto a device exactly as stored: bytes in, views out.

Why this shape: the converter already wrote every tensor in the layout the kernels consume, so loading must
not touch the data. Each shard's data region is read once into (pinned) host memory and copied to one
device buffer; every tensor is then a dtype/shape view of that buffer at its file offset. No repack, no
permute, no cat, no dtype change: the bytes on the device are the file's bytes, which the tests check.
On a GPU the read of the next chunk overlaps the host-to-device copy of the previous one, so the load runs
at the speed of reading the files.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from repack.formats.checkpoint import (
    CONFIG_FILE,
    CheckpointReader,
    TensorEntry,
    parse_repack_quant_config,
)
from repack.formats.config_files import read_config_record
from repack.formats.constants import MANIFEST_FILE
from repack.formats.errors import RepackError
from repack.formats.families import SHARED_EXPERT_MODULES
from repack.formats.hub import download_snapshot, looks_like_repo_id
from repack.formats.integrity import check_output_files, check_structure
from repack.formats.manifest import Manifest
from repack.formats.stacks import ACTIVATION_DTYPES, ROUTED, SHARED, StackInfo
from repack.runtime.kernels.backend import check_kernel_backend
from repack.runtime.moe_block import MoeBlock, block_prefix, resolve_shared_mode
from repack.runtime.routers import router_spec
from repack.runtime.weights import MoeWeights, join_adjacent

STAGING_CHUNK_BYTES = 256 << 20  # per pinned staging buffer; two of them alternate
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# ------------------------------------------------------------------------------------------- safetensors


@dataclass(frozen=True)
class ShardRegion:
    """The bytes of one shard the loader reads: from its first tensor to the end of its last, in one piece.

    The tensors come from the format's reader (``formats.checkpoint.TensorEntry``, absolute file offsets): the
    headers are parsed once, there, and the region is read through the same descriptor (``fd``), so its bytes are
    those of the file whose header was checked. The header is bytes ``0 .. start`` of the file (the spec's tiling,
    which the reader checks, puts the first tensor right after it)."""

    path: Path
    start: int  # absolute file offset of the first tensor's data
    nbytes: int
    entries: tuple[TensorEntry, ...]
    fd: int  # the reader's descriptor of the file (formats.checkpoint.CheckpointReader.fd)


def shard_regions(reader: CheckpointReader) -> list[ShardRegion]:
    """One region per shard that holds tensors, in the reader's file order."""
    by_file: dict[str, list[TensorEntry]] = {}
    for entry in reader.entries.values():
        by_file.setdefault(entry.file, []).append(entry)
    regions = []
    for file in reader.files:
        entries = by_file.get(file)
        if not entries:
            continue
        start = min(entry.offset for entry in entries)
        end = max(entry.offset + entry.nbytes for entry in entries)
        regions.append(ShardRegion(reader.folder / file, start, end - start, tuple(entries), reader.fd(file)))
    return regions


def _pread_into(fd: int, target: memoryview, offset: int, file: Path) -> None:
    """Fill ``target`` from ``fd`` at ``offset``; preadv may return short counts, so loop until full."""
    done = 0
    while done < len(target):
        got = os.preadv(fd, [target[done:]], offset + done)
        if not got:
            raise RepackError(f"{file}: file ended early while reading (truncated?); re-download or re-convert")
        done += got


class HostStaging:
    """Two pinned host buffers used in turn: the disk fills one while the GPU copies out of the other."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.ready: list[torch.cuda.Event | None] = [None, None]

    def copy_file_to(self, region: ShardRegion, target: torch.Tensor, digest=None) -> None:
        """Stream the region's bytes into the device tensor ``target`` (hashing them into ``digest``, if given)."""
        total = target.numel()
        for step, offset in enumerate(range(0, total, self.chunk_bytes)):
            slot = step % 2
            if self.ready[slot] is not None:
                self.ready[slot].synchronize()  # the copy out of this buffer has finished
            size = min(self.chunk_bytes, total - offset)
            staging = self.buffers[slot][:size]
            view = memoryview(staging.numpy())
            _pread_into(region.fd, view, region.start + offset, region.path)
            if digest is not None:
                digest.update(view)
            target[offset : offset + size].copy_(staging, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.ready[slot] = event


def read_shard_bytes(
    region: ShardRegion, device: torch.device, staging: HostStaging | None, digest=None
) -> torch.Tensor:
    """The region's bytes as one uint8 tensor on ``device`` (one buffer, filled by plain copies); with ``digest``
    (a sha256 fed the file's header already) every byte read is hashed on the way."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(region.fd, region.start, region.nbytes, os.POSIX_FADV_SEQUENTIAL)
    if device.type == "cpu":
        buffer = torch.empty(region.nbytes, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        _pread_into(region.fd, view, region.start, region.path)
        if digest is not None:
            digest.update(view)
        return buffer
    buffer = torch.empty(region.nbytes, dtype=torch.uint8, device=device)
    staging.copy_file_to(region, buffer, digest)
    return buffer


def tensor_view(buffer: torch.Tensor, begin: int, entry: TensorEntry) -> torch.Tensor:
    """The tensor ``entry``, whose bytes start at ``begin`` in its shard's byte buffer, as a view: same storage,
    same bytes.

    safetensors writers align every tensor to its element size; a file that does not (hand-made) costs one
    copy of that tensor's bytes, still bit for bit.
    """
    dtype = entry.torch_dtype
    raw = buffer[begin : begin + entry.nbytes]
    if begin % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).view(entry.shape)


def load_tensors(
    reader: CheckpointReader, device: torch.device, chunk_bytes: int, hashes: Manifest | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of every shard, on ``device``, as views of one byte buffer per shard.

    The shards and their headers come from the format's reader (index, missing or truncated shards checked), each
    read through the descriptor its header was parsed from. With ``hashes`` (a manifest), every shard's sha256 is
    computed from the bytes as they are loaded (its header, then its data region: the whole file) and must be the
    manifest's: one read of the checkpoint, not a hashing pass and then a loading one.
    """
    regions = shard_regions(reader)
    staging = None
    if device.type != "cpu":
        largest = max((region.nbytes for region in regions), default=0)
        staging = HostStaging(max(1, min(chunk_bytes, largest)))
    tensors: dict[str, torch.Tensor] = {}
    for region in regions:
        digest = None
        if hashes is not None:
            header = bytearray(region.start)
            _pread_into(region.fd, memoryview(header), 0, region.path)
            digest = hashlib.sha256(header)
        buffer = read_shard_bytes(region, device, staging, digest)
        if digest is not None and digest.hexdigest() != hashes.output_files[region.path.name].sha256:
            raise RepackError(
                f"{region.path}: sha256 differs from {MANIFEST_FILE} (the output file changed or is corrupt); re-run "
                "`repack convert`"
            )
        for entry in region.entries:
            tensors[entry.name] = tensor_view(buffer, entry.offset - region.start, entry)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return tensors


# -------------------------------------------------------------------------------------------- checkpoint


def layer_of(prefix: str) -> int:
    """Decoder layer index in a tensor prefix such as ``model.layers.3.mlp.experts``."""
    match = _LAYER_INDEX.search(prefix)
    if match is None:
        raise RepackError(f"stack prefix {prefix!r} names no decoder layer (`layers.N.`); re-run `repack convert`")
    return int(match.group(1))


@dataclass
class RepackCheckpoint:
    """A loaded repack-moe checkpoint: its config, its stacks and every tensor, on one device."""

    path: Path
    config: dict
    stacks: list[StackInfo]
    tensors: dict[str, torch.Tensor]
    device: torch.device
    dtype: torch.dtype  # activation dtype the MoE blocks are built for
    shared_mode: str | None = None  # how moe_block runs a shared expert (MoeBlock's shared_mode; None: the default)
    _blocks: dict[tuple[int, str], MoeBlock] = field(default_factory=dict, repr=False)

    @property
    def text_config(self) -> dict:
        """The language model's config (multimodal configs nest it under ``text_config``)."""
        text = self.config.get("text_config", self.config)
        if not isinstance(text, dict):
            raise RepackError(f"{self.path}/config.json: text_config is not an object; fix config.json")
        return text

    @property
    def num_layers(self) -> int:
        return int(self.text_config["num_hidden_layers"])

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the decoder layers that have a sparse-MoE block, ascending."""
        return sorted({layer_of(info.prefix) for info in self.stacks if info.kind == ROUTED})

    def stack_info(self, layer: int, kind: str = ROUTED) -> StackInfo | None:
        """The layer's stack of ``kind`` (ROUTED or SHARED), or None if the layer has none."""
        for info in self.stacks:
            if info.kind == kind and layer_of(info.prefix) == layer:
                return info
        return None

    def moe_weights(self, layer: int, kind: str = ROUTED) -> MoeWeights | None:
        """The kernel-facing tensors of a layer's stack (views, nothing copied), or None if absent."""
        info = self.stack_info(layer, kind)
        if info is None:
            return None
        missing = [name for name in info.tensor_names() if name not in self.tensors]
        if missing:
            raise RepackError(f"{self.path}: tensor {missing[0]} is missing from the shards; re-run `repack convert`")
        return MoeWeights.from_tensors(info, self.tensors)

    def joined_moe_weights(self, layer: int) -> MoeWeights | None:
        """The layer's routed experts and shared chunks as one stack of E + C experts, or None.

        Views of the loaded shards (``runtime.weights.join_adjacent``): available when the converter wrote each
        shared tensor right after its routed twin (formats/SPEC.md section 5) and the load kept them in one
        buffer; None for a layer without a stacked shared expert, older checkpoints and stacks it could not join.
        Run it with ``fused_moe`` and ids ``[top-k routed ids, E .. E + C - 1]`` per token.
        """
        routed, shared = self.moe_weights(layer, ROUTED), self.moe_weights(layer, SHARED)
        if routed is None or shared is None:
            return None
        return join_adjacent(routed, shared)

    def moe_block(self, layer: int, shared_mode: str | None = None) -> MoeBlock:
        """The whole sparse-MoE block of decoder layer ``layer`` as a torch module (built once per mode, cached).

        ``shared_mode`` overrides the checkpoint's (``load(..., shared_mode=)``) for this block."""
        mode = resolve_shared_mode(shared_mode if shared_mode is not None else self.shared_mode)
        if (layer, mode) not in self._blocks:
            if self.stack_info(layer, ROUTED) is None:
                raise RepackError(
                    f"{self.path}: layer {layer} has no sparse-MoE block; MoE layers are {self.moe_layers}"
                )
            self._blocks[(layer, mode)] = self._build_block(layer, mode)
        return self._blocks[(layer, mode)]

    def _build_block(self, layer: int, shared_mode: str) -> MoeBlock:
        """A layer's stacks and router tensors as a MoeBlock (views, nothing copied)."""
        routed, shared = self.stack_info(layer, ROUTED), self.stack_info(layer, SHARED)
        block = block_prefix(routed.prefix)
        if shared is None:
            float_shared = [
                n for n in self.tensors if n.startswith(tuple(f"{block}.{m}." for m in SHARED_EXPERT_MODULES))
            ]
            if float_shared:  # SPEC section 2: a float shared expert is copied through and gets no stack
                raise RepackError(
                    f"{self.path}: layer {layer}'s shared expert is stored in float ({float_shared[0]}), which "
                    "moe_block does not run; use repack.runtime.load_hf_model, which runs it"
                )
        spec = router_spec(self.text_config)
        return MoeBlock.from_tensors(
            self.tensors, routed, shared, spec, block=block, where=str(self.path), shared_mode=shared_mode
        )


def load(
    path: str | os.PathLike,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.float16,
    *,
    chunk_bytes: int = STAGING_CHUNK_BYTES,
    shared_mode: str | None = None,
    revision: str | None = None,
    verify: bool = False,
) -> RepackCheckpoint:
    """Load a repack-moe checkpoint (a folder, or a Hub id ``org/name``) onto ``device``, every tensor as stored.

    A Hub id is fetched as ``from_pretrained`` does (the local cache first; ``revision`` picks a branch, tag or
    commit; ``HF_HUB_OFFLINE=1`` uses only the cache). ``dtype`` is the activation dtype (float16 or bfloat16) of
    the blocks that ``moe_block`` builds; the stored tensors keep their own dtypes. ``chunk_bytes`` is the size of
    each pinned staging buffer (GPU). ``shared_mode`` is how those blocks run a stacked shared expert: "joined"
    (one fused_moe call with the routed experts, where the files allow it) or "separate" (a second call); None
    takes ``runtime.moe_block.DEFAULT_SHARED_MODE``.

    Always checked against the manifest, at no cost in reading (``formats.integrity.check_structure``): config.json
    and the index byte for byte, every shard's size and header, and one conversion id in all of them, so a
    truncated or edited file, or a folder replaced while loading, is refused rather than loaded. ``verify=True``
    also hashes every data byte (as it is loaded: the checkpoint is still read once) and every other file.
    """
    folder = resolve_checkpoint_folder(path, revision)
    if dtype not in ACTIVATION_DTYPES:
        raise RepackError(f"load: dtype {dtype} is not supported for activations; use torch.float16 or torch.bfloat16")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise RepackError(f"load: device {device} is not supported; use 'cuda' (or 'cpu' for tests)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RepackError(
            f"load: device {device} requested but no CUDA GPU is available; the kernels need one (device='cpu' "
            "runs them only in the Triton interpreter, for tests: set TRITON_INTERPRET=1 before importing torch)"
        )
    check_kernel_backend(device, "load")  # on the CPU: the interpreter, or one clear error now
    shared_mode = resolve_shared_mode(shared_mode)  # a wrong mode fails here, not at the first block
    config, config_record = read_config_record(folder)
    stacks = parse_repack_quant_config(config.get("quantization_config") or {}, str(folder / CONFIG_FILE))
    manifest = Manifest.read(folder)
    with CheckpointReader(folder) as reader:
        check_structure(folder, manifest, config, config_record, reader)
        if verify:  # the shards that hold tensors are hashed as they are loaded; the other files here
            check_output_files(folder, manifest, skip={entry.file for entry in reader.entries.values()})
        tensors = load_tensors(reader, device, chunk_bytes, manifest if verify else None)
    return RepackCheckpoint(folder, config, stacks, tensors, device, dtype, shared_mode)


def resolve_checkpoint_folder(path: str | os.PathLike, revision: str | None) -> Path:
    """A local folder as is; otherwise a Hub id's snapshot folder (formats.hub); one clear error for anything else."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        if revision is not None:
            raise RepackError(f"load: {folder} is a local folder; revision= only applies to Hub ids")
        return folder
    if folder.exists():
        raise RepackError(f"{folder}: not a folder; pass the output folder of `repack convert` or a Hub id")
    if looks_like_repo_id(str(path)):
        return download_snapshot(str(path), revision)
    raise RepackError(
        f"{folder}: no such folder (and not a Hub id org/name); pass the output folder of `repack convert`"
    )


__all__ = ["RepackCheckpoint", "load", "SHARED", "ROUTED"]
