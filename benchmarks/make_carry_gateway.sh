#!/usr/bin/env bash
# Make .carry-server/gateway312.tar.xz: what `m3serve openai` and benchmarks/bench_gateway.py import beyond the
# lent H200's image and .carry-server/site312.tar.xz (FastAPI, Starlette, sse-starlette, uvicorn + httptools,
# pydantic + pydantic-core, prometheus-client, httpx2 and everything they require), for Python 3.12 on a machine
# without network: `STEPS=gateway` of benchmarks/device_run.sh unpacks it into site-packages. The set is the
# requirement closure of those packages as installed in this checkout's .venv (the versions requirements.txt
# pins); each is the cp312 manylinux (or pure-Python) wheel of that version from PyPI, unpacked.
set -euo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/site" .carry-server
.venv/bin/python - fastapi uvicorn httptools sse-starlette prometheus-client httpx2 > "$work/pins.txt" <<'EOF'
import importlib.metadata as md
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

env = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
pins, todo = {}, list(sys.argv[1:])
while todo:
    dist = md.distribution(todo.pop())
    name = canonicalize_name(dist.metadata["Name"])
    if name in pins:
        continue
    pins[name] = dist.version
    for r in map(Requirement, dist.requires or ()):
        if r.marker is None or r.marker.evaluate(env):
            todo.append(r.name)
print("\n".join(f"{n}=={v}" for n, v in sorted(pins.items())))
EOF
cat "$work/pins.txt"
.venv/bin/python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any -d "$work/wheels" -r "$work/pins.txt"
for whl in "$work"/wheels/*.whl; do
  .venv/bin/python -m zipfile -e "$whl" "$work/site"
done
find "$work/site" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$work/site" -cf - . | xz -T2 -6 > .carry-server/gateway312.tar.xz
ls -l .carry-server/gateway312.tar.xz
