"""Start `m3serve openai` (a real process) for the gateway tests, and the texts the scripted sampler writes."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from server.tritonserver_proc import ROOT, free_port

NS = "]<]minimax[>["
TOOL_CALL = (f"{NS}<tool_call>\n{NS}<invoke name=\"get_weather\">{NS}<city>Paris{NS}</city>{NS}<days>3{NS}</days>"
             f"{NS}</invoke>\n{NS}</tool_call>")
# seed -> what the scripted sampler makes the model write
SCRIPTS = {
    7001: TOOL_CALL,
    7002: "<mm:think>The user wants the weather.</mm:think>It is sunny in Paris.",
    7003: "It is sunny and 24 degrees in Paris.",
    # after a forced prefix (tool_choice "required": the block is open; a named function: its invoke too)
    7004: f"{NS}<invoke name=\"get_weather\">{NS}<city>Rome{NS}</city>{NS}</invoke>\n{NS}</tool_call>",
    7005: (f"{NS}<city>Lyon{NS}</city>{NS}<days>2{NS}</days>{NS}</invoke>\n"
           f"{NS}<invoke name=\"get_weather\">{NS}<city>Oslo{NS}</city>{NS}</invoke>\n{NS}</tool_call>"),
}


@dataclass
class Gateway:
    proc: subprocess.Popen
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_gateway(triton_url: str, log_path: str, *args: str, env: dict | None = None, wait_ready: bool = True
                  ) -> Gateway:
    port = free_port()
    cmd = [sys.executable, "-m", "m3serve.cli", "openai", "--triton-url", triton_url, "--model", "m3",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *args]
    logf = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    logf.close()
    gw = Gateway(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}:\n{gw.log()[-4000:]}")
        try:
            with urllib.request.urlopen(gw.url + "/health", timeout=5) as f:
                if f.status == 200:
                    return gw
        except urllib.error.HTTPError as e:
            if e.code == 503 and not wait_ready:
                return gw
        except OSError:
            pass
        time.sleep(0.2)
    gw.stop()
    raise RuntimeError(f"gateway not up after 60 s:\n{gw.log()[-4000:]}")
