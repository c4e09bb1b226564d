"""The shipped kernel tables are exactly what their recorded sweeps make (benchmarks/tables.json)."""

from __future__ import annotations

import json

from benchmarks.make_configs import recorded_sweeps, table_files
from repack.runtime.kernel_config import CONFIG_DIR, KernelConfig


def test_recorded_sweeps_rebuild_the_shipped_tables():
    device, sweeps = recorded_sweeps()
    assert all(path.exists() for path in sweeps), [str(p) for p in sweeps if not p.exists()]
    rebuilt = table_files(sweeps, device)
    shipped = {path.name: path.read_text() for path in CONFIG_DIR.glob(f"*device_name={device}.json")}
    assert rebuilt == shipped


def test_every_shipped_entry_parses_into_a_kernel_config_and_back():
    """In the spelling KernelConfig.to_dict writes (FAMILY named, defaults left out), so a reader sees what runs."""
    for path in CONFIG_DIR.glob("*.json"):
        for entry in json.loads(path.read_text()).values():
            config = KernelConfig.from_dict(entry)
            assert config.to_dict() == entry and KernelConfig.from_dict(config.to_dict()) == config
