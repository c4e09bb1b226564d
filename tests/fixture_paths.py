"""Where the GPTQModel-made fixtures live in the repository (copied from ../shared/fixtures)."""

from __future__ import annotations

from pathlib import Path

FIXTURES_DIR = Path(__file__).parent / "fixtures"
FIXTURE_NAMES = ("qwen2moe-g128-sym", "qwen2moe-g32-actorder", "qwen3moe-g128-sym")
FIXTURES = [FIXTURES_DIR / name for name in FIXTURE_NAMES]
