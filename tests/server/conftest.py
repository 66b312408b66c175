"""Server fixtures: the real tritonserver (CPU) on the tiny model, started once per session through
`./build.sh serve` in its own process group, killed at the end; the server log is dumped when a test fails."""
from __future__ import annotations

import os
import sys

import pytest

from support.required import require_server

require_server()  # before the test modules import tritonclient: missing, it fails the run (or skips, if allowed)
from tritonserver_proc import ROOT, start_server  # noqa: E402


@pytest.fixture(scope="session")
def models_dir(tiny_model_dir) -> str:
    """The folder holding the session's tiny model as `tiny-m3` (what the shipped model.json files name): the
    servers' $M3SERVE_MODEL_DIR."""
    assert os.path.basename(tiny_model_dir) == "tiny-m3"
    return os.path.dirname(tiny_model_dir)


@pytest.fixture(scope="session")
def server(models_dir, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("server") / "tritonserver.log")
    srv = start_server(os.path.join(ROOT, "model_repository"), log_path, {"M3SERVE_MODEL_DIR": models_dir},
                       wait_models=["m3", "m3_ids", "preprocessing", "postprocessing", "ensemble"])
    yield srv
    srv.stop()


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture(autouse=True)
def _dump_server_log_on_failure(request):
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is None or not rep.failed:
        return
    for name in ("server", "faulty_server"):
        if name in request.fixturenames:
            srv = request.getfixturevalue(name)
            tail = srv.log()[-8000:]
            sys.stderr.write(f"\n===== {name} log (tail) =====\n{tail}\n===== end of {name} log =====\n")
