"""The source formats' configs (formats/source_configs.py): read without torch, so the CLI refuses a source its
config rules out before importing it, and naming exactly the formats the readers (formats/sources/) read."""

from __future__ import annotations

import subprocess
import sys

from repack.formats.source_configs import SOURCE_METHODS, AwqConfig, CompressedTensorsConfig
from repack.formats.sources import READERS


def test_the_configs_and_what_reads_them_before_torch_import_without_torch():
    code = (
        "import sys\n"
        "import repack.formats.source_configs, repack.formats.config_files, repack.source_config, repack.preflight\n"
        "sys.exit('torch' in sys.modules)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_one_reader_per_config_and_each_reader_is_its_config():
    assert tuple(READERS) == SOURCE_METHODS
    assert issubclass(READERS["awq"], AwqConfig)
    assert issubclass(READERS["compressed-tensors"], CompressedTensorsConfig)
