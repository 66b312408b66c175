#!/usr/bin/env bash
# One device call on a GPU machine that has torch + triton but not this package installed (the lent H200): lay the
# package out under /tmp/p (m3serve = backend/, m3serve.kernels = kernels/; LAYOUT=0 keeps the layout of another run
# of this script still going on the machine), then run the steps named in $STEPS (default "tests msa qkv"). Logs and
# JSON go to $OUT (or ./device_out). `*_ARGS` are word-split: no spaces inside one argument.
#
# Kernels and the engine:
#   tests      pytest $TESTS (default tests/gpu), -k "$TESTS_K" where set (one argument, spaces kept); $SANITIZER
#              prefixes its python (e.g. "compute-sanitizer --tool memcheck --error-exitcode 9")
#   memcheck   compute-sanitizer memcheck over each of $MEMCHECK_FILES (default: the kernel GPU test files), each in
#              its own process, $MEMCHECK_JOBS at once, with PyTorch's caching allocator off
#              (PYTORCH_NO_CUDA_MEMORY_CACHING=1: each tensor its own cudaMalloc, so an access past a tensor's end is
#              past an allocation's end, which memcheck sees; inside a cached segment it would not), then the file's
#              `cuda_graph` tests (nothing can be allocated while capturing without that allocator) with it on; a
#              line per pass (pytest's summary, memcheck's error count), the logs in $OUT/memcheck.tgz. Six files at
#              once, and four, ran the sanitizer out of memory on an 80 GB H100 (2026-12-06): keep MEMCHECK_JOBS at 1.
#              $MEMCHECK_OPTS (word-split) go to compute-sanitizer before the program (e.g. a --kernel-name filter);
#              -k "$MEMCHECK_K" selects tests (test_nvfp4_mma_gpu's 17 kernel tests took 500 s, its engine test more:
#              "not engine" then "engine", H100, 2026-12-07)
#   msa, qkv, moe, markov   benchmarks/bench_{msa,qkv,moe,markov}.py $MSA_ARGS ... ("markov": DSpark's greedy Markov
#              phase, fused kernels vs the torch loop, both in CUDA graphs)
#   engine     benchmarks/bench_engine.py $ENGINE_ARGS; spec: benchmarks/bench_spec.py $SPEC_ARGS
#   prefill    benchmarks/bench_prefill.py $PREFILL_ARGS (the MoE layer and quantized linears at prefill sizes, decode
#              kernels vs decode-once-then-cuBLAS, TTFT as a share of the bf16 GEMM rate)
#   itl        benchmarks/bench_itl.py $ITL_ARGS (ITL p50 / p99 of 64 decoding streams alone and while a 32K prompt
#              is prefilled in chunks beside them, per chunk size)
#   tp         (multi-GPU kinds) benchmarks/bench_tp.py $TP_ARGS: TP / EP parity over NCCL, all-reduce cost
#   rank       benchmarks/bench_rank.py $RANK_ARGS: rank 0 of TP 4 at 60 layers on one GPU (after "tp":
#              RANK_ARGS="--allreduce $OUT/bench_tp.json")
# Through the real tritonserver (need .carry-server, below):
#   server     benchmarks/bench_server.py --geometry $SERVER_LAYERS $SERVER_ARGS: the M3.1-Flash geometry vs
#              engine-direct (SERVER_ARGS="--speculative 7 --concurrency 1,16" adds DSpark on vs off)
#   soak       benchmarks/soak_server.py --geometry $SERVER_LAYERS $SOAK_ARGS: streams with random cancellation
#   gateway    benchmarks/bench_gateway.py --geometry $SERVER_LAYERS $GATEWAY_ARGS: the OpenAI gateway vs gRPC direct
#   suite      the whole test suite as `./build.sh test` runs it: lint-imports, then tests/run_suite.py $SUITE_ARGS
#              (tests/kernels in the interpreter beside the rest with compiled kernels), all of it in $OUT/suite.log
# The learned model (transformers 5.25 from .carry-reference/ or the wheels in .whl/, into /tmp/site):
#   trainops   benchmarks/bench_train_ops.py $TRAINOPS_ARGS (eager vs captured as a CUDA graph)
#   train      `m3serve train-learned --out /tmp/m3-tiny-learned --pack $OUT $TRAIN_ARGS`; where .ckpt/ holds a
#              packed checkpoint (part-aa ..., an earlier call's $OUT; gitignored, so name it in carry), the run goes
#              on from its weights (add "--dense-frac 0 --sparse-ramp-frac 0" to TRAIN_ARGS)
#   evaltasks  `m3serve eval-tasks` (bf16, $EVAL_ARGS, default "--n 50 --paths engine dspark-greedy") into eval.json
#   learnedspec    benchmarks/bench_learned_spec.py $LSPEC_ARGS: DSpark vs plain on the eval tasks, batch 1 and 8
#   learnedserver  benchmarks/bench_learned_server.py $LSERVER_ARGS: the same through tritonserver (m3 vs m3_spec)
#   The last four take the checkpoint of "train" in this call, else $EVAL_MODEL / $LSPEC_MODEL / $LSERVER_MODEL, else
#   .ckpt/'s, else the committed models/m3-tiny-learned.
# Carries (each made here by its benchmarks/make_carry_*.sh; a call's tree and carries must fit 64 MiB):
#   .carry-server/     site312.tar.xz (numpy 1.26.4 -- numpy 2 empties the 2.51 python backend's outputs --,
#                      tritonclient, python-rapidjson), pytriton312.tar.xz (the nvidia-pytriton 0.7.0 wheel's files:
#                      tritonserver), gateway312.tar.xz (FastAPI, uvicorn, ...; make_carry_gateway.sh)
#   .carry-reference/  transformers 5.25 for Python 3.12
#   .carry-tests/      suite312.tar.xz (import-linter, pip 25.3), gwtests312.tar.xz (openai, schemathesis): what
#                      "suite" needs beyond the image. The README's command takes two calls: SUITE_ARGS=
#                      "--ignore=tests/gateway" with .carry-server's three tars (tests/unit imports the gateway:
#                      FastAPI, pydantic), .carry-reference, .carry-model and suite312 (63 MiB with the tree); then
#                      SUITE_ARGS=tests/gateway with .carry-server's tars, suite312 and gwtests312
#   .carry-model/      the learned checkpoint as an 18 MiB xz, unpacked where models/m3-tiny-learned is missing (move
#                      that folder out for a call that carries .carry-server and .carry-reference)
#   .carry-baseline/   an earlier commit's package, to time a benchmark on it and on the tree in one call
#
#   STEPS="tests msa" MSA_ARGS="--dtypes nvfp4" bash benchmarks/device_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# the learned checkpoint left out of the tree to fit a call's 64 MiB (benchmarks/make_carry_model.sh) comes back here
if [ ! -f models/m3-tiny-learned/config.json ] && [ -f .carry-model/m3-tiny-learned.tar.xz ]; then
  mkdir -p models && tar -xJf .carry-model/m3-tiny-learned.tar.xz -C models
fi
OUT="${OUT:-$PWD/device_out}"
mkdir -p "$OUT" /tmp/p/m3serve
if [ "${LAYOUT:-1}" = 1 ]; then  # LAYOUT=0: another run of this script on the machine laid it out and still imports it
  cp -r backend/. /tmp/p/m3serve/ && rm -rf /tmp/p/m3serve/kernels && cp -r kernels /tmp/p/m3serve/kernels
fi
export PYTHONPATH=/tmp/p PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
# the python backend's stub does not see PYTHONPATH (2026-12-03 on the H200: neither /tmp/p's m3serve nor numpy 1.26
# from /tmp/site reached it, and numpy 2 empties the outputs it builds): numpy 1.26, tritonclient and the package go
# into site-packages itself (the machine is a throw-away copy), with the gateway's packages where they travel
PURELIB="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
install_server() {
  if [ -d .carry-server ]; then
    rm -rf "$PURELIB"/numpy "$PURELIB"/numpy-*.dist-info "$PURELIB"/numpy.libs
    # the image's scipy is built for numpy 2, and transformers imports it where it is installed (its detection
    # losses, at import): beside numpy 1.26 that failed (2026-12-06). CI's environment has no scipy either.
    rm -rf "$PURELIB"/scipy "$PURELIB"/scipy-*.dist-info "$PURELIB"/scipy.libs
    tar -xJf .carry-server/site312.tar.xz -C "$PURELIB"
    tar -xJf .carry-server/pytriton312.tar.xz -C "$PURELIB"
    [ -f .carry-server/gateway312.tar.xz ] && tar -xJf .carry-server/gateway312.tar.xz -C "$PURELIB"
  fi
  rm -rf "$PURELIB/m3serve" && cp -r /tmp/p/m3serve "$PURELIB/m3serve"
  python3 -c 'import numpy; print("numpy", numpy.__version__)'
}
unpack_ckpt() {  # .ckpt/part-* (a packed checkpoint: an earlier call's $OUT) into /tmp/ckpt; prints its folder
  rm -rf /tmp/ckpt && mkdir -p /tmp/ckpt && cat .ckpt/part-* | tar -x -C /tmp/ckpt
  echo "/tmp/ckpt/$(ls /tmp/ckpt)"
}
learned_model() {  # $1 (else the train step's /tmp/m3-tiny-learned); where it is missing, .ckpt/'s packed checkpoint,
  local model="${1:-/tmp/m3-tiny-learned}"  # else the committed models/m3-tiny-learned
  [ ! -d "$model" ] && ls .ckpt/part-* >/dev/null 2>&1 && model="$(unpack_ckpt)"
  [ ! -d "$model" ] && model="models/m3-tiny-learned"
  echo "$model"
}
reference_site() {  # transformers 5.25 into /tmp/site, once: .carry-reference's tar (make_carry_reference.sh), else
  [ -f /tmp/site/.done ] && return  # the wheels in .whl/
  mkdir -p /tmp/site
  if [ -f .carry-reference/reference312.tar.xz ]; then
    tar -xJf .carry-reference/reference312.tar.xz -C /tmp/site
  elif [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  fi
  touch /tmp/site/.done
}
for step in ${STEPS:-tests msa qkv}; do
  case "$step" in
    tests) reference_site  # tests/gpu/test_learned_gpu.py trains transformers' model
           PYTHONPATH=/tmp/p:/tmp/site USE_HUB_KERNELS=0 timeout "${TEST_TIMEOUT:-300}" ${SANITIZER:-} python3 -m pytest -q \
             -rfE -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} ${TESTS:-tests/gpu} 2>&1 | tee "$OUT/gpu_tests.log" \
             | tail -25 ;;
    memcheck)  # $MEMCHECK_JOBS files at once (default 1); logs in /tmp/memcheck, packed into $OUT/memcheck.tgz
      mkdir -p /tmp/memcheck
      # the probe must make a CUDA call: under `true` the sanitizer fails whatever its options ("Target application
      # terminated before first instrumented API call", which dropped valid options on the H100, 2026-12-06)
      if [ -n "${MEMCHECK_OPTS:-}" ] && ! compute-sanitizer --tool memcheck ${MEMCHECK_OPTS} \
          python3 -c "import torch; torch.ones(1, device='cuda').sum().item()" > /tmp/memcheck/opts.log 2>&1; then
        echo "compute-sanitizer refused MEMCHECK_OPTS=$MEMCHECK_OPTS: running without them"
        head -5 /tmp/memcheck/opts.log
        MEMCHECK_OPTS=""
      fi
      files=(${MEMCHECK_FILES:-tests/gpu/test_kernels_gpu.py tests/gpu/test_odd_shapes_gpu.py tests/gpu/test_dequant_gemm_gpu.py tests/gpu/test_nvfp4_mma_gpu.py tests/gpu/test_markov_gpu.py tests/gpu/test_moe_gpu.py})
      memcheck_pass() {  # LOG LABEL PYTEST-ARGS...: pytest under memcheck; a line: its summary and the error count
        local log="$1" label="$2"
        shift 2
        PYTHONPATH=/tmp/p timeout "${MEMCHECK_TIMEOUT:-300}" compute-sanitizer --tool memcheck --print-limit 20 \
          ${MEMCHECK_OPTS:-} python3 -m pytest -q -rs -p no:cacheprovider ${MEMCHECK_K:+-k "$MEMCHECK_K"} "$@" \
          > "$log" 2>&1
        echo "$label: rc $? | $(grep -E ' in [0-9.]+s' "$log" | tail -1) | $(grep 'ERROR SUMMARY' "$log" | head -1)"
      }
      memcheck_file() {  # the file with the caching allocator off (its cuda_graph tests skip: nothing can be
        local f="$1" log="/tmp/memcheck/$(basename "$1" .py)"  # allocated while capturing), then those tests with it on
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 memcheck_pass "$log.log" "$f" "$f" > "$log.line"
        if grep -q "mark.cuda_graph" "$f"; then
          memcheck_pass "$log.graphs.log" "$f -m cuda_graph (caching allocator on)" -m cuda_graph "$f" >> "$log.line"
        fi
      }
      for f in "${files[@]}"; do
        while [ "$(jobs -rp | wc -l)" -ge "${MEMCHECK_JOBS:-1}" ]; do sleep 1; done
        memcheck_file "$f" &
      done
      wait
      for f in "${files[@]}"; do cat "/tmp/memcheck/$(basename "$f" .py).line"; done
      tar -czf "$OUT/memcheck.tgz" -C /tmp memcheck ;;
    trainops) reference_site
      PYTHONPATH=/tmp/p:/tmp/site USE_HUB_KERNELS=0 timeout "${TRAINOPS_TIMEOUT:-240}" python3 \
        benchmarks/bench_train_ops.py --out "$OUT/bench_train_ops.json" \
        ${TRAINOPS_ARGS:---rows 256 --len 512 --steps 5 --graphs --no-compiled} 2>&1 | tail -60 ;;
    msa) timeout "${MSA_TIMEOUT:-300}" python3 benchmarks/bench_msa.py --out "$OUT/bench_msa.json" ${MSA_ARGS:-} 2>&1 \
           | tee "$OUT/bench_msa.log" | grep -v "^decode \|^prefill {\|^insert {" ;;
    qkv) timeout "${QKV_TIMEOUT:-200}" python3 benchmarks/bench_qkv.py --out "$OUT/bench_qkv.json" ${QKV_ARGS:-} 2>&1 \
           | tee "$OUT/bench_qkv.log" | tail -30 ;;
    moe) timeout "${MOE_TIMEOUT:-300}" python3 benchmarks/bench_moe.py --out "$OUT/bench_moe.json" ${MOE_ARGS:-} 2>&1 \
           | tee "$OUT/bench_moe.log" | grep -v '^{' ;;
    prefill) timeout "${PREFILL_TIMEOUT:-420}" python3 benchmarks/bench_prefill.py --out "$OUT/bench_prefill.json" \
               ${PREFILL_ARGS:-} 2>&1 | tee "$OUT/bench_prefill.log" | grep -v '^{' ;;
    itl) timeout "${ITL_TIMEOUT:-300}" python3 benchmarks/bench_itl.py --out "$OUT" ${ITL_ARGS:-} 2>&1 \
           | tee "$OUT/bench_itl.log" | grep -v "^\[compile\]" ;;
    engine) timeout "${ENGINE_TIMEOUT:-400}" python3 benchmarks/bench_engine.py --out "$OUT" ${ENGINE_ARGS:-} 2>&1 \
           | tee "$OUT/bench_engine.log" | grep -v "^  " ;;
    markov) timeout "${MARKOV_TIMEOUT:-300}" python3 benchmarks/bench_markov.py --out "$OUT/bench_markov.json" \
              ${MARKOV_ARGS:-} 2>&1 | tee "$OUT/bench_markov.log" | tail -12 ;;
    spec) timeout "${SPEC_TIMEOUT:-540}" python3 benchmarks/bench_spec.py --out "$OUT/bench_spec.json" \
            ${SPEC_ARGS:-} 2>&1 | tee "$OUT/bench_spec.log" | tail -30 ;;
    server)
      install_server
      M3SERVE_PYTHON="$(command -v python3)" M3SERVE_TRITON_DIR=/tmp/triton \
        M3SERVE_BENCH_WORK=/tmp/bench_server_work timeout "${SERVER_TIMEOUT:-300}" python3 benchmarks/bench_server.py \
        --out "$OUT/server" --geometry "${SERVER_LAYERS:-4}" ${SERVER_ARGS:-} 2>&1 | tee "$OUT/bench_server.log" \
        | grep -v "^I1\|^W1" | tail -20 ;;
    suite)  # the README's test command (./build.sh test) without a venv: lint-imports, then tests/run_suite.py
      install_server
      reference_site
      for t in .carry-tests/*.tar.xz; do [ -f "$t" ] && tar -xJf "$t" -C /tmp/site; done  # make_carry_tests.sh
      export PYTHONPATH=/tmp/p:/tmp/site
      python3 -c 'from importlinter.cli import lint_imports_command; lint_imports_command()' --no-cache --no-logo \
        2>&1 | tee "$OUT/suite.log" | tail -3
      # genai-perf's venv (build.sh genai_perf_setup: hundreds of MB, from PyPI) cannot travel, and the pin check
      # resolves against PyPI, which the machine cannot reach: those tests are optional here (skipped, saying why)
      M3SERVE_TEST_OPTIONAL="${M3SERVE_TEST_OPTIONAL-genai-perf,index}" M3SERVE_PYTHON="$(command -v python3)" \
        M3SERVE_TRITON_DIR=/tmp/triton M3SERVE_SUITE_LOG_DIR=/tmp/suite \
        M3SERVE_SUITE_SHARDS="${SUITE_SHARDS:-8}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
        USE_HUB_KERNELS=0 timeout "${SUITE_TIMEOUT:-560}" python3 tests/run_suite.py -q -rs -p no:cacheprovider \
        ${SUITE_ARGS:-} 2>&1 | tee -a "$OUT/suite.log" | grep -v "^\[run_suite\] ----\|^I1\|^W1" | tail -60 ;;
    gateway)  # the OpenAI gateway vs gRPC direct through one tritonserver; .carry-server/gateway312.tar.xz holds
              # FastAPI, uvicorn, sse-starlette, pydantic, httpx2 ... for Python 3.12 (benchmarks/make_carry_gateway.sh)
      install_server
      M3SERVE_PYTHON="$(command -v python3)" M3SERVE_TRITON_DIR=/tmp/triton timeout "${GATEWAY_TIMEOUT:-400}" \
        python3 benchmarks/bench_gateway.py --device cuda --geometry "${SERVER_LAYERS:-4}" --out "$OUT/gateway" \
        ${GATEWAY_ARGS:-} 2>&1 | tee "$OUT/bench_gateway.log" | grep -v "^I1\|^W1" | tail -20 ;;
    soak)
      install_server
      M3SERVE_PYTHON="$(command -v python3)" M3SERVE_TRITON_DIR=/tmp/triton timeout "${SOAK_TIMEOUT:-560}" \
        python3 benchmarks/soak_server.py --out "$OUT/soak" --geometry "${SERVER_LAYERS:-4}" ${SOAK_ARGS:-} 2>&1 \
        | tee "$OUT/soak_server.log" | grep -v "^I1\|^W1" | tail -20 ;;
    tp) timeout "${TP_TIMEOUT:-500}" python3 benchmarks/bench_tp.py --out "$OUT/bench_tp.json" ${TP_ARGS:-} 2>&1 \
          | tee "$OUT/bench_tp.log" | grep "^|" ;;
    rank) CUDA_VISIBLE_DEVICES="${RANK_GPU:-0}" timeout "${RANK_TIMEOUT:-450}" python3 benchmarks/bench_rank.py \
            --out "$OUT/rank" ${RANK_ARGS:-} 2>&1 | tee "$OUT/bench_rank.log" | tail -40 ;;
    train)
      reference_site
      init=()
      ls .ckpt/part-* >/dev/null 2>&1 && init=(--init-from "$(unpack_ckpt)")
      PYTHONPATH=/tmp/p:/tmp/site USE_HUB_KERNELS=0 timeout "${TRAIN_TIMEOUT:-580}" python3 -m m3serve.cli \
        train-learned --out /tmp/m3-tiny-learned --pack "$OUT" "${init[@]}" ${TRAIN_ARGS:-} > "$OUT/train.log" 2>&1
      grep -v '^\[ *[0-9.]*s\] \(target\|draft\) {' "$OUT/train.log" | grep -v "Loading weights" | tail -25 ;;
    evaltasks)
      reference_site
      model="$(learned_model "${EVAL_MODEL:-}")"
      PYTHONPATH=/tmp/p:/tmp/site USE_HUB_KERNELS=0 timeout "${EVAL_TIMEOUT:-120}" python3 -m m3serve.cli eval-tasks \
        --model "$model" --device cuda --dtype bfloat16 --out "$OUT/eval.json" \
        ${EVAL_ARGS:---n 50 --paths engine dspark-greedy} > "$OUT/eval.log" 2>&1; tail -20 "$OUT/eval.log" ;;
    learnedspec)
      reference_site
      model="$(learned_model "${LSPEC_MODEL:-}")"
      PYTHONPATH=/tmp/p:/tmp/site USE_HUB_KERNELS=0 timeout "${LSPEC_TIMEOUT:-240}" python3 \
        benchmarks/bench_learned_spec.py --model "$model" --device cuda --dtype bfloat16 \
        --out "$OUT/bench_learned_spec.json" ${LSPEC_ARGS:-} > "$OUT/bench_learned_spec.log" 2>&1
      tail -25 "$OUT/bench_learned_spec.log" ;;
    learnedserver)  # DSpark vs plain through tritonserver on the learned model's tasks (issue 28)
      install_server
      model="$(learned_model "${LSERVER_MODEL:-}")"
      M3SERVE_PYTHON="$(command -v python3)" M3SERVE_TRITON_DIR=/tmp/triton timeout "${LSERVER_TIMEOUT:-400}" \
        python3 benchmarks/bench_learned_server.py --model "$model" --device cuda --dtype bfloat16 \
        --out "$OUT/learned_server" ${LSERVER_ARGS:-} 2>&1 | tee "$OUT/bench_learned_server.log" \
        | grep -v "^I1\|^W1" | tail -25 ;;
    *) echo "unknown step $step" ;;
  esac
done
