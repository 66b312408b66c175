#!/usr/bin/env bash
# Make .carry-tests/: what the test suite imports beyond the lent H200's image (its package list:
# /work/.library/device/KINDS.md), .carry-server and .carry-reference, for Python 3.12 on a machine without network,
# in two files so that each fits a call's 64 MiB beside the carries it travels with:
#   suite312.tar.xz     import-linter + grimp (lint-imports, tests/unit/test_import_contract.py) and pip 25.3 (the
#                       image's pip is too old for docker/pins.py's dry-run resolution)
#   gwtests312.tar.xz   the `openai` client and schemathesis (tests/gateway), less what the image and the gateway
#                       carry (.carry-server/gateway312.tar.xz) hold
# `STEPS=suite` of benchmarks/device_run.sh puts whichever is there on PYTHONPATH. The image's list holds anyio but
# not sniffio, which openai imports (tests/gateway failed to collect on the H100 without it, 2026-12-06).
set -euo pipefail
cd "$(dirname "$0")/.."
image=click,typing-extensions,rich,pygments,markdown-it-py,mdurl,pyyaml,requests,urllib3,charset-normalizer,idna,certifi
image=$image,anyio,h11,werkzeug,markupsafe,packaging,pytest,pluggy,iniconfig,hypothesis,sortedcontainers,attrs
image=$image,pytest-timeout,tqdm
gateway=fastapi,starlette,pydantic,pydantic-core,typing-inspection,annotated-types,httpx2,httpcore2,truststore
benchmarks/make_carry_wheels.sh .carry-tests/suite312.tar.xz --skip "$image" import-linter pip
benchmarks/make_carry_wheels.sh .carry-tests/gwtests312.tar.xz --skip "$image,$gateway" openai schemathesis
