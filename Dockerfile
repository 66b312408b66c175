# m3serve images, NVIDIA (default) and AMD (PLATFORM=rocm). Checked statically only: no Docker engine was available
# to build or run them (docs/configuration.md, "Containers"); tests/unit/test_containers.py and test_pins.py check
# what can be checked without one (the pins resolve, the stub exists, the files say what they should).
#
# NVIDIA: base CUDA 13.0.2 on Ubuntu 24.04 (Python 3.12), the CUDA of the torch 2.11.0 wheels: the host driver must
#   be R580 or newer. The NVIDIA container toolkit refuses an older driver (the base's NVIDIA_REQUIRE_CUDA), and
#   docker/entrypoint.sh checks it again at start and stops with that message (M3SERVE_DEVICE_CHECK=0 skips).
# AMD: base ROCm 7.2 on Ubuntu 24.04 (Python 3.12), torch 2.11.0+rocm7.2 with pytorch-triton-rocm 3.6.0.
# Packages: docker/pins.py IMAGES[PLATFORM] (requirements.txt with the platform's torch pair in place of the CPU one).
# Server: Triton 2.51 from the nvidia-pytriton wheel (a Python-only Triton build: the python backend and no framework
#   backends), started by `./build.sh serve`, which restricts the model-repository API to the operator's key
#   ($M3SERVE_REPOSITORY_KEY or the file $M3SERVE_REPOSITORY_KEY_FILE; header m3serve-repository-key).
#
#   docker build -t m3serve:0.1.0 .
#   docker build -t m3serve:0.1.0-rocm --build-arg PLATFORM=rocm --build-arg BASE_IMAGE=rocm/dev-ubuntu-24.04:7.2-complete .
#   docker run --init --gpus all --ipc=host -p 8000:8000 -p 8001:8001 -p 8002:8002 m3serve:0.1.0   # the tiny model
#   docker run --init --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 -p 8001:8001 \
#     -e M3SERVE_REPOSITORY_KEY_FILE=/run/secrets/key -v $PWD/.secrets/m3serve_repository_key:/run/secrets/key:ro \
#     -v /data:/weights:ro -e M3SERVE_MODEL_DIR=/weights \
#     -v $PWD/model_repository_examples/minimax-m3.1-flash-tp4:/models:ro \
#     m3serve:0.1.0 ./build.sh serve --model-repository /models --load-model m3                  # your weights
#   docker run --init --device=/dev/kfd --device=/dev/dri --group-add video --group-add render --ipc=host \
#     --ulimit memlock=-1 --ulimit stack=67108864 -p 8001:8001 ... m3serve:0.1.0-rocm
ARG BASE_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04

# ---- build: a venv with the pinned packages (pip and the build context stay in this stage)
FROM ${BASE_IMAGE} AS build
ARG PLATFORM=cuda
ARG BASE_IMAGE
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv && \
    rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
WORKDIR /opt/m3serve/src
COPY requirements.txt requirements-test.txt build.sh ./
COPY docker/pins.py docker/
RUN /opt/venv/bin/python docker/pins.py requirements "$PLATFORM" --base "$BASE_IMAGE" > /tmp/requirements-image.txt && \
    /opt/venv/bin/python -m pip install -r /tmp/requirements-image.txt && \
    /opt/venv/bin/python -m pip install --no-deps "$(/opt/venv/bin/python docker/pins.py server)"
COPY pyproject.toml ./
COPY backend ./backend
COPY kernels ./kernels
RUN /opt/venv/bin/python -m pip install --no-deps . && \
    /opt/venv/bin/python -c "import numpy, torch, triton; assert numpy.__version__ < '2'; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'hip', torch.version.hip, 'triton', triton.__version__)"

# ---- runtime: the venv, the sources the server reads, no compilers or pip caches
FROM ${BASE_IMAGE}
ARG PLATFORM=cuda
ARG BASE_IMAGE
LABEL org.opencontainers.image.title="m3serve" \
      org.opencontainers.image.description="Triton Inference Server with the m3serve Python backend for MiniMax-M3 (${PLATFORM}; NVIDIA: host driver R580+)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
ENV DEBIAN_FRONTEND=noninteractive
# libpython3.12t64: the python-backend stub links libpython3.12.so; curl: the health check. The user joins video
# and render (AMD's device nodes); at run time --group-add the host's GIDs where they differ from the image's.
RUN apt-get update && apt-get install -y --no-install-recommends python3 libpython3.12t64 curl ca-certificates && \
    rm -rf /var/lib/apt/lists/* && groupadd -f video && groupadd -f render && \
    useradd --create-home --uid 10001 --user-group --groups video,render m3serve
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    M3SERVE_PYTHON=/opt/venv/bin/python \
    M3SERVE_TRITON_DIR=/opt/m3serve/triton \
    M3SERVE_MODEL_DIR=/opt/m3serve/models
WORKDIR /opt/m3serve/src
# the tree the server reads (.dockerignore keeps out .git, .venv, caches, tests, weights)
COPY . .
# the backend dir and the tiny model at build time (root-owned, read-only at run time); .cache is the server's
# (the repository key it generates when none is given)
RUN ./build.sh assemble && m3serve make-tiny --out /opt/m3serve/models/tiny-m3 && \
    mkdir -p .cache && chown m3serve:m3serve .cache
USER m3serve
EXPOSE 8000 8001 8002 9000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD curl -fs localhost:8000/v2/health/ready || exit 1
ENTRYPOINT ["/opt/m3serve/src/docker/entrypoint.sh"]
# the default repository serves the tiny model (the CPU is enough); mount a repository and weights for a real one
CMD ["./build.sh", "serve"]
