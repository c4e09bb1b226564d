"""The model card (README.md) pushed with a converted checkpoint, rendered from its manifest and config.

The card is the first thing a Hub visitor reads, so it says where the weights come from (source repo,
revision, checksums), what the format is, and how to load it. Its YAML front matter links it to the source
model as a quantized derivative (`base_model_relation: quantized`).

`library_name: repack`, not `transformers`: the Hub derives its "Use this model" snippet from the library, and a
plain transformers snippet fails on this checkpoint (transformers does not know `quant_method: "repack"`
until `import repack.runtime` registers it). The card shows the working transformers snippet itself.

The last line of every card is a marker holding the sha256 of the text above it. It lets `repack push` tell
a card it generated (safe to regenerate) from one the user edited (kept unless `--force`).
"""

from __future__ import annotations

import hashlib
import re

import yaml

CARD_TAGS = ["moe", "gptq", "int4", "repack"]
MARKER_PREFIX = "<!-- repack-card"
_MARKER_PATTERN = re.compile(r"^<!-- repack-card content-sha256=([0-9a-f]{64}) .*-->\n?\Z")


def render_model_card(
    manifest: dict,
    config: dict,
    *,
    repo_id: str,
    speed_table: str | None,
    license: str | None = None,
) -> str:
    """Render README.md for the checkpoint described by `manifest` (SPEC section 5) and `config` (section 4).

    `speed_table` is markdown measured by the user (e.g. benchmarks/RESULTS.md) and embedded verbatim;
    `license` is carried over from the source's card when known.
    """
    source = manifest.get("source") or {}
    base_model = hub_source_id(source)
    front_matter = _front_matter(base_model, license)
    sections = [
        _title(repo_id, base_model, source),
        _format_section(manifest, config),
        _source_section(manifest, source),
        _loading_section(repo_id, base_model),
    ]
    if speed_table is not None and speed_table.strip():
        sections.append("## Measured speed\n\n" + speed_table.strip() + "\n")
    body = "---\n" + front_matter + "---\n\n" + "\n".join(sections) + "\n"
    return body + _marker(body)


def hub_source_id(source: dict) -> str | None:
    """The source's Hub repo id, or None when it was converted from a local folder.

    The Hub reads `base_model` as a repo id, so a local path must never end up there.
    """
    repo_id = source.get("repo_id")
    if isinstance(repo_id, str) and re.fullmatch(r"[\w.\-]+/[\w.\-]+", repo_id):
        return repo_id
    return None


def is_generated_card(text: str) -> bool:
    """True when `text` is a card rendered by `render_model_card` and not edited since.

    A card from an older run (other speed table, other version) counts as generated, so it is regenerated;
    any edit breaks the checksum in the marker, so the user's text is never overwritten silently.
    """
    body, _, last_line = text.rstrip("\n").rpartition("\n")
    match = _MARKER_PATTERN.match(last_line)
    return match is not None and _sha256(body + "\n") == match.group(1)


def _front_matter(base_model: str | None, license: str | None) -> str:
    metadata: dict = {}
    if license:
        metadata["license"] = license
    if base_model is not None:
        metadata["base_model"] = base_model
        metadata["base_model_relation"] = "quantized"
    metadata["library_name"] = "repack"
    metadata["pipeline_tag"] = "text-generation"
    metadata["tags"] = list(CARD_TAGS)
    return yaml.safe_dump(metadata, sort_keys=False, default_flow_style=False)


def _title(repo_id: str, base_model: str | None, source: dict) -> str:
    name = repo_id.split("/")[-1]
    if base_model is not None:
        origin = f"[{base_model}](https://huggingface.co/{base_model})"
    else:
        origin = f"a local GPTQ checkpoint (`{source.get('path') or source.get('repo_id') or 'unknown'}`)"
    return (
        f"# {name}\n\n"
        f"{origin}, converted losslessly by [moe-repack](https://pypi.org/project/moe-repack/) into the "
        "repack-moe layout: the int4 GPTQ experts of every MoE layer are stacked, gate and up merged, and "
        "packed in the order the fused Triton W4A16 MoE kernel reads them. Every other tensor is the source's, "
        "byte for byte, and `repack verify` rebuilds the source GPTQ tensors bit for bit.\n"
    )


def _format_section(manifest: dict, config: dict) -> str:
    quant = config.get("quantization_config") or {}
    stacks = quant.get("stacks") or []
    routed = [stack for stack in stacks if stack.get("kind") == "routed"]
    shared = [stack for stack in stacks if stack.get("kind") == "shared"]
    rows = [
        ("format", f"{manifest.get('format', quant.get('format'))} v{manifest.get('format_version')}"),
        ("converter", f"moe-repack {manifest.get('converter_version', 'unknown')}"),
        ("architecture", ", ".join(config.get("architectures") or [config.get("model_type", "unknown")])),
        ("quantization", _scheme_text(quant)),
        ("MoE layers", str(len(routed))),
    ]
    if routed:
        first = routed[0]
        rows.append(
            (
                "routed experts",
                f"{first.get('num_experts')} per layer, hidden {first.get('hidden_size')}, "
                f"intermediate {first.get('intermediate_size')}",
            )
        )
    if shared:
        rows.append(("shared expert", f"stored as {shared[0].get('num_experts')} routed-size chunk(s)"))
    act_order = any(stack.get("act_order_w13") or stack.get("act_order_w2") for stack in stacks)
    rows.append(("act-order", "resolved at conversion" if act_order else "no"))
    if manifest.get("created"):
        rows.append(("converted", str(manifest["created"])))
    table = "| | |\n|---|---|\n" + "".join(f"| {key} | {value} |\n" for key, value in rows)
    return "## Format\n\n" + table


def _scheme_text(quant: dict) -> str:
    group = quant.get("group_size")
    group_text = "per channel" if group == -1 else f"group size {group}"
    symmetry = "symmetric" if quant.get("sym", True) else "asymmetric"
    return f"GPTQ int{quant.get('bits', 4)}, {group_text}, {symmetry}, fp16 scales"


def _source_section(manifest: dict, source: dict) -> str:
    repo_id = hub_source_id(source)
    lines = ["## Source\n"]
    if repo_id is not None:
        lines.append(f"- repo: [{repo_id}](https://huggingface.co/{repo_id})")
    else:
        lines.append(f"- local folder: `{source.get('path') or source.get('repo_id') or 'unknown'}`")
    lines.append(f"- revision: `{source.get('revision') or 'not recorded (local folder)'}`")
    source_files = manifest.get("source_files") or {}
    lines.append(
        f"- sha256 of the {len(source_files)} source files, also in `repack_manifest.json` together with the "
        "checksums of every file of this repo:\n"
    )
    lines.append("<details>\n<summary>source file checksums</summary>\n")
    lines.append("| file | size (bytes) | sha256 |\n|---|---:|---|")
    for name in sorted(source_files):
        entry = source_files[name]
        lines.append(f"| `{name}` | {entry.get('size', '')} | `{entry.get('sha256', '')}` |")
    lines.append("\n</details>\n")
    return "\n".join(lines) + "\n"


def _loading_section(repo_id: str, base_model: str | None) -> str:
    source_argument = base_model or "<the source GPTQ folder>"
    return (
        "## How to load\n\n"
        "`pip install moe-repack`, then run the MoE blocks with the fused kernel directly:\n\n"
        "```python\n"
        "from huggingface_hub import snapshot_download\n"
        "from repack.runtime import load\n\n"
        f'ckpt = load(snapshot_download("{repo_id}"), device="cuda")\n'
        "block = ckpt.moe_block(ckpt.moe_layers[0])  # nn.Module: [tokens, hidden] -> [tokens, hidden]\n"
        "```\n\n"
        "or through transformers, once `import repack.runtime` has registered the `repack` quantization "
        "method:\n\n"
        "```python\n"
        "import repack.runtime  # noqa: F401  (registers quant_method 'repack' with transformers)\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f'model = AutoModelForCausalLM.from_pretrained("{repo_id}", device_map="cuda")\n'
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")\n'
        'inputs = tokenizer("The capital of France is", return_tensors="pt").to(model.device)\n'
        "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=16)[0]))\n"
        "```\n\n"
        "Check a download bit for bit against the source: "
        f"`repack verify <downloaded folder> --source {source_argument}`.\n"
    )


def _marker(body: str) -> str:
    return (
        f"{MARKER_PREFIX} content-sha256={_sha256(body)} generated by `repack push`; "
        "delete this line to keep your edits -->\n"
    )


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
