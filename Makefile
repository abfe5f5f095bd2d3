# Set-up and everyday commands. Every install goes through constraints.txt, which pins
# torch==2.13.0 so pip takes the CPU wheel here instead of a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
export HF_HUB_OFFLINE := 1

.PHONY: run test lint bench model samples

$(VENV)/.runtime: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) -e .
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(PIP) -e ".[test]"
	touch $@

# The main job: serve the built-in model on http://127.0.0.1:8000 (flags: `python -m server serve -h`).
run: $(VENV)/.runtime
	$(PY) -m server serve

test: $(VENV)/.test lint
	$(PY) -m pytest

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(VENV)/.test
	$(PY) -m benchmarks.shard
	$(PY) -m benchmarks.sampling
	$(PY) -m benchmarks.pipeline
	$(PY) -m benchmarks.unet_rows
	$(PY) -m benchmarks.serving

# Retrain the built-in model from scratch (~50 min on 2 CPU cores), then redraw its grid.
model: $(VENV)/.runtime
	$(PY) -m server.demo.train
	$(MAKE) samples

samples: $(VENV)/.runtime
	$(PY) -m server.demo.sampling --seeds 4 --grid docs/samples.png
