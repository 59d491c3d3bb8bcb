# mlptrain developer commands. `make help` lists them. On a fresh machine with only python3 and make,
# `make run` and `make test` set everything up (a virtual environment in $(VENV), editable install):
# `make run` installs what running needs (and, with an NVIDIA driver, the matching CUDA extra),
# `make test` the developer tools.

PYTHON ?= python3
VENV ?= .venv
ARGS ?=
PYTEST_ARGS ?=

BIN := $(VENV)/bin
# Written after a successful install; pip runs again only when pyproject.toml is newer.
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed-dev
# The CUDA extra that the NVIDIA driver supports: cu13 from driver 580, cu12 from 525; none without a driver.
# Override with GPU_EXTRA=cu12, or GPU_EXTRA= for the CPU only.
GPU_EXTRA ?= $(shell v=$$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1 | cut -d. -f1); \
	if [ -n "$$v" ] && [ "$$v" -ge 580 ] 2>/dev/null; then echo cu13; elif [ -n "$$v" ] && [ "$$v" -ge 525 ] 2>/dev/null; then echo cu12; fi)
# Only the folders that exist (git does not keep empty ones).
LINT_PATHS := $(wildcard mlptrain benchmarks scripts tests examples .ci)

.DEFAULT_GOAL := help
.PHONY: help install run test test-gpu lint format typecheck bench compare compare-gpu compare-fp8 clean distclean

help: ## List the targets
	@echo "usage: make <target> [ARGS='key=value ...'] [PYTEST_ARGS=...] [PYTHON=python3] [VENV=.venv]"
	@echo
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_-]+:.*## / {printf "  %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

$(RUN_STAMP): pyproject.toml | $(BIN)/python
	@echo "installing mlptrain $(if $(GPU_EXTRA),with the $(GPU_EXTRA) extra (an NVIDIA driver was found),for the CPU only (no NVIDIA driver found))"
	$(BIN)/python -m pip install -e '.$(if $(GPU_EXTRA),[$(GPU_EXTRA)])'
	touch $@

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -e '.[dev]'
	touch $@

install: $(STAMP) ## Create the venv (VENV, default .venv) and install mlptrain editable with the dev extra (only when needed)

run: $(RUN_STAMP) ## Train the default model on the default dataset (GPU if there is one); ARGS='data=mnist1d epochs=5'
	$(BIN)/python -m mlptrain $(ARGS)

test: $(STAMP) ## Run the CPU test suite; PYTEST_ARGS='-k config -x'
	$(BIN)/python -m pytest -m 'not gpu' $(PYTEST_ARGS)

test-gpu: $(STAMP) $(RUN_STAMP) ## Run the GPU tests (needs an NVIDIA GPU; installs the CUDA extra of the driver)
	$(BIN)/python -m pytest -m gpu $(PYTEST_ARGS)

lint: $(STAMP) ## Check lint and formatting (ruff)
	$(BIN)/python -m ruff check $(LINT_PATHS)
	$(BIN)/python -m ruff format --check $(LINT_PATHS)

format: $(STAMP) ## Sort imports and format the code (ruff)
	$(BIN)/python -m ruff check --select I --fix $(LINT_PATHS)
	$(BIN)/python -m ruff format $(LINT_PATHS)

typecheck: $(STAMP) ## Type-check the package (mypy)
	$(BIN)/python -m mypy

bench: $(STAMP) $(RUN_STAMP) ## Time fused vs naive steps; ARGS are passed to scripts/bench.py
	$(BIN)/python scripts/bench.py $(ARGS)

# The sweep directory: COMPARE_DIR if given, else runs/compare/<date>_<time> (computed once, in the shell).
compare: $(STAMP) ## Train fused and naive (same seed and data) and plot them; ARGS='seed=0,1,2' (conf/compare.yaml)
	@dir="$(or $(COMPARE_DIR),runs/compare/$$(date +%Y-%m-%d_%H-%M-%S))"; \
	echo "$(BIN)/python -m mlptrain --config-name compare hydra.sweep.dir=$$dir $(ARGS)"; \
	$(BIN)/python -m mlptrain --config-name compare "hydra.sweep.dir=$$dir" $(ARGS) && \
	echo "$(BIN)/python -m mlptrain.compare $$dir" && \
	$(BIN)/python -m mlptrain.compare "$$dir"

# docs/compare-gpu/ (issue #17): MNIST-1D and a wide speed task, relu/gelu x fp16/bf16, fused vs naive, on a GPU.
# Everything goes under COMPARE_DIR (default runs/compare-gpu/<date>_<time>); ARGS='--smoke' runs it small on the CPU.
compare-gpu: $(STAMP) ## The GPU comparison of docs/compare-gpu/ (scripts/compare.sh --suite gpu); ARGS='--smoke' on a CPU
	PYTHON=$(BIN)/python bash scripts/compare.sh --suite gpu "$(or $(COMPARE_DIR),runs/compare-gpu/$$(date +%Y-%m-%d_%H-%M-%S))" $(ARGS)

# docs/compare-fp8/ (issue #30): fp8 vs bf16, five seeds, MNIST-1D and a wide synthetic task, on a GPU of
# compute capability 8.9+. Everything goes under COMPARE_DIR (default runs/compare-fp8/<date>_<time>);
# ARGS='--smoke' runs it small on the CPU (fp8 emulated, against fp32).
compare-fp8: $(STAMP) ## The FP8 comparison of docs/compare-fp8/ (scripts/compare.sh --suite fp8); ARGS='--smoke' on a CPU
	PYTHON=$(BIN)/python bash scripts/compare.sh --suite fp8 "$(or $(COMPARE_DIR),runs/compare-fp8/$$(date +%Y-%m-%d_%H-%M-%S))" $(ARGS)

clean: ## Remove run outputs, build files and caches (keeps the venv)
	rm -rf outputs multirun runs build dist .pytest_cache .ruff_cache .mypy_cache
	rm -rf *.egg-info
	find $(LINT_PATHS) -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean ## Also remove the venv
	rm -rf $(VENV)
