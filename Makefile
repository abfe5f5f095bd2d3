# Set-up and everyday commands. Every install goes through constraints.txt, which pins
# torch==2.13.0. From PyPI's default index that is the CUDA build (GBs, for GPU hosts); on a
# CPU-only host pass TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU wheel.
VENV ?= .venv
TORCH_INDEX ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt \
	$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
export HF_HUB_OFFLINE := 1

.PHONY: run test lint bench model samples prometheus

$(VENV)/.runtime: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) -e .
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(PIP) -e ".[test]"
	touch $@

# tests/test_prometheus.py runs Debian's prometheus and promtool; install them when either is missing
# (apt-get update only if the install fails; sudo only when not root).
APT := env DEBIAN_FRONTEND=noninteractive apt-get
APT_INSTALL := $(APT) install -y --no-install-recommends prometheus
prometheus:
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then \
	  if ! command -v apt-get >/dev/null; then \
	    echo "tests/test_prometheus.py needs prometheus and promtool on PATH: install them" >&2; exit 1; \
	  elif [ "$$(id -u)" -eq 0 ]; then sudo=; \
	  elif command -v sudo >/dev/null; then sudo=sudo; \
	  else echo "installing prometheus for tests/test_prometheus.py needs root or sudo" >&2; exit 1; fi; \
	  echo "installing Debian's prometheus for tests/test_prometheus.py"; \
	  $$sudo $(APT_INSTALL) || { $$sudo $(APT) update && $$sudo $(APT_INSTALL); }; \
	fi

# The main job: serve the built-in model on http://127.0.0.1:8000 (flags: `python -m server serve -h`).
run: $(VENV)/.runtime
	$(PY) -m server serve

test: $(VENV)/.test prometheus lint
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
	$(PY) -m benchmarks.soak
	$(PY) -m benchmarks.host_memory
	$(PY) -m benchmarks.threads
	$(PY) -m benchmarks.parallel

# Retrain the built-in model from scratch (~50 min on 2 CPU cores), then redraw its grid.
model: $(VENV)/.runtime
	$(PY) -m server.demo.train
	$(MAKE) samples

samples: $(VENV)/.runtime
	$(PY) -m server.demo.sampling --seeds 4 --grid docs/samples.png
