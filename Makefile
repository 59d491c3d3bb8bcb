# mlptrain developer commands. `make help` lists them. On a fresh machine with only python3 and make,
# `make run` and `make test` set everything up (a virtual environment in $(VENV), editable install).

PYTHON ?= python3
VENV ?= .venv
ARGS ?=
PYTEST_ARGS ?=

BIN := $(VENV)/bin
# Written after a successful install; pip runs again only when pyproject.toml is newer.
STAMP := $(VENV)/.installed
# Only the folders that exist (git does not keep empty ones).
LINT_PATHS := $(wildcard mlptrain scripts tests)

.DEFAULT_GOAL := help
.PHONY: help install run test test-gpu lint format typecheck bench compare clean distclean

help: ## List the targets
	@echo "usage: make <target> [ARGS='key=value ...'] [PYTEST_ARGS=...] [PYTHON=python3] [VENV=.venv]"
	@echo
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_-]+:.*## / {printf "  %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[dev]'
	touch $@

install: $(STAMP) ## Create the venv (VENV, default .venv) and install mlptrain editable with the dev extra (only when needed)

run: $(STAMP) ## Train the default model on the default dataset (device auto); ARGS='data=mnist1d epochs=5'
	$(BIN)/python -m mlptrain $(ARGS)

test: $(STAMP) ## Run the CPU test suite; PYTEST_ARGS='-k config -x'
	$(BIN)/python -m pytest -m 'not gpu' $(PYTEST_ARGS)

test-gpu: $(STAMP) ## Run the GPU tests (needs an NVIDIA GPU and the cu12 or cu13 extra)
	$(BIN)/python -m pytest -m gpu $(PYTEST_ARGS)

lint: $(STAMP) ## Check lint and formatting (ruff)
	$(BIN)/python -m ruff check $(LINT_PATHS)
	$(BIN)/python -m ruff format --check $(LINT_PATHS)

format: $(STAMP) ## Sort imports and format the code (ruff)
	$(BIN)/python -m ruff check --select I --fix $(LINT_PATHS)
	$(BIN)/python -m ruff format $(LINT_PATHS)

typecheck: $(STAMP) ## Type-check the package (mypy)
	$(BIN)/python -m mypy

bench: $(STAMP) ## Time fused vs naive steps; ARGS are passed to scripts/bench.py
	$(BIN)/python scripts/bench.py $(ARGS)

# The sweep directory: COMPARE_DIR if given, else runs/compare/<date>_<time> (computed once, in the shell).
compare: $(STAMP) ## Train fused and naive (same seed and data) and plot them; ARGS='seed=0,1,2' (conf/compare.yaml)
	@dir="$(or $(COMPARE_DIR),runs/compare/$$(date +%Y-%m-%d_%H-%M-%S))"; \
	echo "$(BIN)/python -m mlptrain --config-name compare hydra.sweep.dir=$$dir $(ARGS)"; \
	$(BIN)/python -m mlptrain --config-name compare "hydra.sweep.dir=$$dir" $(ARGS) && \
	echo "$(BIN)/python scripts/compare.py $$dir" && \
	$(BIN)/python scripts/compare.py "$$dir"

clean: ## Remove run outputs, build files and caches (keeps the venv)
	rm -rf outputs multirun runs build dist .pytest_cache .ruff_cache .mypy_cache
	rm -rf *.egg-info
	find $(LINT_PATHS) -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean ## Also remove the venv
	rm -rf $(VENV)
