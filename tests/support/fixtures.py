"""Where the GPTQModel-made fixtures live in the repository (copied from ../shared/fixtures)."""

from __future__ import annotations

from pathlib import Path

FIXTURES_DIR = Path(__file__).parents[1] / "fixtures"
FIXTURE_NAMES = ("qwen2moe-g128-sym", "qwen2moe-g32-actorder", "qwen3moe-g128-sym")
FIXTURES = [FIXTURES_DIR / name for name in FIXTURE_NAMES]
# Made by the other tools users quantize with (tests/fixtures/make_source_fixtures.py): llm-compressor's
# compressed-tensors and GPTQModel's AWQ; their references are float32 (``fp32.*``).
SOURCE_FIXTURE_NAMES = (
    "ct-qwen3moe-g128-sym",
    "ct-qwen2moe-g128-asym",
    "ct-mixtral-channel-asym",
    "ct-qwen3moe-channel-sym-mixed",
    "awq-qwen2moe-g128-asym",
    "awq-qwen3moe-g64-sym",
)
SOURCE_FIXTURES = [FIXTURES_DIR / name for name in SOURCE_FIXTURE_NAMES]


def assert_logits_match_reference(model, fixture: str, device, key: str = "fp16.logits") -> None:
    """A transformers model's logits on the fixture's ``input_ids`` vs the tool's (GPTQModel's fp16 by default).

    The bar every door into transformers must meet: relative <= 1e-2 on the logits, the same argmax at >= 95% of
    positions."""
    import torch
    from safetensors.torch import load_file

    ref = load_file(FIXTURES_DIR / fixture / "reference.safetensors")
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"].to(device), use_cache=False).logits.float().cpu()
    expected = ref[key].float()
    assert logits.shape == expected.shape
    relative = (logits - expected).abs().max() / expected.abs().max()
    agreement = (logits.argmax(-1) == expected.argmax(-1)).float().mean()
    assert relative <= 1e-2, f"relative logit error {relative:.2e}"
    assert agreement >= 0.95, f"argmax agreement {agreement:.3f}"
