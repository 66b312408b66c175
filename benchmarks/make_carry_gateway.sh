#!/usr/bin/env bash
# Make .carry-server/gateway312.tar.xz: what `m3serve openai` and benchmarks/bench_gateway.py import beyond the
# lent H200's image and .carry-server/site312.tar.xz (FastAPI, Starlette, sse-starlette, uvicorn + httptools,
# pydantic + pydantic-core, prometheus-client, httpx2 and everything they require), for Python 3.12 on a machine
# without network: `STEPS=gateway` (and `suite`) of benchmarks/device_run.sh unpack it into site-packages.
set -euo pipefail
cd "$(dirname "$0")/.."
exec benchmarks/make_carry_wheels.sh .carry-server/gateway312.tar.xz \
  fastapi uvicorn httptools sse-starlette prometheus-client httpx2
