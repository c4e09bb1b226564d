"""transformers drop-in: converted fixtures load as *ForCausalLM and match GPTQModel's reference logits.

On the CPU every kernel runs in the Triton interpreter (tests/conftest.py), so the forward passes are
few and small: one reference forward per fixture and one short greedy ``generate``.
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
from safetensors.torch import load_file

from repack.convert import convert
from repack.formats.errors import RepackError
from repack.runtime.integrations.transformers import RepackMoeBlock, load_hf_model
from repack.runtime.kernels.gptq_linear import GptqW4A16Linear
from tests.support.fixtures import FIXTURES, FIXTURES_DIR, assert_logits_match_reference
from tests.support.manifests import restamp

GENERATE_FIXTURE = "qwen3moe-g128-sym"  # no shared expert: half the kernel launches of qwen2
LAYER_TYPES_FIXTURE = "qwen2moe-g128-sym"  # its config.json lists layer_types, which transformers validates


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    """Each fixture converted once for the whole module."""
    root = tmp_path_factory.mktemp("converted")
    outputs = {}
    for source in FIXTURES:
        out = root / source.name
        convert(str(source), str(out), quiet=True)
        outputs[source.name] = out
    return outputs


def reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES_DIR / name / "reference.safetensors")


@pytest.mark.parametrize("name", [path.name for path in FIXTURES])
def test_logits_match_gptqmodel_reference(name, converted, device):
    model = load_hf_model(converted[name], device=device, dtype=torch.float16)
    assert_logits_match_reference(model, name, device)


@pytest.mark.parametrize("name", [path.name for path in FIXTURES])
def test_quantized_layers_stay_int4(name, converted, device):
    """Every MoE block runs on the runtime and every attention linear reads int4 tensors: no fp16 weights."""
    model = load_hf_model(converted[name], device=device, dtype=torch.float16)
    layers = model.model.layers
    assert all(isinstance(layer.mlp, RepackMoeBlock) for layer in layers)
    for layer in layers:
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            linear = getattr(layer.self_attn, proj)
            assert isinstance(linear, GptqW4A16Linear)
            assert linear.qweight.dtype == torch.int32 and linear.qweight.device.type == device
    config = json.loads((converted[name] / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    layer_norms = 2 * hidden + (2 * config["head_dim"] if config["model_type"] == "qwen3_moe" else 0)  # q/k norms
    expected = 2 * vocab * hidden + len(layers) * layer_norms + hidden  # embeddings, lm_head, norms
    assert sum(p.numel() for p in model.parameters()) == expected  # no dequantized weight anywhere
    assert not any(p.is_meta for p in model.parameters())


def test_greedy_generate_runs_and_starts_with_the_reference_argmax(converted, device):
    """8 greedy steps through the KV cache; the model is causal, so the first new token after a 4-token
    prefix of the reference input is the reference's argmax at position 3. Short prompt: interpreter time."""
    model = load_hf_model(converted[GENERATE_FIXTURE], device=device, dtype=torch.float16)
    ref = reference(GENERATE_FIXTURE)
    prompt = ref["input_ids"][:1, :4].to(device)
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert tokens.shape == (1, 4 + 8)
    assert torch.equal(tokens[:, :4].cpu(), prompt.cpu())
    assert int(tokens[0, 4]) == int(ref["fp16.logits"][0, 3].argmax())


def test_cpu_without_interpreter_is_one_line_error(converted):
    """triton imported without TRITON_INTERPRET: device='cpu' cannot run the kernels; say so in one line."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = (
        "import sys, triton\n"
        "from repack.formats.errors import RepackError\n"
        "from repack.runtime import load_hf_model\n"
        "try:\n"
        f"    load_hf_model({str(converted[GENERATE_FIXTURE])!r}, device='cpu')\n"
        "except RepackError as error:\n"
        "    print('ERROR:' + str(error)); sys.exit(3)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr
    message = result.stdout.strip().removeprefix("ERROR:")
    assert "TRITON_INTERPRET=1" in message and "\n" not in message


def test_config_that_does_not_match_the_weights_is_one_line_error(converted, tmp_path, device):
    broken = tmp_path / "broken"
    shutil.copytree(converted[LAYER_TYPES_FIXTURE], broken)
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"], config["layer_types"] = 1, config["layer_types"][:1]
    (broken / "config.json").write_text(json.dumps(config))
    restamp(broken, "config.json")  # past the manifest check: the mismatch itself must be the error
    with pytest.raises(RepackError) as error:
        load_hf_model(broken, device=device)
    assert "model.layers.1.mlp" in str(error.value) and "\n" not in str(error.value)


def test_invalid_config_is_one_line_error(converted, tmp_path, device):
    broken = tmp_path / "broken"
    shutil.copytree(converted[LAYER_TYPES_FIXTURE], broken)
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"] = 1  # layer_types still lists 2 layers: transformers' validator refuses it
    (broken / "config.json").write_text(json.dumps(config))
    restamp(broken, "config.json")  # past the manifest check: the mismatch itself must be the error
    with pytest.raises(RepackError) as error:
        load_hf_model(broken, device=device)
    assert "config.json" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("shared_mode", ["joined", "separate"])
def test_shared_mode_reaches_every_moe_block(shared_mode, tmp_path, device):
    """load_hf_model passes shared_mode to the runtime blocks; a joinable checkpoint joins in "joined" mode only."""
    from repack.formats.gptq import GptqScheme
    from repack.synthetic import write_synthetic_checkpoint

    source = write_synthetic_checkpoint(
        tmp_path / "src", family="qwen2_moe", scheme=GptqScheme(4, 32, True, "gptq"), shared_intermediate_size=128
    )
    convert(str(source), tmp_path / "out", quiet=True)
    model = load_hf_model(tmp_path / "out", device=device, shared_mode=shared_mode)
    blocks = [layer.mlp.runtime() for layer in model.model.layers]
    assert blocks and all(block.shared_mode == shared_mode for block in blocks)
    assert all((block.joined is not None) == (shared_mode == "joined") for block in blocks)


def test_mixtral_in_older_block_sparse_moe_naming_loads(tmp_path, device):
    """Older Mixtral GPTQ repos name the block ``block_sparse_moe`` (transformers 5: ``mlp``); both doors load it
    onto our blocks and agree."""
    from transformers import AutoModelForCausalLM

    from repack.formats.gptq import GptqScheme
    from repack.runtime.integrations.transformers import RepackMoeBlock
    from repack.synthetic import write_synthetic_checkpoint

    source = write_synthetic_checkpoint(
        tmp_path / "src", family="mixtral", scheme=GptqScheme(4, 32, True, "gptq"), mixtral_naming="v4"
    )
    convert(str(source), tmp_path / "out", quiet=True)
    ids = torch.tensor([[1, 2, 3, 4]], device=device)
    direct = load_hf_model(tmp_path / "out", device=device)
    pretrained = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float16).to(device)
    for model in (direct, pretrained):
        assert all(isinstance(layer.mlp, RepackMoeBlock) for layer in model.model.layers)
    with torch.no_grad():
        torch.testing.assert_close(pretrained(ids).logits, direct(ids).logits, rtol=0, atol=0)
