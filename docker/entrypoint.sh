#!/bin/sh
# Entry point of the m3serve images: check that the host's GPU driver can run this image's torch (one clear
# message instead of a CUDA error deep in a model load; docker/check_device.py), then run the command
# (default: ./build.sh serve, which applies the repository API restriction).
set -e
"${M3SERVE_PYTHON:-python3}" "$(dirname "$0")/check_device.py"
exec "$@"
