"""The hosting tritonserver as a stub sees it: its command line (read from /proc, the stub's parent) and its own
HTTP model-repository API, which the responder uses to mark a model whose engine died (model.py).

Why HTTP and not `pb_utils.load_model`: in Triton 2.51's python backend (r24.10) a model-control call that fails
hands its error string back through the stub's shared memory with a race. The server frees the string as soon as
the stub is notified, while the stub still loads it (`Stub::SendMessage` after `ModelInstanceState::ProcessMessage`),
so the stub reads freed memory and frees it again. Our marking load fails on purpose, and that way it crashed the old
stub (SIGSEGV in `rbtree_best_fit::priv_deallocate`) in about one run in three, leaving its shared memory pool
corrupted while the server tore the instance down. A failed load over HTTP never touches the stub's shared memory.
"""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass

_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class ServerLaunch:
    control_mode: str       # --model-control-mode: "none" (the default), "poll" or "explicit"
    http_url: str | None    # the server's HTTP endpoint as seen from this host; None when HTTP is off
    repository_headers: tuple[tuple[str, str], ...] = ()  # --http-restricted-api=model-repository:<key>=<value>


def _options(argv: list[str]) -> list[tuple[str, str]]:
    """The --name=value and --name value options of a command line, in order."""
    out = []
    for i, a in enumerate(argv):
        if not a.startswith("--"):
            continue
        name, eq, value = a[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            value = "" if nxt.startswith("--") else nxt
        out.append((name, value))
    return out


def _repository_headers(options: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The header the server requires on its HTTP model-repository API (--http-restricted-api=<apis>:<key>=<value>,
    <apis> a comma-separated list)."""
    out = []
    for name, value in options:
        apis, _, header = value.partition(":")
        key, eq, val = header.partition("=")
        if name == "http-restricted-api" and eq and "model-repository" in apis.split(","):
            out.append((key, val))
    return tuple(out)


def _http_url(flags: dict[str, str]) -> str | None:
    if flags.get("allow-http", "true").lower() not in _TRUE:
        return None
    host = flags.get("http-address") or "0.0.0.0"
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(host, host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = flags.get("http-port") or "8000"
    return f"http://{host}:{port}" if port.isdigit() else None  # a port we cannot read: no marking, no crash


def server_launch(argv: list[str] | None = None) -> ServerLaunch | None:
    """The launch options of the tritonserver hosting this stub (argv: its command line, else read from
    /proc/<parent pid>/cmdline); None when the parent is not a tritonserver we can read."""
    if argv is None:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            return None
    if not argv or "tritonserver" not in os.path.basename(argv[0]):
        return None
    options = _options(argv[1:])
    flags = dict(options)  # the last one of a name wins
    return ServerLaunch(control_mode=flags.get("model-control-mode") or "none", http_url=_http_url(flags),
                        repository_headers=_repository_headers(options))


def load_model_over_http(server: ServerLaunch, name: str, config: dict, timeout: float = 120.0) -> str | None:
    """Load model `name` with the config override `config` through the server's repository API
    (POST /v2/repository/models/<name>/load, with the header a restricted API asks for); None when it loaded,
    else the server's error message."""
    url = server.http_url
    body = json.dumps({"parameters": {"config": json.dumps(config)}}).encode()
    req = urllib.request.Request(f"{url}/v2/repository/models/{name}/load", data=body, method="POST",
                                 headers={"Content-Type": "application/json", **dict(server.repository_headers)})
    try:
        with urllib.request.urlopen(req, timeout=timeout):
            return None
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            return str(json.loads(text).get("error") or text)
        except (ValueError, AttributeError):
            return text or f"HTTP {e.code}"
    except (OSError, ValueError) as e:
        return f"the server's HTTP endpoint {url} did not answer: {e}"
