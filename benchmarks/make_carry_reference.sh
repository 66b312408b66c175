#!/usr/bin/env bash
# Make .carry-reference/reference312.tar.xz: transformers 5.25 (the tests' numerical reference) and what it imports
# beyond torch / numpy / tokenizers / safetensors / jinja2 / tqdm, for Python 3.12 on a machine without network
# (the lent H200: `STEPS=suite` of benchmarks/device_run.sh unpacks it onto PYTHONPATH). Pure-Python packages
# come from this checkout's .venv; regex (compiled) is the cp312 wheel of the version installed here; PyYAML's C
# extension is left out (yaml then runs in Python).
set -euo pipefail
cd "$(dirname "$0")/.."
site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/site" .carry-reference
regex="$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("regex"))')"
.venv/bin/python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work" "regex==$regex"
.venv/bin/python -m zipfile -e "$work"/regex-*.whl "$work/site"
for pkg in transformers huggingface_hub anyio h11 httpcore2 httpx2 idna truststore filelock packaging yaml; do
  cp -r "$site/$pkg" "$work/site/"
done
for dist in transformers huggingface_hub anyio h11 httpcore2 httpx2 idna truststore filelock packaging PyYAML pyyaml; do
  cp -r "$site/$dist"-*.dist-info "$work/site/" 2>/dev/null || true
done
find "$work/site" -name __pycache__ -prune -exec rm -rf {} +
rm -f "$work"/site/yaml/_yaml*.so
tar -C "$work/site" -cf - . | xz -T2 -6 > .carry-reference/reference312.tar.xz
ls -l .carry-reference/reference312.tar.xz
