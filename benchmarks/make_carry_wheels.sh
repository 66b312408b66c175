#!/usr/bin/env bash
# Usage: benchmarks/make_carry_wheels.sh OUT.tar.xz [--skip NAME,...] PACKAGE...
# Packs the requirement closure of PACKAGE... (the versions installed in this checkout's .venv, i.e. what
# requirements*.txt pin), less the --skip names, as unpacked cp312 manylinux (or pure-Python) wheels from PyPI into
# OUT.tar.xz: what a device call unpacks into site-packages or onto PYTHONPATH on a machine with Python 3.12 and no
# network (benchmarks/device_run.sh). make_carry_gateway.sh and make_carry_tests.sh call it.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: make_carry_wheels.sh OUT.tar.xz [--skip NAME,...] PACKAGE...}"
shift
skip=""
if [ "${1:-}" = "--skip" ]; then skip="$2"; shift 2; fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/site" "$(dirname "$out")"
SKIP="$skip" .venv/bin/python - "$@" > "$work/pins.txt" <<'EOF'
import importlib.metadata as md
import os
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

env = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
skip = {canonicalize_name(n) for n in os.environ["SKIP"].split(",") if n}
pins, todo = {}, list(sys.argv[1:])
while todo:
    dist = md.distribution(todo.pop())
    name = canonicalize_name(dist.metadata["Name"])
    if name in pins or name in skip:
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
tar -C "$work/site" -cf - . | xz -T2 -6 > "$out"
ls -l "$out"
