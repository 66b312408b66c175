#!/usr/bin/env bash
# One device call on a GPU machine that has torch + triton but not this package installed (the lent H200):
# lay the package out under /tmp/p (m3serve = backend/, m3serve.kernels = kernels/), then run the steps named
# in $STEPS (default "tests msa qkv"): the GPU tests, benchmarks/bench_msa.py $MSA_ARGS,
# benchmarks/bench_qkv.py $QKV_ARGS, benchmarks/bench_moe.py $MOE_ARGS ("moe"), benchmarks/bench_engine.py
# $ENGINE_ARGS ("engine"), benchmarks/bench_spec.py $SPEC_ARGS ("spec"), benchmarks/bench_markov.py
# $MARKOV_ARGS ("markov": DSpark's greedy Markov phase, fused kernels vs the torch loop, both in CUDA graphs),
# benchmarks/bench_prefill.py $PREFILL_ARGS
# ("prefill": MoE layer and quantized linears at prefill sizes, decode kernels vs decode-once-then-cuBLAS, TTFT as a
# share of the bf16 GEMM rate), benchmarks/bench_itl.py $ITL_ARGS ("itl": ITL p50 / p99 of 64 decoding streams alone
# and while a 32K prompt is prefilled in chunks beside them, per chunk size), and on a multi-GPU kind "tp":
# benchmarks/bench_tp.py $TP_ARGS (TP / EP parity over NCCL, all-reduce cost), "rank": benchmarks/bench_rank.py
# $RANK_ARGS (rank 0 of TP 4 at 60 layers on one GPU; after "tp": RANK_ARGS="--allreduce $OUT/bench_tp.json"), and "server":
# benchmarks/bench_server.py --geometry $SERVER_LAYERS $SERVER_ARGS (the M3.1-Flash geometry through the real
# tritonserver vs engine-direct; SERVER_ARGS="--speculative 7 --concurrency 1,16" adds DSpark on vs off),
# and "suite": the whole test suite as `./build.sh test` runs it (tests/run_suite.py:
# tests/kernels in the interpreter beside the rest with compiled kernels; logs in $OUT/suite). Logs and JSON go to
# $OUT (or ./device_out).
# "server" needs tritonserver and numpy<2 where the machine has neither (the lent H200): .carry-server/ holds
# site312.tar.xz (numpy 1.26.4, tritonclient, python-rapidjson, unpacked onto PYTHONPATH) and pytriton312.tar.xz
# (the nvidia-pytriton 0.7.0 wheel's files for Python 3.12, unpacked into site-packages), made here from the wheels
# by benchmarks/make_carry_server.sh (cut down so that they fit one call's 64 MiB beside the tree).
# "suite" also takes .carry-reference/reference312.tar.xz (transformers 5.25 for Python 3.12, onto PYTHONPATH; made by
# benchmarks/make_carry_reference.sh), as "train", "evaltasks" and "learnedspec" do (or the wheels in .whl/); with
# both carries the tree is over a call's 64 MiB, so the learned checkpoint travels as .carry-model/ then
# (benchmarks/make_carry_model.sh).
# tritonserver vs engine-direct), "soak": benchmarks/soak_server.py --geometry $SERVER_LAYERS $SOAK_ARGS (streams
# with random cancellation through the real tritonserver), "gateway": benchmarks/bench_gateway.py --geometry
# $SERVER_LAYERS $GATEWAY_ARGS (the OpenAI gateway vs gRPC direct). Logs and JSON go to $OUT (or ./device_out).
# "server" and "soak" need tritonserver and numpy<2 where the machine has neither (the lent H200): .carry-server/ holds
# site312.tar.xz (numpy 1.26.4, tritonclient, python-rapidjson, unpacked onto PYTHONPATH) and pytriton312.tar.xz
# (the nvidia-pytriton 0.7.0 wheel's files for Python 3.12, unpacked into site-packages):
# benchmarks/make_carry_server.sh makes both.
# "trainops": benchmarks/bench_train_ops.py $TRAINOPS_ARGS (default: 8 rows of 512 tokens, eager vs captured as
# a CUDA graph; `--modes eager,graphed+grouped,...` picks the steps and experts paths) into
# $OUT/bench_train_ops.json, with transformers as "train" has it.
# "train": `m3serve train-learned --out /tmp/m3-tiny-learned --pack $OUT $TRAIN_ARGS` (the learned tiny model, issue
# 27), with transformers 5.25 from .carry-reference/ or .whl/ (into /tmp/site); where .ckpt/ holds a packed checkpoint
# (part-aa ..., an earlier call's $OUT; .ckpt/ is gitignored, so name it in the call's carry), it is unpacked to
# /tmp/ckpt and the run goes on from its weights (add "--dense-frac 0 --sparse-ramp-frac 0" to TRAIN_ARGS).
# "evaltasks": `m3serve eval-tasks` on that checkpoint (or on $EVAL_MODEL; where neither exists, on .ckpt/'s, else on
# the committed models/m3-tiny-learned) on the GPU
# (bf16, $EVAL_ARGS, default "--n 50 --paths engine dspark-greedy") into $OUT/eval.json. "learnedspec":
# benchmarks/bench_learned_spec.py on that checkpoint (or on $LSPEC_MODEL; where neither exists, on .ckpt/'s packed
# one, unpacked to /tmp/ckpt) $LSPEC_ARGS (DSpark vs plain tok/s on its eval tasks at batch 1 and 8, bf16) into
# $OUT/bench_learned_spec.json. "learnedserver": benchmarks/bench_learned_server.py on the same checkpoint (or
# $LSERVER_MODEL) $LSERVER_ARGS: DSpark vs plain through tritonserver (`m3` vs `m3_spec`) into $OUT/learned_server/.
# $SANITIZER prefixes the GPU tests' python, e.g. "compute-sanitizer --tool memcheck --error-exitcode 9".
# "memcheck": compute-sanitizer memcheck over each of $MEMCHECK_FILES (default: the kernel GPU test files) in its own
# process, with PyTorch's caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1: each tensor its own cudaMalloc, so
# an access past a tensor's end is past an allocation's end, which memcheck sees; inside a cached segment it would
# not); one log per file in $OUT/memcheck/ and a line per file: pytest's summary and memcheck's error count. Under
# memcheck the M3-sized MoE layers of test_moe_gpu.py ran out of memory on an 80 GB H100 (docs/performance.md):
# that file wants an H200 (run's needs_h200).
#   STEPS="tests msa" MSA_ARGS="--dtypes nvfp4" bash benchmarks/device_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# the learned checkpoint left out of the tree to fit a call's 64 MiB (benchmarks/make_carry_model.sh) comes back here
if [ ! -f models/m3-tiny-learned/config.json ] && [ -f .carry-model/m3-tiny-learned.tar.xz ]; then
  mkdir -p models && tar -xJf .carry-model/m3-tiny-learned.tar.xz -C models
fi
OUT="${OUT:-$PWD/device_out}"
mkdir -p "$OUT" /tmp/p/m3serve
cp -r backend/. /tmp/p/m3serve/ && rm -rf /tmp/p/m3serve/kernels && cp -r kernels /tmp/p/m3serve/kernels
export PYTHONPATH=/tmp/p PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
# the python backend's stub does not see PYTHONPATH (2026-12-03 on the H200: neither /tmp/p's m3serve nor numpy 1.26
# from /tmp/site reached it, and numpy 2 empties the outputs it builds): numpy 1.26, tritonclient and the package go
# into site-packages itself (the machine is a throw-away copy)
install_server() {
  local purelib
  purelib="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  if [ -d .carry-server ]; then
    rm -rf "$purelib"/numpy "$purelib"/numpy-*.dist-info "$purelib"/numpy.libs
    tar -xJf .carry-server/site312.tar.xz -C "$purelib"
    tar -xJf .carry-server/pytriton312.tar.xz -C "$purelib"
  fi
  rm -rf "$purelib/m3serve" && cp -r /tmp/p/m3serve "$purelib/m3serve"
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
             -rfE -p no:cacheprovider ${TESTS:-tests/gpu} 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    memcheck)
      mkdir -p "$OUT/memcheck"
      for f in ${MEMCHECK_FILES:-tests/gpu/test_kernels_gpu.py tests/gpu/test_odd_shapes_gpu.py tests/gpu/test_dequant_gemm_gpu.py tests/gpu/test_nvfp4_mma_gpu.py tests/gpu/test_markov_gpu.py tests/gpu/test_moe_gpu.py}; do
        log="$OUT/memcheck/$(basename "$f" .py).log"
        PYTHONPATH=/tmp/p PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${MEMCHECK_TIMEOUT:-300}" compute-sanitizer \
          --tool memcheck --print-limit 20 python3 -m pytest -q -p no:cacheprovider "$f" > "$log" 2>&1
        echo "$f: rc $? | $(grep -E 'passed|failed' "$log" | tail -1) | $(grep 'ERROR SUMMARY' "$log" | head -1)"
      done ;;
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
    suite)  # the README's test command (./build.sh test) without a venv: tests/run_suite.py under python3
      install_server
      reference_site
      export PYTHONPATH=/tmp/p:/tmp/site
      M3SERVE_PYTHON="$(command -v python3)" M3SERVE_TRITON_DIR=/tmp/triton M3SERVE_SUITE_LOG_DIR="$OUT/suite" \
        M3SERVE_SUITE_SHARDS="${SUITE_SHARDS:-8}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
        USE_HUB_KERNELS=0 timeout "${SUITE_TIMEOUT:-560}" python3 tests/run_suite.py -q -rs -p no:cacheprovider \
        ${SUITE_ARGS:-} 2>&1 | tee "$OUT/suite.log" | grep -v "^\[run_suite\] ----\|^I1\|^W1" | tail -60 ;;
    gateway)  # the OpenAI gateway vs gRPC direct through one tritonserver; .carry-server/gateway312.tar.xz holds
              # FastAPI, uvicorn, sse-starlette, pydantic, httpx2 ... for Python 3.12 (benchmarks/make_carry_gateway.sh)
      install_server
      tar -xJf .carry-server/gateway312.tar.xz -C "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
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
