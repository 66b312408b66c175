"""Gateway fixtures: the real tritonserver (CPU, tiny model, `m3` only, its sampler scripted for a few seeds:
scripted_engine.py) started once per session, and an `m3serve openai` gateway in front of it (a real process)."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from gateway_procs import SCRIPTS, start_gateway
from server.tritonserver_proc import ROOT, start_server


@pytest.fixture(scope="session")
def m3_server(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("gateway_server")
    repo = d / "models"
    shutil.copytree(os.path.join(ROOT, "model_repository", "m3"), repo / "m3")
    factory = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripted_engine.py") + ":make"
    scripts = d / "scripts.json"
    scripts.write_text(json.dumps(SCRIPTS))
    env = {"M3SERVE_MODEL_DIR": os.path.dirname(tiny_model_dir), "M3SERVE_SCRIPTS": str(scripts),
           "M3SERVE_TEST_ENGINE_FACTORY": f"m3={factory}"}  # test hooks come from the server's environment only
    srv = start_server(str(repo), str(d / "tritonserver.log"), env, wait_models=["m3"])
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def gateway(m3_server, tmp_path_factory):
    gw = start_gateway(m3_server.grpc_url, str(tmp_path_factory.mktemp("gw") / "gateway.log"))
    yield gw
    gw.stop()


@pytest.fixture(autouse=True)
def _dump_logs_on_failure(request):
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed == failed:
        return
    for name in ("m3_server", "gateway"):
        if name in request.fixturenames:
            tail = request.getfixturevalue(name).log()[-6000:]
            sys.stderr.write(f"\n===== {name} log (tail) =====\n{tail}\n===== end =====\n")
