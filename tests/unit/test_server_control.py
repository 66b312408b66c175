"""The stub's view of its tritonserver: launch options from the command line, and the repository API's load
over HTTP (the marking load of a dead engine; server_control.py says why it is not a BLS call)."""
from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from m3serve.triton.server_control import ServerLaunch, load_model_over_http, server_launch

BIN = "/opt/tritonserver/bin/tritonserver"


@pytest.mark.parametrize("argv, expected", [
    ([BIN, "--model-repository", "/m"], ServerLaunch("none", "http://127.0.0.1:8000")),
    ([BIN, "--model-control-mode=explicit", "--load-model=*", "--http-port=8123"],
     ServerLaunch("explicit", "http://127.0.0.1:8123")),
    ([BIN, "--model-control-mode", "poll", "--http-port", "9000", "--http-address", "10.1.2.3"],
     ServerLaunch("poll", "http://10.1.2.3:9000")),
    ([BIN, "--model-control-mode=explicit", "--allow-http=false"], ServerLaunch("explicit", None)),
    ([BIN, "--allow-http", "0"], ServerLaunch("none", None)),
    ([BIN, "--http-port=http"], ServerLaunch("none", None)),
    ([BIN, "--http-address=::", "--http-port=8001"], ServerLaunch("none", "http://[::1]:8001")),
    ([BIN, "--http-address=fe80::1"], ServerLaunch("none", "http://[fe80::1]:8000")),
    ([BIN, "--model-control-mode=none", "--model-control-mode=explicit"],
     ServerLaunch("explicit", "http://127.0.0.1:8000")),
    ([BIN, "--http-restricted-api=health:probe=1", "--http-restricted-api", "inference,model-repository:admin-key=s3"],
     ServerLaunch("none", "http://127.0.0.1:8000", (("admin-key", "s3"),))),
])
def test_server_launch_reads_the_command_line(argv, expected):
    assert server_launch(argv) == expected


def test_server_launch_of_another_parent_is_none():
    assert server_launch(["/usr/bin/python3", "-m", "pytest", "--model-control-mode=explicit"]) is None
    assert server_launch([]) is None


class _Repo(BaseHTTPRequestHandler):
    calls: list = []
    status = 400

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append((self.path, body, self.headers.get("admin-key")))
        payload = b"" if self.status == 200 else json.dumps({"error": "load failed: engine dead"}).encode()
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def repo_server():
    _Repo.calls = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Repo)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_load_over_http_sends_the_config_override_and_returns_the_servers_error(repo_server):
    _, url = repo_server
    server = ServerLaunch("explicit", url, (("admin-key", "s3"),))
    config = {"name": "m3", "parameters": {"m3serve_engine_failed": {"string_value": "CUDA error"}}}
    _Repo.status = 400
    assert load_model_over_http(server, "m3", config, timeout=10) == "load failed: engine dead"
    path, body, key = _Repo.calls[-1]
    assert path == "/v2/repository/models/m3/load" and key == "s3"
    assert json.loads(body["parameters"]["config"]) == config
    _Repo.status = 200
    assert load_model_over_http(server, "m3", config, timeout=10) is None


def test_load_over_http_to_nobody_says_so():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    error = load_model_over_http(ServerLaunch("explicit", f"http://127.0.0.1:{port}"), "m3", {}, timeout=5)
    assert error is not None and "did not answer" in error
