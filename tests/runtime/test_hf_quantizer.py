"""Plain ``AutoModelForCausalLM.from_pretrained(out)`` after ``import repack.runtime`` (issue 4, "Preferred").

transformers' own loader reads the converted checkpoint through our registered quantizer: the int4 stacks
and GPTQ linears land in buffers named like the stored tensors, untouched, and the forward runs the
Triton kernels (the interpreter on the CPU, tests/conftest.py), matching GPTQModel's reference logits.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import repack.runtime  # noqa: F401  (registers quant_method "repack" with transformers)
from repack.convert import convert
from repack.formats.errors import RepackError
from repack.runtime.integrations.transformers import RepackMoeBlock
from repack.runtime.kernels.gptq_linear import GptqW4A16Linear
from tests.support.fixtures import FIXTURES_DIR, assert_logits_match_reference

# act-order + a stacked shared expert (Qwen2-MoE), and plain g128 with q/k norms (Qwen3-MoE)
LOGIT_FIXTURES = ("qwen2moe-g32-actorder", "qwen3moe-g128-sym")
BIT_EXACT_FLOAT_SUFFIXES = ("_scales", ".scales", ".bias")  # kernel inputs: loaded without any cast
ROTARY_BUFFERS = "rotary_emb."  # inv_freq and original_inv_freq: computed by transformers, not stored


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("converted")
    outputs = {}
    for name in LOGIT_FIXTURES:
        convert(str(FIXTURES_DIR / name), str(root / name), quiet=True)
        outputs[name] = root / name
    return outputs


@pytest.fixture(scope="module")
def models(converted) -> dict[str, torch.nn.Module]:
    """Each converted fixture loaded once, the standard transformers way (no device_map: the quantizer puts
    the weights on the current GPU, or on the CPU where there is none)."""
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16) for name, path in converted.items()}


def stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (the shards of the index; the folder also holds a copied reference file)."""
    shards = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())
    out = {}
    for file in (folder / shard for shard in sorted(shards)):
        with safe_open(file, "pt") as handle:
            for name in handle.keys():
                out[name] = handle.get_tensor(name)
    return out


@pytest.mark.parametrize("name", LOGIT_FIXTURES)
def test_logits_match_gptqmodel_reference(name, models):
    model = models[name]
    assert_logits_match_reference(model, name, next(model.parameters()).device)


@pytest.mark.parametrize("name", LOGIT_FIXTURES)
def test_every_tensor_is_the_stored_one_and_nothing_is_dequantized(name, models, converted):
    """Every parameter and buffer of the model is a tensor of the file, under its stored name, dtype and
    shape (int4 stacks and GPTQ tensors bit for bit): so no weight was dequantized to a float tensor."""
    model = models[name]
    stored = stored_tensors(converted[name])
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    tensors = {key: value for key, value in tensors.items() if ROTARY_BUFFERS not in key}
    assert set(tensors) == set(stored)
    for key, expected in stored.items():
        loaded = tensors[key].detach().cpu()
        assert loaded.dtype == expected.dtype and loaded.shape == expected.shape, key
        if not expected.is_floating_point() or key.endswith(BIT_EXACT_FLOAT_SUFFIXES):
            assert torch.equal(loaded.view(torch.uint8), expected.view(torch.uint8)), key
    float_in_model = sum(t.numel() for t in tensors.values() if t.is_floating_point())
    assert float_in_model == sum(t.numel() for t in stored.values() if t.is_floating_point())
    for layer in model.model.layers:
        assert isinstance(layer.mlp, RepackMoeBlock)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert isinstance(getattr(layer.self_attn, proj), GptqW4A16Linear)


def test_greedy_generate_runs_and_starts_with_the_reference_argmax(models):
    """A few greedy steps through transformers' KV cache; causal, so the first new token after a 4-token
    prefix of the reference input is the reference's argmax at position 3."""
    name = "qwen3moe-g128-sym"
    ref = load_file(FIXTURES_DIR / name / "reference.safetensors")
    model = models[name]
    prompt = ref["input_ids"][:1, :4].to(next(model.parameters()).device)
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert tokens.shape == (1, 4 + 3)
    assert int(tokens[0, 4]) == int(ref["fp16.logits"][0, 3].argmax())


def test_import_registers_without_importing_transformers():
    code = (
        "import sys, repack.runtime\n"
        "assert 'transformers' not in sys.modules and 'triton' not in sys.modules\n"
        "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING, AUTO_QUANTIZATION_CONFIG_MAPPING\n"
        "assert AUTO_QUANTIZER_MAPPING['repack'].__name__ == 'RepackHfQuantizer'\n"
        "assert AUTO_QUANTIZATION_CONFIG_MAPPING['repack'].__name__ == 'RepackQuantConfig'\n"
        "assert 'triton' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def broken_copy(source: Path, target: Path, edit) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    edit(config["quantization_config"])
    (target / "config.json").write_text(json.dumps(config))
    return target


def load_error(path: Path) -> str:
    from transformers import AutoModelForCausalLM

    with pytest.raises(RepackError) as error:
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_unknown_format_version_is_one_line_error(converted, tmp_path):
    path = broken_copy(converted["qwen3moe-g128-sym"], tmp_path / "v99", lambda q: q.update(format_version=99))
    assert "format_version 99 is not supported" in load_error(path)


def test_stack_tensor_missing_from_shards_is_one_line_error(converted, tmp_path):
    """config.json claims an asymmetric stack: its w13_zeros must be in the shards, and is not."""

    def make_asymmetric(quant: dict) -> None:
        quant["stacks"][0]["sym"] = False

    path = broken_copy(converted["qwen3moe-g128-sym"], tmp_path / "asym", make_asymmetric)
    assert "model.layers.0.mlp.experts.w13_zeros is missing" in load_error(path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the default device_map is the GPU")
def test_cpu_without_interpreter_is_one_line_error(converted):
    """triton imported without TRITON_INTERPRET: CPU weights cannot run the kernels; say so before loading."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = (
        "import sys, triton, torch, repack.runtime\n"
        "from transformers import AutoModelForCausalLM\n"
        "from repack.formats.errors import RepackError\n"
        "try:\n"
        f"    AutoModelForCausalLM.from_pretrained({str(converted['qwen3moe-g128-sym'])!r})\n"
        "except RepackError as error:\n"
        "    print('ERROR:' + str(error)); sys.exit(3)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr[-2000:]
    message = result.stdout.strip().removeprefix("ERROR:")
    assert "TRITON_INTERPRET=1" in message and "from_pretrained" in message and "\n" not in message
