"""Start and stop the real tritonserver through `./build.sh serve`, in its own process group
(start_new_session=True): the whole group (server and python-backend stubs, which ignore SIGTERM after a
crash) is killed at the end. Each server gets a fresh repository key ($M3SERVE_REPOSITORY_KEY, which build.sh
passes to Triton's API restriction): `Server.repository_headers()` / `repository_metadata()` carry it."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
READY_TIMEOUT = float(os.environ.get("M3SERVE_TEST_READY_TIMEOUT", "240"))
KEY_HEADER = "m3serve-repository-key"          # build.sh's header for the restricted APIs (HTTP)
GRPC_KEY_HEADER = "triton-grpc-protocol-" + KEY_HEADER  # the same over gRPC (Triton prefixes its name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    log_path: str
    grpc_port: int
    http_port: int
    metrics_port: int
    repo: str
    env: dict = field(default_factory=dict)

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://localhost:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.metrics_port}/metrics"

    @property
    def repository_key(self) -> str:
        return self.env["M3SERVE_REPOSITORY_KEY"]

    def repository_headers(self) -> dict:
        """HTTP headers that open the restricted APIs (model repository, logging, trace, shared memory)."""
        return {KEY_HEADER: self.repository_key}

    def repository_metadata(self) -> dict:
        """The same for tritonclient.grpc's `headers=`."""
        return {GRPC_KEY_HEADER: self.repository_key}

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def group_pids(self) -> list[int]:
        out = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    if os.getpgid(int(d)) == self.proc.pid:
                        out.append(int(d))
                except OSError:
                    pass
        return out

    def stop(self, timeout: float = 40.0) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the group (orphaned stubs ignore SIGTERM)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def copy_models(dest, names) -> str:
    """A model repository at `dest` holding copies of the shipped models `names`; its path."""
    import shutil
    for name in names:
        shutil.copytree(os.path.join(ROOT, "model_repository", name), os.path.join(dest, name))
    return str(dest)


def start_server(repo: str, log_path: str, env_extra: dict | None = None, args: list[str] | None = None,
                 wait_models: list[str] | None = None) -> Server:
    import tritonclient.grpc as grpcclient

    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    env = dict(os.environ)
    env["M3SERVE_REPOSITORY_KEY"] = secrets.token_hex(16)
    env.pop("M3SERVE_REPOSITORY_KEY_FILE", None)
    env.update(env_extra or {})
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [os.path.join(ROOT, "build.sh"), "serve", "--model-repository", repo, "--grpc-port", str(grpc_port),
           "--http-port", str(http_port), "--metrics-port", str(metrics_port)] + list(args or [])
    logf = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)
    logf.close()
    srv = Server(proc, log_path, grpc_port, http_port, metrics_port, repo, env)
    deadline = time.monotonic() + READY_TIMEOUT
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        while True:
            if not srv.alive():
                raise RuntimeError(f"tritonserver exited with {proc.returncode}; log:\n{srv.log()[-6000:]}")
            try:
                if client.is_server_ready() and all(client.is_model_ready(m) for m in (wait_models or [])):
                    return srv
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"tritonserver not ready after {READY_TIMEOUT:.0f}s; log:\n{srv.log()[-6000:]}")
            time.sleep(0.5)
    except BaseException:
        srv.stop()
        raise
    finally:
        client.close()


def serve_m3(d, args: dict, model_dir: str) -> Server:
    """tritonserver with the shipped `m3` model alone under `d`, its model.json replaced by `args`, loaded with
    explicit model control (the tensor-parallel server tests); $M3SERVE_MODEL_DIR = `model_dir`."""
    repo = d / "repo"
    shutil.copytree(os.path.join(ROOT, "model_repository", "m3"), repo / "m3")
    with open(repo / "m3" / "1" / "model.json", "w") as f:
        json.dump(args, f)
    return start_server(str(repo), str(d / "tritonserver.log"), {"M3SERVE_MODEL_DIR": model_dir},
                        ["--model-control-mode=explicit", "--load-model=m3"], wait_models=["m3"])
