#!/usr/bin/env bash
# m3serve build and run entry point.
#   ./build.sh setup   create .venv with pinned packages and assemble the Triton backend dir (idempotent)
#   ./build.sh serve [--model-repository DIR] [--grpc-port N --http-port N --metrics-port N] [tritonserver args]
#                      the real tritonserver in the foreground (default: model_repository/ on the tiny model;
#                      --model-control-mode=explicit --load-model=* unless a control mode is given: a model
#                      whose engine dies can then turn itself, and the server, unready); the repository,
#                      logging, trace and shared-memory APIs need the header m3serve-repository-key (gRPC:
#                      triton-grpc-protocol-m3serve-repository-key) with the operator's key: $M3SERVE_REPOSITORY_KEY,
#                      the file $M3SERVE_REPOSITORY_KEY_FILE, else one generated into .cache/repository-key (mode 600)
#   ./build.sh demo    setup, start the server on the learned model (models/m3-tiny-learned; else the tiny random
#                      model), stream an arithmetic answer and a parsed tool call, stop the server
#   ./build.sh test    setup, check the package graph (lint-imports), run the whole test suite
#   ./build.sh lint-imports               only check the package graph (import-linter's contracts in pyproject.toml)
#   ./build.sh genai-perf [ARGS]          genai-perf (NVIDIA's LLM benchmark, with perf_analyzer) in its own venv
#                                         (.cache/genai-perf; made on first use, `test` makes it too), run with ARGS
#   ./build.sh assemble                   only assemble the backend dir (with $M3SERVE_PYTHON: no venv; Docker)
# $M3SERVE_PYTHON: use this Python (packages already installed) instead of .venv; $M3SERVE_TRITON_DIR: where the
# backend dir goes (default .cache/triton); $M3SERVE_MODEL_DIR: where model.json's relative "model" paths resolve.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
VENV="${M3SERVE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
TINY="${M3SERVE_TINY_MODEL:-$ROOT/.cache/tiny-m3}"
TRITON_DIR="${M3SERVE_TRITON_DIR:-$ROOT/.cache/triton}"   # assembled backends: python/ + m3serve/
PYBIN="${M3SERVE_PYTHON:-$VENV/bin/python}"
case "$PYBIN" in */*) ;; *) PYBIN="$(command -v "$PYBIN")" ;; esac  # a bare name: its PATH entry (venv kept)
TRANSFORMERS_VERSION=5.25.0
PYTRITON_VERSION=0.7.0
# genai-perf in a venv of its own (it pulls pandas, plotly, transformers...): the release that pairs with Triton 2.51's
# perf_analyzer (the tritonclient wheel ships the binary), which needs libcudart (a PyPI wheel; no GPU is touched
# for an HTTP endpoint) and libb64 (Debian's package, unpacked by Python: no root, no dpkg)
GENAI_PERF="$ROOT/.cache/genai-perf"
GENAI_PERF_PKGS=("genai-perf==0.0.8" "tritonclient[all]==2.51.0" "nvidia-cuda-runtime-cu12==12.9.79")
LIBB64_DEB="http://deb.debian.org/debian/pool/main/libb/libb64/libb64-0d_1.2-5%2bb1_amd64.deb"
LIBB64_SHA256=b0e1d6fde8bdccc18c3884144aede064dc82464dd4777275fa80e74c05583e82

log() { printf '[build.sh] %s\n' "$*" >&2; }

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv at $VENV"
    "$PY" -m venv "$VENV"
  fi
  local stamp="$VENV/.m3serve-setup"
  local want
  want="$(cat requirements.txt requirements-test.txt pyproject.toml | sha256sum | cut -c1-16)-$TRANSFORMERS_VERSION-$PYTRITON_VERSION"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    log "installing pinned packages"
    if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements.txt -r requirements-test.txt
    then  # the CPU set's torch pin is the CPU wheel: PyPI's Linux torch is the CUDA build (docs/configuration.md)
      log "error: installing the CPU set failed; where pip finds no CPU torch wheel, rerun with"
      log "  PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu ./build.sh setup"
      return 1
    fi
    # The reference model (tests only) and the real tritonserver: both without their declared deps.
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
      "transformers==$TRANSFORMERS_VERSION" "nvidia-pytriton==$PYTRITON_VERSION"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
    echo "$want" > "$stamp"
  fi
  assemble_backend
}

site_dir() { "$PYBIN" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# copy $1 to $2 only when it differs (atomic rename: concurrent setups never see a half-written file)
install_file() {
  if [ ! -f "$2" ] || ! cmp -s "$1" "$2"; then
    cp "$1" "$2.tmp.$$" && chmod "${3:-644}" "$2.tmp.$$" && mv -f "$2.tmp.$$" "$2"
  fi
}

# The Python-based backend: backends/python (the wheel's libtriton_python.so, the utils module and the stub
# built for the venv's Python) and backends/m3serve/model.py (loaded for `backend: "m3serve"`).
assemble_backend() {
  local site pyver dist
  site="$(site_dir)"
  pyver="$("$PYBIN" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
  dist="$site/pytriton/tritonserver"
  if [ ! -x "$dist/bin/tritonserver" ]; then
    log "error: no tritonserver in $dist (nvidia-pytriton==$PYTRITON_VERSION missing?)"; return 1
  fi
  if [ ! -f "$dist/python_backend_stubs/$pyver/triton_python_backend_stub" ]; then
    log "error: the wheel has no python backend stub for Python $pyver (has: $(ls "$dist/python_backend_stubs" | tr '\n' ' '))"
    return 1
  fi
  mkdir -p "$TRITON_DIR/backends/python" "$TRITON_DIR/backends/m3serve"
  install_file "$dist/backends/python/libtriton_python.so" "$TRITON_DIR/backends/python/libtriton_python.so" 755
  install_file "$dist/backends/python/triton_python_backend_utils.py" \
    "$TRITON_DIR/backends/python/triton_python_backend_utils.py"
  install_file "$dist/python_backend_stubs/$pyver/triton_python_backend_stub" \
    "$TRITON_DIR/backends/python/triton_python_backend_stub" 755
  install_file "$ROOT/backend/triton/model.py" "$TRITON_DIR/backends/m3serve/model.py"
}

# Environment for tritonserver and its stubs: the server's bundled libs, the venv's libpython, and the venv
# first on PATH (the embedded interpreter of the stub finds its prefix, hence the venv's packages, from it).
server_env() {
  local site libdir
  site="$(site_dir)"
  libdir="$("$PYBIN" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')"
  export PATH="$(dirname "$PYBIN"):$PATH"
  export LD_LIBRARY_PATH="$site/nvidia_pytriton.libs${libdir:+:$libdir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  TRITONSERVER="$site/pytriton/tritonserver/bin/tritonserver"
}

tiny() {
  if [ ! -f "$TINY/config.json" ] || [ ! -f "$TINY/dspark/config.json" ]; then  # the model and its DSpark draft
    log "generating the tiny model at $TINY"
    "$PYBIN" -m m3serve.cli make-tiny --out "$TINY"
  fi
}

# The default repository's model.json files name "tiny-m3", looked up under $M3SERVE_MODEL_DIR.
default_model_dir() {
  if [ -z "${M3SERVE_MODEL_DIR:-}" ]; then
    tiny
    mkdir -p "$ROOT/.cache/models"
    ln -sfn "$TINY" "$ROOT/.cache/models/tiny-m3"
    export M3SERVE_MODEL_DIR="$ROOT/.cache/models"
  fi
}

# the interpreter named by $M3SERVE_PYTHON comes with its packages; otherwise the venv is made/checked here
prepare() {
  if [ -n "${M3SERVE_PYTHON:-}" ]; then assemble_backend; else setup; fi
}

# The APIs that change what the server does (load/unload/reconfigure models, where logs and traces go, which
# shared memory it maps) answer only requests that carry the operator's key; health, metadata, model config,
# statistics and inference stay open. README.md ("The repository key") says why.
RESTRICTED_APIS="model-repository,logging,trace,shared-memory"
REPOSITORY_KEY_HEADER="m3serve-repository-key"

# The operator's key into $REPOSITORY_KEY: $M3SERVE_REPOSITORY_KEY, else the file $M3SERVE_REPOSITORY_KEY_FILE,
# else .cache/repository-key (made once, mode 600, reused). The key itself is never logged, only where it is.
repository_key() {
  local file="${M3SERVE_REPOSITORY_KEY_FILE:-}" from
  if [ -n "${M3SERVE_REPOSITORY_KEY:-}" ]; then
    REPOSITORY_KEY="$M3SERVE_REPOSITORY_KEY"; from="\$M3SERVE_REPOSITORY_KEY"
  else
    if [ -z "$file" ]; then
      file="$ROOT/.cache/repository-key"
      if [ ! -s "$file" ]; then
        mkdir -p "$(dirname "$file")"
        (umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$file.tmp.$$") && mv -f "$file.tmp.$$" "$file"
        log "generated a repository key into $file"
      fi
      chmod 600 "$file"
    elif [ ! -r "$file" ]; then
      log "error: M3SERVE_REPOSITORY_KEY_FILE=$file cannot be read"; return 1
    fi
    REPOSITORY_KEY="$(tr -d ' \t\r\n' < "$file")"; from="the file $file"
  fi
  # Triton reads the flag as <apis>:<header>=<value>: a key of these characters only, long enough not to be guessed
  if ! [[ "$REPOSITORY_KEY" =~ ^[A-Za-z0-9._~+/-]{16,}$ ]]; then
    log "error: the repository key (from $from) must be at least 16 characters of A-Z a-z 0-9 . _ ~ + / -"
    return 1
  fi
  log "the $RESTRICTED_APIS APIs need the header $REPOSITORY_KEY_HEADER (gRPC: triton-grpc-protocol-$REPOSITORY_KEY_HEADER) with the key from $from"
}

serve() {
  prepare
  local repo="$ROOT/model_repository" grpc=8001 http=8000 metrics=8002 mode="" load=""
  local extra=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --model-control-mode|--model-control-mode=*) mode=1; extra+=("$1"); shift ;;
      --load-model|--load-model=*) load=1; extra+=("$1"); shift ;;
      --model-repository|--model-store) repo="$2"; shift 2 ;;
      --model-repository=*|--model-store=*) repo="${1#*=}"; shift ;;
      --grpc-port) grpc="$2"; shift 2 ;;
      --grpc-port=*) grpc="${1#*=}"; shift ;;
      --http-port) http="$2"; shift 2 ;;
      --http-port=*) http="${1#*=}"; shift ;;
      --metrics-port) metrics="$2"; shift 2 ;;
      --metrics-port=*) metrics="${1#*=}"; shift ;;
      *) extra+=("$1"); shift ;;
    esac
  done
  if [ -z "$mode" ]; then
    extra+=("--model-control-mode=explicit")
    [ -n "$load" ] || extra+=("--load-model=*")
  fi
  default_model_dir
  repository_key
  extra+=("--http-restricted-api=$RESTRICTED_APIS:$REPOSITORY_KEY_HEADER=$REPOSITORY_KEY"
          "--grpc-restricted-protocol=$RESTRICTED_APIS:$REPOSITORY_KEY_HEADER=$REPOSITORY_KEY")
  server_env
  log "tritonserver: repository $repo, gRPC :$grpc, HTTP :$http, metrics :$metrics (models under $M3SERVE_MODEL_DIR)"
  exec "$TRITONSERVER" --model-repository "$repo" --backend-directory "$TRITON_DIR/backends" \
    --grpc-port "$grpc" --http-port "$http" --metrics-port "$metrics" ${extra[@]+"${extra[@]}"}
}

# SIGTERM the process group (server + stubs), wait for the server to unload, then SIGKILL what is left
stop_group() {
  kill -TERM -- "-$1" 2>/dev/null || return 0
  local i
  for i in $(seq 1 60); do kill -0 "$1" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$1" 2>/dev/null || true
}

free_port() { "$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# The learned model (models/m3-tiny-learned) when it is there: a copy of the default repository naming it, with
# special tokens kept in the ensemble's text (the tool-call markup is made of them); else the tiny random model.
demo() {
  setup
  local learned="$ROOT/models/m3-tiny-learned" repo="$ROOT/model_repository" grpc http metrics logf pid
  if [ -f "$learned/config.json" ]; then
    repo="$ROOT/.cache/demo-repository"
    rm -rf "$repo" && cp -r "$ROOT/model_repository" "$repo"
    sed -i 's/"tiny-m3"/"m3-tiny-learned"/' "$repo"/*/1/model.json "$repo"/*/config.pbtxt
    sed -i '/"skip_special_tokens"/s/"true"/"false"/' "$repo/postprocessing/config.pbtxt"
    mkdir -p "$ROOT/.cache/demo-models"
    ln -sfn "$learned" "$ROOT/.cache/demo-models/m3-tiny-learned"
    export M3SERVE_MODEL_DIR="$ROOT/.cache/demo-models"
    "$VENV/bin/python" -c 'import json; from m3serve.learn.tasks import tool_schemas; print(json.dumps(tool_schemas()[:3]))' \
      >"$ROOT/.cache/demo-tools.json"
  else
    log "no learned checkpoint at models/m3-tiny-learned (config.json missing): serving the tiny random model instead," \
      "whose replies are random text"
    tiny
    "$VENV/bin/m3serve" generate --model "$TINY" --prompt-ids 5,7,9 --prompt-ids 11,12 \
      --max-tokens 16 --temperature 0 --device cpu --dtype float32 --speculative-config \
      '{"method": "dspark", "num_speculative_tokens": 7, "draft_sample_method": "probabilistic", "kv_cache_dtype": "fp8"}'
  fi
  grpc="$(free_port)"; http="$(free_port)"; metrics="$(free_port)"
  logf="$ROOT/.cache/demo-server.log"
  mkdir -p "$ROOT/.cache"
  log "starting tritonserver (log: $logf)"
  setsid "$ROOT/build.sh" serve --model-repository "$repo" --grpc-port "$grpc" --http-port "$http" \
    --metrics-port "$metrics" >"$logf" 2>&1 &
  pid=$!
  # shellcheck disable=SC2064
  trap "stop_group $pid" EXIT
  local stream=("$VENV/bin/python" "$ROOT/clients/stream.py" --url "localhost:$grpc" --wait-ready 180)
  if [ "$repo" = "$ROOT/model_repository" ]; then
    "${stream[@]}" --max-tokens 48 --ignore-eos --chat "What is the weather like in Paris today?" || {
      log "the demo failed; server log follows"; tail -n 60 "$logf" >&2; return 1; }
    return 0
  fi
  local out="$ROOT/.cache/demo-replies.txt"
  log "the learned model: an arithmetic question (347 + 85 = 432), then a tool call"
  { "${stream[@]}" --max-tokens 16 --thinking disabled --temperature 0 --chat "What is 347 + 85?" &&
    "${stream[@]}" --max-tokens 96 --thinking disabled --temperature 0 --tools "$ROOT/.cache/demo-tools.json" \
      --chat "What is the weather in Oslo for the next 3 days?"; } | tee "$out" || {
    log "the demo failed; server log follows"; tail -n 60 "$logf" >&2; return 1; }
  if ! grep -qx "432" "$out" || ! grep -q '"tool_calls": \[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\]' "$out"; then
    log "the learned model did not answer correctly (see above)"; return 1
  fi
  log "both answers are correct"
}

# The package graph of docs/architecture.md (the contracts in pyproject.toml's [tool.importlinter]). import-linter
# reads the package from where `m3serve` is found, and the editable install maps m3serve.kernels (kernels/) apart
# from m3serve (backend/): so it reads a throwaway tree, m3serve/ linking backend/'s entries and kernels/.
lint_imports() {
  local view
  view="$(mktemp -d)"
  mkdir "$view/m3serve"
  ln -s "$ROOT"/backend/* "$view/m3serve/"
  ln -s "$ROOT/kernels" "$view/m3serve/kernels"
  local rc=0
  PYTHONPATH="$view" "$VENV/bin/lint-imports" --no-cache --no-logo || rc=$?
  rm -rf "$view"
  return "$rc"
}

genai_perf_setup() {
  local want="${GENAI_PERF_PKGS[*]} $LIBB64_SHA256" deb libs
  if [ -x "$GENAI_PERF/bin/genai-perf" ] && [ "$(cat "$GENAI_PERF/.stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  log "installing genai-perf into $GENAI_PERF"
  rm -rf "$GENAI_PERF" && mkdir -p "$GENAI_PERF/bin" "$GENAI_PERF/deb"
  "$PY" -m venv "$GENAI_PERF/venv"
  "$GENAI_PERF/venv/bin/python" -m pip install -q --disable-pip-version-check "${GENAI_PERF_PKGS[@]}"
  deb="$GENAI_PERF/deb/libb64.deb"
  "$GENAI_PERF/venv/bin/python" -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' \
    "$LIBB64_DEB" "$deb"
  if [ "$(sha256sum "$deb" | cut -d' ' -f1)" != "$LIBB64_SHA256" ]; then
    log "error: $LIBB64_DEB does not have the pinned sha256"; return 1
  fi
  "$GENAI_PERF/venv/bin/python" - "$deb" "$GENAI_PERF/deb/x" <<'PY'  # a .deb is an ar archive; no dpkg needed
import io, sys, tarfile
blob, at = open(sys.argv[1], "rb").read(), 8
while at < len(blob):
    name, size = blob[at:at + 16].strip().decode(), int(blob[at + 48:at + 58])
    if name.startswith("data.tar"):
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.10.12
        tarfile.open(fileobj=io.BytesIO(blob[at + 60:at + 60 + size])).extractall(sys.argv[2], **safe)
    at += 60 + size + size % 2
PY
  libs="$(dirname "$(find "$GENAI_PERF/venv" -name 'libcudart.so.12' | head -n 1)"):$GENAI_PERF/deb/x/usr/lib/x86_64-linux-gnu"
  printf '%s\n' '#!/usr/bin/env bash' '# genai-perf, perf_analyzer on PATH and its libraries found (written by build.sh)' \
    "export PATH=\"$GENAI_PERF/venv/bin:\$PATH\" HF_HUB_OFFLINE=1" \
    "export LD_LIBRARY_PATH=\"$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\"" \
    "exec \"$GENAI_PERF/venv/bin/genai-perf\" \"\$@\"" > "$GENAI_PERF/bin/genai-perf"
  chmod 755 "$GENAI_PERF/bin/genai-perf"
  local usage  # perf_analyzer --help exits 99; a library it cannot load exits before the usage text
  usage="$(LD_LIBRARY_PATH="$libs" "$GENAI_PERF/venv/bin/perf_analyzer" --help 2>&1 || true)"
  if ! grep -q -- "--service-kind" <<<"$usage"; then
    log "error: perf_analyzer does not start: $(head -n 3 <<<"$usage")"; return 1
  fi
  echo "$want" > "$GENAI_PERF/.stamp"
}

# The suite through tests/run_suite.py: one pytest process without a GPU; with one, tests/kernels (interpreter)
# and the rest (compiled kernels, tests/gpu included) in two. transformers and the server wheel are required
# (tests/support/required.py): a missing one fails the run.
run_tests() {
  setup
  lint_imports
  genai_perf_setup  # for tests/gateway/test_genai_perf.py
  export USE_HUB_KERNELS=0 OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
  "$VENV/bin/python" tests/run_suite.py -q -p no:cacheprovider "$@"
}

cmd="${1:-}"
shift || true
case "$cmd" in
  setup) setup ;;
  assemble) assemble_backend ;;
  serve) serve "$@" ;;
  demo) demo "$@" ;;
  test) run_tests "$@" ;;
  lint-imports) lint_imports ;;
  genai-perf) genai_perf_setup && "$GENAI_PERF/bin/genai-perf" "$@" ;;
  *) echo "usage: $0 {setup|serve|demo|test|lint-imports|assemble|genai-perf} [args]" >&2; exit 2 ;;
esac
