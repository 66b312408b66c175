#!/usr/bin/env bash
# Make .carry-baseline/COMMIT.tar.xz: backend/, kernels/ and benchmarks/ of an earlier commit (about 0.2 MiB), so
# that one device call times the same benchmark on that commit and on the working tree, on the same machine (the lent
# machine has no git: compare only figures from one call, docs/performance.md). The call then runs, e.g.:
#   mkdir -p /tmp/base && tar -xJf .carry-baseline/dda2a8a.tar.xz -C /tmp/base \
#     && (cd /tmp/base && OUT=$OUT/base STEPS=engine bash benchmarks/device_run.sh) \
#     && OUT=$OUT/head STEPS=engine bash benchmarks/device_run.sh
# (carry [".carry-baseline"]). The baseline's own device_run.sh lays its package out in /tmp/p, and the working
# tree's does so again after it.
set -euo pipefail
cd "$(dirname "$0")/.."
commit="$(git rev-parse --short "${1:?usage: make_carry_baseline.sh COMMIT}")"
mkdir -p .carry-baseline
git archive "$commit" backend kernels benchmarks | xz -9 > ".carry-baseline/$commit.tar.xz"
ls -l ".carry-baseline/$commit.tar.xz"
