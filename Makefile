# Set-up and everyday commands. Every install goes through constraints.txt, which pins
# torch==2.13.0, not its build (docs/install.md, "Which torch"): pip takes a local CPU wheel on its
# find-links where there is one (our test and CI machines); else PyPI's default index gives the
# CUDA build on Linux x86_64 (GBs, for GPU hosts). On a CPU-only host without a local wheel, pass
# TORCH_INDEX=https://download.pytorch.org/whl/cpu: pip then takes that index's 2.13.0+cpu.
VENV ?= .venv
TORCH_INDEX ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt \
	$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
export HF_HUB_OFFLINE := 1

.PHONY: run test lint bench model samples diamond test-tools screenshot gpu-bundle

$(VENV)/.runtime: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) -e .
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(PIP) -e ".[test]"
	touch $@

# Debian packages the tests run for real: prometheus and promtool (tests/test_prometheus.py),
# chromium and chromedriver (tests/test_playground.py), redis-server (tests/test_videos.py: the shared
# job store), kubectl (tests/deploy renders deploy/k8s).
# Install those missing (apt-get update only if the install fails; sudo only when not root).
# kubectl is not on PyPI and is in apt only where Kubernetes' own repository (pkgs.k8s.io) or
# Google Cloud's is set up: Debian 12's kubernetes-client is 1.20, too old for kustomize
# components. So kubectl is installed when apt has one >= KUBECTL_MIN, and otherwise the tests
# that render deploy/k8s skip, saying what to install (tests/deploy/manifests.py).
TEST_PACKAGES := prometheus:prometheus promtool:prometheus chromium:chromium chromedriver:chromium-driver \
	redis-server:redis-server
KUBECTL_MIN := 1.21
APT := env DEBIAN_FRONTEND=noninteractive apt-get
test-tools:
	@kubectl_package() { command -v kubectl >/dev/null && return; \
	  for pkg in kubectl kubernetes-client; do \
	    version=$$(apt-cache policy $$pkg 2>/dev/null | sed -n 's/^ *Candidate: //p'); \
	    case "$$version" in ""|"(none)") continue;; esac; \
	    if dpkg --compare-versions "$$version" ge $(KUBECTL_MIN); then echo $$pkg; return; fi; \
	  done; }; \
	missing=$$(for pair in $(TEST_PACKAGES); do \
	  command -v $${pair%%:*} >/dev/null || echo $${pair#*:}; done | sort -u | xargs); \
	if command -v apt-get >/dev/null; then missing=$$(echo $$missing $$(kubectl_package)); fi; \
	if [ -n "$$missing" ]; then \
	  if ! command -v apt-get >/dev/null; then \
	    echo "the tests need Debian's $$missing (or the same programs on PATH): install them" >&2; exit 1; \
	  elif [ "$$(id -u)" -eq 0 ]; then sudo=; \
	  elif command -v sudo >/dev/null; then sudo=sudo; \
	  else echo "installing $$missing for the tests needs root or sudo" >&2; exit 1; fi; \
	  echo "installing Debian's $$missing for the tests"; \
	  $$sudo $(APT) install -y --no-install-recommends $$missing || \
	    { $$sudo $(APT) update && missing=$$(echo $$missing $$(kubectl_package) | xargs -n1 | sort -u | xargs) \
	      && $$sudo $(APT) install -y --no-install-recommends $$missing; } || exit 1; \
	fi; \
	command -v kubectl >/dev/null || echo "no kubectl >= $(KUBECTL_MIN) on PATH or in apt's sources: the" \
	  "tests that render deploy/k8s will skip; to run them, install kubectl from https://pkgs.k8s.io" \
	  "(https://kubernetes.io/docs/tasks/tools/install-kubectl-linux/)" >&2

# The main job: serve the built-in model on http://127.0.0.1:8000 (flags: `python -m server serve -h`),
# with the LoRA trained on it (ask for "a red diamond" with lora {"diamond": 1}) and the ControlNet
# (control [{"model": "silhouette", "image": a shape's silhouette}] places the shape).
run: $(VENV)/.runtime
	$(PY) -m server serve --lora diamond=server/demo/adapters/diamond.safetensors --controlnet silhouette=server/demo/controlnets/silhouette

# The whole suite, a module to a worker (its module fixtures built once), each worker pinned to its
# share of the CPUs (tests/conftest.py); at most 4 workers: each holds a torch and its servers.
test: $(VENV)/.test test-tools lint
	$(PY) -m pytest -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(VENV)/.test
	$(PY) -m benchmarks.parallel.shard
	$(PY) -m benchmarks.peers.diffusers_sampling
	$(PY) -m benchmarks.peers.diffusers_pipeline
	$(PY) -m benchmarks.speed.unet_rows
	$(PY) -m benchmarks.serving.throughput
	$(PY) -m benchmarks.serving.soak
	$(PY) -m benchmarks.serving.host_memory
	$(PY) -m benchmarks.parallel.thread_count
	$(PY) -m benchmarks.parallel.replicas_and_stages
	$(PY) -m benchmarks.parallel.planner
	$(PY) -m benchmarks.parallel.thread_default

# Retrain the built-in model from scratch (~50 min on 2 CPU cores), then redraw its grid.
model: $(VENV)/.runtime
	$(PY) -m server.demo.train
	$(MAKE) samples

samples: $(VENV)/.runtime
	$(PY) -m server.demo.sampling --seeds 4 --grid docs/samples.png

# Retrain the diamond LoRA on the built-in model (~7 min on 2 CPU cores; peft is a test extra),
# then judge it as the server serves it; both write server/demo/adapters/diamond.json.
diamond: $(VENV)/.test
	$(PY) -m server.demo.train_lora
	$(PY) -m benchmarks.quality.diamond_lora

# Redraw docs/playground.md's pictures of the playground (a real Chromium drives it: tests/test_playground*.py).
screenshot: $(VENV)/.test test-tools
	DIFFSHARD_SCREENSHOT=docs/playground.png $(PY) -m pytest tests/test_playground.py -k red_circle -q
	DIFFSHARD_SCREENSHOT=docs/playground-edit.png $(PY) -m pytest tests/test_playground_edit.py -k made_here -q
	DIFFSHARD_SCREENSHOT=docs/playground-video.png $(PY) -m pytest tests/test_playground_video.py -q

# The wheels a lent GPU machine lacks (no network there), into .gpu/ (ignored), for the GPU check:
# fails if they and the tree that travels with every call are over 62 MiB (docs/benchmarks.md).
# Then, on the GPU machine: python3 -m benchmarks.gpu_check --bundle .gpu
gpu-bundle:
	python3 -m benchmarks.gpu.bundle --dest .gpu
