# syntax=docker/dockerfile:1
# diffshard, serving the built-in model (or one mounted at DIFFSHARD_MODEL). One Dockerfile, two images:
#   docker build -t diffshard:cpu .                              python slim + torch's CPU wheel
#   docker build -t diffshard:cuda --build-arg VARIANT=cuda .    CUDA runtime + torch's CUDA 13.0 build
# torch is pinned in constraints.txt (2.13.0); TORCH_INDEX_URL picks its build (+cpu, +cu130). torch 2.13
# is built for CUDA 12.6 and 13.0 (13.2 experimental); to change, override CUDA_IMAGE and TORCH_INDEX_URL
# together, e.g. nvidia/cuda:12.6.3-runtime-ubuntu24.04 with https://download.pytorch.org/whl/cu126.
# The CUDA image needs a host driver for CUDA 13.0 (R580 or newer) and the NVIDIA Container Toolkit.
#
# Base images are pinned to version tags. For reproducible builds pin their digests too, where you can
# resolve them: `docker buildx imagetools inspect <image:tag>`, then e.g.
#   --build-arg CUDA_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04@sha256:<digest>
ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.12-slim-trixie
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04

# ---- bases: a Python 3.12 virtual environment at /opt/venv, and where torch comes from ----
FROM ${PYTHON_IMAGE} AS cpu-base
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV TORCH_INDEX_URL=${TORCH_INDEX_URL}
# g++: --compile auto (the default) builds inductor's CPU kernels as C++ at runtime; without a
# compiler the service serves eagerly and says why. Unpinned for the reason the CUDA base gives.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv

FROM ${CUDA_IMAGE} AS cuda-base
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
# Expandable segments: freed blocks of odd sizes (requests' changing shapes, lanes on one GPU)
# grow a segment instead of fragmenting the cache into blocks no later shape fits.
ENV TORCH_INDEX_URL=${TORCH_INDEX_URL} \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# Ubuntu 24.04's Python 3.12. The archive drops superseded package versions, so pinned versions would
# break the build at the next security update; the base image tag fixes the release instead.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# ---- dependencies, from pyproject.toml and constraints.txt only: source edits keep this layer ----
FROM ${VARIANT}-base AS deps
ENV PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /build
COPY pyproject.toml constraints.txt ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
        > requirements.txt \
    && pip install --no-cache-dir -r requirements.txt -c constraints.txt --extra-index-url "$TORCH_INDEX_URL" \
    && python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# ---- the package as a wheel (the built-in model is package data, so it is inside) ----
FROM deps AS wheel
COPY README.md ./
COPY server ./server
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- the image ----
FROM deps
# Kubernetes runs this with a read-only root filesystem and a writable /tmp: every cache goes there,
# but for the planner's calibration and the compiled graphs with inductor's kernels
# (DIFFSHARD_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR): mount a volume at /var/cache/diffshard to keep
# them across restarts (compose and deploy/k8s do). Unwritable, it only warns: the calibration
# is timed again (a few seconds), and with --compile the graphs are compiled again (minutes).
# XDG_DATA_HOME holds the video jobs' default store (DIFFSHARD_JOB_STORE: the SQLite file and the
# finished videos, under diffshard/): mount a volume at /var/lib/diffshard to keep them (compose
# does), or point DIFFSHARD_JOB_STORE at a Redis (compose and the Kubernetes overlays do).
ENV PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HOME=/tmp \
    HF_HOME=/tmp/huggingface \
    XDG_CACHE_HOME=/tmp/.cache \
    XDG_DATA_HOME=/var/lib/diffshard \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/diffshard/inductor \
    TRITON_CACHE_DIR=/tmp/triton \
    MPLCONFIGDIR=/tmp/matplotlib \
    DIFFSHARD_HOST=0.0.0.0 \
    DIFFSHARD_CACHE_DIR=/var/cache/diffshard
# The LoRA adapter and the ControlNet shipped with the package (the diamond and the silhouette, trained
# on the built-in model) at fixed paths, whatever the Python version: compose and the cpu overlay load
# DIFFSHARD_LORA=diamond=... and DIFFSHARD_CONTROLNET=silhouette=... from there.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-deps /wheels/*.whl \
    && python -c "from server.demo import MODEL_DIR; assert (MODEL_DIR / 'model_index.json').is_file(), MODEL_DIR" \
    && install -d /opt/diffshard \
    && ln -s "$(python -c "from server.demo import MODEL_DIR; print(MODEL_DIR.parent / 'adapters')")" /opt/diffshard/adapters \
    && test -f /opt/diffshard/adapters/diamond.safetensors \
    && ln -s "$(python -c "from server.demo import MODEL_DIR; print(MODEL_DIR.parent / 'controlnets')")" /opt/diffshard/controlnets \
    && test -f /opt/diffshard/controlnets/silhouette/config.json \
    && groupadd --gid 10001 diffshard \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin diffshard \
    && install -d -o 10001 -g 10001 -m 0750 /var/cache/diffshard \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/diffshard \
    && rm -rf /build
WORKDIR /app
# A fixed numeric UID, so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
# 8000: the API (OpenAI Images API, /livez, /readyz); 8001: Prometheus /metrics and the probes
# (no auth: keep it inside the cluster or on 127.0.0.1)
EXPOSE 8000 8001
# Ready once the model is loaded; 503 (so unhealthy) while loading, draining or broken. Asked on
# the metrics port: clients holding every API connection cannot make it fail.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('DIFFSHARD_METRICS_PORT', '8001'), timeout=4)"]
# SIGTERM drains in-flight requests for up to DIFFSHARD_DRAIN_TIMEOUT_S (30 s) plus 5 s to finish:
# give the container longer than that to stop (docker run --stop-timeout 45, compose stop_grace_period).
ENTRYPOINT ["python", "-m", "server"]
CMD ["serve"]
