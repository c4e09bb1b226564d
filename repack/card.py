"""The model card (README.md) pushed with a converted checkpoint, built with huggingface_hub's ``ModelCard``.

The card is the first thing a Hub visitor reads, so it says where the weights come from (source repo, revision,
checksums), what the format is, and how to load it. Its metadata links it to the model it quantizes
(``base_model`` with ``base_model_relation: quantized``) and keeps the source card's license, language and tags.

`library_name: repack`, not `transformers`: the Hub derives its "Use this model" snippet from the library, and a
plain transformers snippet fails on this checkpoint (transformers does not know `quant_method: "repack"` until
`import repack.runtime` registers it). The card shows the working transformers snippet itself.

Everything that comes from the source (architecture names, file names, versions) is untrusted text: it is
escaped so it can add no heading, link or HTML to the card. Local paths never appear in it.

The last line of every card is a marker holding the sha256 of the text above it. It lets `repack push` tell a card
it generated (safe to regenerate) from one the user edited (kept unless `--force`).
"""

from __future__ import annotations

import hashlib
import html
import re

from huggingface_hub import ModelCard, ModelCardData

from repack import SOURCE_URL
from repack.display import architecture_names
from repack.formats.constants import FORMAT_NAME, MANIFEST_FILE
from repack.formats.errors import printable
from repack.formats.hub import is_repo_id
from repack.formats.manifest import Manifest
from repack.model_files import SOURCE_README

CARD_TAGS = ["moe", "int4", "repack"]  # and the source format's tag (SOURCE_FORMAT_NAMES)
# How the card names each source format (config.json quantization_config.source_format), and its Hub tag.
SOURCE_FORMAT_NAMES = {
    "gptq": ("GPTQ", "gptq"),
    "awq": ("AWQ", "awq"),
    "compressed-tensors": ("compressed-tensors", "compressed-tensors"),
}
SOURCE_CARD_FIELDS = ("license", "license_name", "license_link", "language")  # carried over from the source's card
MARKER_PREFIX = "<!-- repack-card"
_MARKER_PATTERN = re.compile(r"^<!-- repack-card content-sha256=([0-9a-f]{64}) .*-->\n?\Z")
_MARKDOWN_SPECIALS = re.compile(r"([\\`*_\[\]()#!|~<>])")  # what could start markup inside a line or table cell
_AUTOLINK = re.compile(r"://|www\.|@", re.IGNORECASE)  # what GFM's autolink extension starts a link at
_LINKISH = re.compile(r"://|www\.|@|/|:", re.IGNORECASE)  # in a name: a link, a path or a scheme, never a class


def install_command() -> str:
    """How someone who has only the card installs this tool: pip, straight from the project's source repository
    (moe-repack is not on PyPI), with the transformers extra."""
    return f"pip install 'moe-repack[hf] @ git+{SOURCE_URL}'"


def render_model_card(
    manifest: Manifest,
    config: dict,
    *,
    repo_id: str,
    speed_table: str | None,
    source_card: dict | None = None,
    base_model: str | None = None,
) -> str:
    """README.md for the checkpoint described by ``manifest`` (SPEC section 5) and ``config`` (section 4).

    ``speed_table`` is markdown measured by the user (e.g. benchmarks/RESULTS.md) and embedded verbatim;
    ``source_card`` is the source card's metadata; ``base_model`` overrides the one the manifest records.
    """
    base = base_model or card_base_model(manifest)
    source_format = source_format_name(config)
    data = _card_data(base, source_card or {}, source_format[1])
    sections = [
        _title(repo_id, base, manifest, source_format[0]),
        _format_section(manifest, config),
        _source_section(manifest),
        _loading_section(repo_id, manifest),
    ]
    if speed_table is not None and speed_table.strip():
        sections.append("## Measured speed\n\n" + speed_table.strip() + "\n")
    card = ModelCard("---\n" + data.to_yaml() + "\n---\n\n" + "\n".join(sections) + "\n")
    body = str(card)
    return body + _marker(body)


def card_base_model(manifest: Manifest) -> str | None:
    """The Hub id the card names as ``base_model``: the one the manifest records, else the Hub source itself.

    The Hub reads ``base_model`` as a repo id, so anything that is not a valid one (a local path) is dropped."""
    for candidate in (manifest.source.base_model, manifest.source.repo_id):
        if is_repo_id(candidate):
            return candidate
    return None


def is_generated_card(text: str) -> bool:
    """True when ``text`` is a card rendered by :func:`render_model_card` and not edited since.

    A card from an older run (other speed table, other version) counts as generated, so it is regenerated;
    any edit breaks the checksum in the marker, so the user's text is never overwritten silently.
    """
    body, _, last_line = text.rstrip("\n").rpartition("\n")
    match = _MARKER_PATTERN.match(last_line)
    return match is not None and _sha256(body + "\n") == match.group(1)


def escape_text(value: object) -> str:
    """Untrusted text as inert markdown: HTML escaped, markdown punctuation backslashed, on one line, and no bare URL
    or e-mail address left for the Hub's renderer to turn into a link (GFM autolinks ``https://``, ``www.``, ``@``)."""
    text = printable(" ".join(str(value).split()))  # a file name's undecodable bytes as \udcff, not a crash
    escaped = _MARKDOWN_SPECIALS.sub(r"\\\1", html.escape(text, quote=False))
    # a backslash before punctuation is markdown's escape: it renders as the character alone, and no link starts
    return _AUTOLINK.sub(lambda match: re.sub(r"([:/.@])", r"\\\1", match[0]), escaped)


def source_format_name(config: dict) -> tuple[str, str]:
    """(display name, Hub tag) of the format the checkpoint was converted from (GPTQ for older checkpoints)."""
    name = (config.get("quantization_config") or {}).get("source_format") or "gptq"
    return SOURCE_FORMAT_NAMES.get(name, (escape_text(name), "int4"))


def _card_data(base_model: str | None, source_card: dict, format_tag: str) -> ModelCardData:
    fields = {key: source_card[key] for key in SOURCE_CARD_FIELDS if source_card.get(key)}
    source_tags = source_card.get("tags") if isinstance(source_card.get("tags"), list) else []
    tags = list(dict.fromkeys([*(str(tag) for tag in source_tags), *CARD_TAGS[:1], format_tag, *CARD_TAGS[1:]]))
    relation = {"base_model_relation": "quantized"} if base_model else {}
    return ModelCardData(
        base_model=base_model,
        library_name="repack",
        pipeline_tag="text-generation",
        tags=tags,
        **fields,
        **relation,
    )


def _hub_link(repo_id: str) -> str:
    return f"[{repo_id}](https://huggingface.co/{repo_id})"  # a valid repo id has no markdown specials to escape


def _title(repo_id: str, base_model: str | None, manifest: Manifest, source_format: str) -> str:
    name = escape_text(repo_id.split("/")[-1])
    source_id = manifest.source.repo_id if is_repo_id(manifest.source.repo_id) else None
    if source_id is not None:
        origin = f"The {source_format} checkpoint {_hub_link(source_id)}"
    elif base_model is not None:
        origin = f"A local {source_format} checkpoint of {_hub_link(base_model)}"
    else:
        origin = f"A local {source_format} checkpoint"
    others = (
        "Every other tensor is the source's, byte for byte"
        if source_format == "GPTQ"
        else "Its other quantized linears are stored as GPTQ tensors, every float tensor is the source's byte for byte"
    )
    return (
        f"# {name}\n\n"
        f"{origin}, converted losslessly by moe-repack into the {FORMAT_NAME} layout: the int4 "
        "experts of every MoE layer are stacked, gate and up merged, and packed in the order the fused Triton W4A16 "
        f"MoE kernel reads them. {others}, and `repack verify` rebuilds the source {source_format} tensors bit for "
        "bit.\n"
    )


def _card_architectures(config: dict) -> list[str]:
    """config.json's ``architectures`` as the card shows them (repack.display), less anything that reads as a link
    (a URL or an e-mail address: a transformers architecture is a class name), which is left out, not shown."""
    names = [name for name in architecture_names(config) if not _LINKISH.search(name)]
    model_type = config.get("model_type")
    return names or [model_type if isinstance(model_type, str) and not _LINKISH.search(model_type) else "unknown"]


def _format_section(manifest: Manifest, config: dict) -> str:
    quant = config.get("quantization_config") or {}
    stacks = [stack for stack in quant.get("stacks") or [] if isinstance(stack, dict)]
    routed = [stack for stack in stacks if stack.get("kind") == "routed"]
    shared = [stack for stack in stacks if stack.get("kind") == "shared"]
    architectures = _card_architectures(config)
    rows = [
        ("format", f"{FORMAT_NAME} v{manifest.format_version}"),
        ("converter", f"moe-repack {escape_text(manifest.converter_version)}"),
        ("architecture", ", ".join(escape_text(name) for name in architectures)),
        ("quantization", _scheme_text(quant, source_format_name(config)[0])),
        ("MoE layers", str(len(routed))),
    ]
    if routed:
        first = routed[0]
        sizes = (first.get("num_experts"), first.get("hidden_size"), first.get("intermediate_size"))
        rows.append(("routed experts", "{} per layer, hidden {}, intermediate {}".format(*map(escape_text, sizes))))
    if shared:
        rows.append(("shared expert", f"stored as {escape_text(shared[0].get('num_experts'))} routed-size chunk(s)"))
    act_order = any(stack.get("act_order_w13") or stack.get("act_order_w2") for stack in stacks)
    rows.append(("act-order", "resolved at conversion" if act_order else "no"))
    if manifest.created:
        rows.append(("converted", escape_text(manifest.created)))
    table = "| | |\n|---|---|\n" + "".join(f"| {key} | {value} |\n" for key, value in rows)
    return "## Format\n\n" + table


def _scheme_text(quant: dict, source_format: str) -> str:
    group = quant.get("group_size")
    group_text = "per channel" if group == -1 else f"group size {escape_text(group)}"
    symmetry = "symmetric" if quant.get("sym", True) else "asymmetric"
    return f"{source_format} int{escape_text(quant.get('bits', 4))}, {group_text}, {symmetry}, fp16 scales"


def _source_section(manifest: Manifest) -> str:
    source = manifest.source
    lines = ["## Source\n"]
    if is_repo_id(source.repo_id):
        lines.append(f"- repo: {_hub_link(source.repo_id)}")
        lines.append(f"- revision: `{escape_text(source.revision)}`" if source.revision else "- revision: not recorded")
    else:
        lines.append("- a local folder (its path is not published)")
    if SOURCE_README in manifest.output_files:
        lines.append(f"- the source's own model card: [{SOURCE_README}]({SOURCE_README})")
    lines.append(
        f"- sha256 of the {len(manifest.source_files)} source files, also in `{MANIFEST_FILE}` together with the "
        "checksums of every file of this repo:\n"
    )
    lines.append("<details>\n<summary>source file checksums</summary>\n")
    lines.append("| file | size (bytes) | sha256 |\n|---|---:|---|")
    for name in sorted(manifest.source_files):
        record = manifest.source_files[name]
        lines.append(f"| {escape_text(name)} | {record.size} | `{record.sha256}` |")
    lines.append("\n</details>\n")
    return "\n".join(lines) + "\n"


def _loading_section(repo_id: str, manifest: Manifest) -> str:
    source_id = manifest.source.repo_id if is_repo_id(manifest.source.repo_id) else "<the source GPTQ folder>"
    return (
        "## How to load\n\n"
        f"Install [moe-repack]({SOURCE_URL}) (this checkpoint was written by its version "
        f"{escape_text(manifest.converter_version)}) with the transformers extra: `{install_command()}`. Then run the "
        "MoE blocks with the "
        "fused kernel directly (on a GPU; without one, in Triton's interpreter, slowly):\n\n"
        "```python\n"
        "import torch\n"
        "from huggingface_hub import snapshot_download\n"
        "from repack.runtime import load\n\n"
        'device = "cuda" if torch.cuda.is_available() else "cpu"\n'
        f'ckpt = load(snapshot_download("{repo_id}"), device=device)\n'
        "block = ckpt.moe_block(ckpt.moe_layers[0])  # nn.Module: [tokens, hidden] -> [tokens, hidden]\n"
        "```\n\n"
        "or through plain transformers: installing moe-repack registers its `repack` quantization method with "
        "transformers in every Python of that environment (the weights go to the GPU, or stay on the CPU when there "
        "is none; without moe-repack, transformers does not know this format and must not be used on it):\n\n"
        "```python\n"
        "import torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f'model = AutoModelForCausalLM.from_pretrained("{repo_id}", dtype=torch.float16)\n'
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")\n'
        'inputs = tokenizer("The capital of France is", return_tensors="pt").to(model.device)\n'
        "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=16)[0]))\n"
        "```\n\n"
        "Check a download bit for bit against the source: "
        f"`repack verify <downloaded folder> --source {source_id}`.\n"
    )


def _marker(body: str) -> str:
    return (
        f"{MARKER_PREFIX} content-sha256={_sha256(body)} generated by `repack push`; "
        "delete this line to keep your edits -->\n"
    )


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
