# fsalab: `make test` and `make repro` each set up what they need, then run.
#
# Environment: the active one when it already has torch (a conda env or venv on a GPU box: its
# CUDA torch is never replaced), otherwise .venv, created here with $(TORCH) from pip's configured
# indexes (PyPI's Linux wheel is the CUDA build; README says how to get the CPU one).
SHELL := /bin/bash
VENV ?= .venv
TORCH ?= torch==2.13.0
TRITON ?= triton==3.6.*
EXTRAS ?= test,hf,workflow,analysis,peers
PYTEST_ARGS ?= -q -n 2 --dist worksteal

ACTIVE_HAS_TORCH := $(shell [ -n "$$VIRTUAL_ENV$$CONDA_PREFIX" ] && python3 -c 'import torch' 2>/dev/null && echo yes)
ifeq ($(ACTIVE_HAS_TORCH),yes)
PYTHON := python3
STAMP := .fsalab-installed-active
else
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.fsalab-installed
# Workflow rules call `fsalab` and `snakemake` by name: find them in the venv.
export PATH := $(abspath $(VENV))/bin:$(PATH)
endif

.PHONY: test repro setup clean

setup: $(STAMP)

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q "$(TORCH)" "$(TRITON)"

$(VENV)/.fsalab-installed: $(VENV)/bin/python pyproject.toml
	$(PYTHON) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

.fsalab-installed-active: pyproject.toml
	$(PYTHON) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

test: $(STAMP)
	$(PYTHON) -m pytest $(PYTEST_ARGS)

# CPU: the smoke grids through the Triton interpreter, then every figure and REPRODUCTION.md from
# the committed results/h200/; CUDA: the paper-scale grids (workflow/profiles/default, mode=auto).
repro: $(STAMP)
	$(PYTHON) -m fsalab.cli env
	$(PYTHON) -m fsalab.smoke
	$(PYTHON) -m snakemake

clean:
	rm -rf $(VENV) .fsalab-installed-active .pytest_cache
