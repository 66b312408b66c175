# m3serve on NVIDIA GPUs: Triton Inference Server 24.10 (= 2.51, Python 3.10 stub, numpy<2) + the m3serve
# Python-based backend. Not built or run in CI (no Docker there): written against the 24.10 image layout.
#
#   docker build -t m3serve .
#   docker run --gpus all --shm-size=8g -p 8000:8000 -p 8001:8001 -p 8002:8002 m3serve          # tiny model
#   docker run --gpus all --shm-size=8g -p 8001:8001 \
#     -v /path/to/weights:/weights:ro -e M3SERVE_MODEL_DIR=/weights \
#     -v $PWD/model_repository_examples/minimax-m3.1-flash-tp4:/models:ro \
#     m3serve tritonserver --model-repository=/models                                           # your weights
#
# Alternative without the NGC image: a CUDA base image + `pip install nvidia-pytriton==0.7.0 --no-deps`, then
# `M3SERVE_PYTHON=python3 ./build.sh serve ...` (the same wheel server that CI runs on CPU).
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:24.10-py3
FROM ${TRITON_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    M3SERVE_MODEL_DIR=/opt/m3serve/models

WORKDIR /opt/m3serve/src
# dependencies first (layer cache); numpy must stay < 2 for the 24.10 python backend (outputs arrive empty
# with numpy 2). torch's wheel brings its own CUDA runtime; the host driver must support it.
COPY requirements.txt pyproject.toml ./
RUN python3 -m pip install --upgrade pip && \
    python3 -m pip install -r requirements.txt && \
    python3 -c "import numpy, sys; assert numpy.__version__ < '2', numpy.__version__"

COPY backend ./backend
COPY kernels ./kernels
RUN python3 -m pip install --no-deps . && \
    mkdir -p /opt/tritonserver/backends/m3serve && \
    cp backend/triton/model.py /opt/tritonserver/backends/m3serve/model.py && \
    python3 -m m3serve.cli make-tiny --out /opt/m3serve/models/tiny-m3

COPY model_repository /opt/m3serve/model_repository
COPY model_repository_examples /opt/m3serve/model_repository_examples
COPY clients /opt/m3serve/clients

EXPOSE 8000 8001 8002
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s \
  CMD curl -fs localhost:8000/v2/health/ready || exit 1
# the default repository serves the tiny model (CPU); mount a repository + weights for a real model.
# Explicit model control: a model whose engine dies turns itself (and /v2/health/ready) unready; restrict the
# repository API to operators with --http-restricted-api / --grpc-restricted-protocol=model-repository:KEY=VALUE.
CMD ["tritonserver", "--model-repository=/opt/m3serve/model_repository", \
     "--model-control-mode=explicit", "--load-model=*", \
     "--backend-config=python,shm-default-byte-size=16777216"]
