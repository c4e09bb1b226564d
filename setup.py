"""Ships ``moe_repack.pth`` at the top of site-packages, next to the packages, in the wheel and in an editable install.

Why: Python runs the ``import`` line of every ``.pth`` file in site-packages at start-up, so ``import repack.runtime``
(a few milliseconds: no torch, no triton) then runs in every interpreter of an environment that has moe-repack, and
a plain ``AutoModelForCausalLM.from_pretrained(out)`` finds the ``repack`` quantizer without anyone importing it;
without it transformers skips the unknown quant_method and runs the MoE layers on random weights. Everything else is
declared in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

STARTUP_FILE = "moe_repack.pth"  # sorts after setuptools' __editable__ files, which make `repack` importable
STARTUP_LINE = "import repack.runtime\n"


class BuildWithStartupFile(build_py):
    """The wheel: the .pth beside the packages at the root of the wheel (pip installs that root into site-packages)."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            Path(self.build_lib, STARTUP_FILE).write_text(STARTUP_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib, STARTUP_FILE))]


class StartupStrategy:
    """An editable install's strategy (how the wheel points at the sources) that also writes the .pth."""

    def __init__(self, strategy) -> None:
        self.strategy = strategy

    def __call__(self, wheel, files, mapping) -> None:
        self.strategy(wheel, files, mapping)
        wheel.writestr(STARTUP_FILE, STARTUP_LINE.encode())

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.strategy.__exit__(*exc)


class EditableWithStartupFile(editable_wheel):
    """``pip install -e``: setuptools leaves files outside the packages out of editable wheels, so add it here."""

    def _select_strategy(self, name, tag, build_lib):
        return StartupStrategy(super()._select_strategy(name, tag, build_lib))


setup(cmdclass={"build_py": BuildWithStartupFile, "editable_wheel": EditableWithStartupFile})
