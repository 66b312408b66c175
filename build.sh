#!/usr/bin/env bash
# m3serve build and run entry point.
#   ./build.sh setup   create .venv with pinned packages (idempotent)
#   ./build.sh demo    setup, make the tiny model, run the main job on it
#   ./build.sh test    setup, run the whole test suite
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
VENV="${M3SERVE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
TINY="${M3SERVE_TINY_MODEL:-$ROOT/.cache/tiny-m3}"
TRANSFORMERS_VERSION=5.25.0
PYTRITON_VERSION=0.7.0

log() { printf '[build.sh] %s\n' "$*" >&2; }

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv at $VENV"
    "$PY" -m venv "$VENV"
  fi
  local stamp="$VENV/.m3serve-setup"
  local want
  want="$(cat requirements.txt requirements-test.txt pyproject.toml | sha256sum | cut -c1-16)-$TRANSFORMERS_VERSION-$PYTRITON_VERSION"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  log "installing pinned packages"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements.txt -r requirements-test.txt
  # The reference model (tests only) and the real tritonserver: both without their declared deps.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    "transformers==$TRANSFORMERS_VERSION" "nvidia-pytriton==$PYTRITON_VERSION"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
  echo "$want" > "$stamp"
}

tiny() {
  if [ ! -f "$TINY/config.json" ]; then
    log "generating the tiny model at $TINY"
    "$VENV/bin/m3serve" make-tiny --out "$TINY"
  fi
}

demo() {
  setup
  tiny
  "$VENV/bin/m3serve" generate --model "$TINY" --prompt-ids 5,7,9 --prompt-ids 11,12 \
    --max-tokens 16 --temperature 0 --device cpu --dtype float32
}

run_tests() {
  setup
  export USE_HUB_KERNELS=0 OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
}

cmd="${1:-}"
shift || true
case "$cmd" in
  setup) setup ;;
  demo) demo "$@" ;;
  test) run_tests "$@" ;;
  *) echo "usage: $0 {setup|demo|test} [args]" >&2; exit 2 ;;
esac
