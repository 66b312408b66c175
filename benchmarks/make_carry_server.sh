#!/usr/bin/env bash
# Make .carry-server/site312.tar.xz and .carry-server/pytriton312.tar.xz: what the "server", "soak", "gateway" and
# "learnedserver" steps of benchmarks/device_run.sh unpack into site-packages on the lent GPU machine (Python 3.12, no
# network, numpy 2 in its image): numpy 1.26.4 (the python backend's stub needs numpy < 2), tritonclient and
# python-rapidjson; and the nvidia-pytriton 0.7.0 wheel (tritonserver 2.51, its libraries, the 3.12 backend stub).
#
# A device call carries at most 64 MiB, the tracked tree included (about 30 MiB with models/m3-tiny-learned), so the
# tars are cut down to what serving needs:
#   - the wheels are unpacked with unzip (it keeps the executable bits: tritonserver and the stub must run);
#   - the other Pythons' backend stubs and the bundled libpython 3.13 (no file in the wheel links it) are dropped,
#     as are numpy's tests, f2py and distutils;
#   - the shared libraries and the tritonserver binary are stripped of symbols not needed for linking
#     (`strip --strip-unneeded`); the stub is kept as shipped;
#   - xz -9e.
# On 2026-12-06 this gave 8.1 + 23.6 MB (with gateway312.tar.xz, benchmarks/make_carry_gateway.sh: 33.1 MiB in all),
# and tests/server/test_server.py passed with the stripped tritonserver and libraries in place of the wheel's.
set -euo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p .carry-server "$work/site" "$work/server"
tc="$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("tritonclient"))')"
download() {  # the cp312 manylinux (or pure-Python) wheels of the named requirements into $work/wheels
  .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux_2_35_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$work/wheels" "$@"
}
download numpy==1.26.4 "tritonclient==$tc" python-rapidjson nvidia-pytriton==0.7.0
for whl in "$work"/wheels/*.whl; do
  case "$(basename "$whl")" in
    nvidia_pytriton-*) unzip -q -o "$whl" -d "$work/server" ;;
    *) unzip -q -o "$whl" -d "$work/site" ;;
  esac
done
stubs="$work/server/pytriton/tritonserver/python_backend_stubs"
find "$stubs" -mindepth 1 -maxdepth 1 -type d ! -name 3.12 -exec rm -rf {} +
rm -f "$work"/server/nvidia_pytriton.libs/libpython3-*.so*
find "$work/site/numpy" -type d -name tests -prune -exec rm -rf {} +
rm -rf "$work/site/numpy/f2py" "$work/site/numpy/distutils" "$work/site/numpy/_pyinstaller" "$work/site/numpy/doc"
find "$work/site" "$work/server/nvidia_pytriton.libs" -name "*.so*" -type f -exec strip --strip-unneeded {} +
strip --strip-unneeded "$work/server/pytriton/tritonserver/bin/tritonserver"
{ "$work/server/pytriton/tritonserver/bin/tritonserver" --help 2>&1 || true; } | grep -q "^Usage: tritonserver"  # runs
find "$work" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$work/site" -cf - . | xz -T2 -9e > .carry-server/site312.tar.xz
tar -C "$work/server" -cf - . | xz -T2 -9e > .carry-server/pytriton312.tar.xz
ls -l .carry-server
