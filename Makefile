# Everyday commands. `make demo` and `make test` are the two README commands: each sets up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR ?= demo-out

.PHONY: install demo test lint format bench-convert bench-moe device-wheels clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU wheel of torch first, so nothing below pulls a multi-GB CUDA build; triton as on the H200 we measure on.
	$(BIN)/python -m pip install -q torch==2.13.0 triton==3.6.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/repack demo $(DEMO_DIR) --force

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench-convert: $(STAMP)
	$(BIN)/python benchmarks/bench_convert.py

bench-moe: $(STAMP)
	$(BIN)/python benchmarks/bench_moe.py

clean:
	rm -rf $(DEMO_DIR) build dist *.egg-info .pytest_cache .ruff_cache

# Wheels of the CLI's dependencies for the GPU machine, which has no network (benchmarks/device_run.sh installs them).
device-wheels: $(STAMP)
	$(BIN)/python -m pip download -q rich typer 'huggingface_hub>=2.0' --python-version 3.12 --only-binary=:all: \
		--platform manylinux2014_x86_64 -d .wheels
