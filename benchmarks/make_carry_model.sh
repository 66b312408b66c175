#!/usr/bin/env bash
# Make .carry-model/m3-tiny-learned.tar.xz: the committed learned checkpoint (models/m3-tiny-learned, 27 MiB) as one
# xz tar (18 MiB). A device call carries at most 64 MiB with the tree, and the tree, .carry-server/ and
# .carry-reference/ together are 70 MiB. So the call that runs the whole suite (`STEPS=suite` of
# benchmarks/device_run.sh, which needs all three) takes the checkpoint out of the working tree for that call and
# carries this file instead; device_run.sh unpacks it into models/ where the folder is missing:
#   bash benchmarks/make_carry_model.sh && mv models/m3-tiny-learned /tmp/m3-tiny-learned.keep
#   (the call: carry [".carry-server", ".carry-reference", ".carry-model"])
#   mv /tmp/m3-tiny-learned.keep models/m3-tiny-learned && git status --short models/   # nothing
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f models/m3-tiny-learned/config.json ] || { echo "models/m3-tiny-learned is missing"; exit 1; }
mkdir -p .carry-model
tar -C models -cf - m3-tiny-learned | xz -T2 -9 > .carry-model/m3-tiny-learned.tar.xz
ls -l .carry-model/m3-tiny-learned.tar.xz
