"""The container files say what they should (no Docker engine here: read statically). docker-compose.yml: profiles and
host ports that never collide, every server started by `./build.sh serve` with the repository key, health checks,
restart / init / a stop grace longer than Triton's exit plus TP teardown, GPU services with ipc host and RCCL's
limits; the Dockerfile: pinned bases that are pins.py's, a non-root user, OCI labels, a health check, the start-up
driver check; .dockerignore; the flash examples fail today with exactly the message compose's comment quotes."""
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docker" / f"{name}.py")
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)  # (dataclasses look it up there)
    spec.loader.exec_module(mod)
    return mod


pins = _load("pins")
check_device = _load("check_device")
COMPOSE_TEXT = (ROOT / "docker-compose.yml").read_text()
COMPOSE = yaml.safe_load(COMPOSE_TEXT)
SERVICES = COMPOSE["services"]
SERVERS = {n: s for n, s in SERVICES.items() if "openai" not in s["command"]}
GATEWAYS = {n: s for n, s in SERVICES.items() if "openai" in s["command"]}
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def seconds(v: str) -> float:
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms])", v))


def host_ports(service) -> list[str]:
    return [p.rsplit(":", 1)[0] for p in service.get("ports", [])]


def compose_problems(services: dict) -> list[str]:
    """What breaks `docker compose --profile X up` or bypasses the restriction (the checks of the tests below)."""
    out = [f"{n}: no profile" for n, s in services.items() if not s.get("profiles")]
    every = [p for s in services.values() for p in host_ports(s)]
    out += [f"host port {p} published twice" for p in sorted({p for p in every if every.count(p) > 1})]
    out += [f"{n}: shm_size with ipc host" for n, s in services.items() if s.get("ipc") == "host" and "shm_size" in s]
    out += [f"{n}: not started by ./build.sh serve" for n, s in services.items()
            if "openai" not in s.get("command", []) and s.get("command", [])[:2] != ["./build.sh", "serve"]]
    return out


OLD_COMPOSE = """  # the compose file before issue 25, abridged
m3serve-tiny: {ports: ["8000:8000", "8001:8001", "8002:8002"], command: ["./build.sh", "serve"]}
m3serve-flash:
  profiles: ["flash"]
  shm_size: "16gb"
  ipc: host
  command: ["tritonserver", "--model-repository=/models"]
  ports: ["8000:8000", "8001:8001", "8002:8002"]
"""


def test_profiles_and_ports_never_collide():
    assert set(SERVERS) == {"m3serve-tiny", "m3serve-flash", "m3serve-rocm"} and GATEWAYS
    assert compose_problems(SERVICES) == []  # distinct host ports even with every profile up at once
    assert host_ports(SERVICES["m3serve-tiny"]) == ["8000", "8001", "8002"]
    assert compose_problems(yaml.safe_load(OLD_COMPOSE)) == [
        "m3serve-tiny: no profile", "host port 8000 published twice", "host port 8001 published twice",
        "host port 8002 published twice", "m3serve-flash: shm_size with ipc host",
        "m3serve-flash: not started by ./build.sh serve"]


def test_servers_start_through_build_sh_serve_with_the_repository_key():
    secret = "m3serve_repository_key"
    assert secret in COMPOSE["secrets"] and COMPOSE["secrets"][secret]["file"]
    for name, s in SERVERS.items():
        assert s["command"][:2] == ["./build.sh", "serve"], name  # the restriction lives in build.sh serve
        assert s["secrets"] == [secret], name
        assert s["environment"]["M3SERVE_REPOSITORY_KEY_FILE"] == f"/run/secrets/{secret}", name
    assert '["./build.sh", "serve"]' in DOCKERFILE.splitlines()[-1]  # the image's own CMD too


def test_lifecycle_and_health():
    for name, s in SERVICES.items():
        assert s["restart"] in ("unless-stopped", "always", "on-failure") and s["init"] is True, name
        h = s["healthcheck"]
        assert h["test"][:3] == ["CMD", "curl", "-fs"] and seconds(h["start_period"]) > 0, name
    for name, s in SERVERS.items():
        assert s["healthcheck"]["test"][-1] == "localhost:8000/v2/health/ready"
        assert seconds(s["stop_grace_period"]) > 30 + 65, name  # Triton's exit timeout + a TP step's timeout
    for name in ("m3serve-flash", "m3serve-rocm"):  # a 250 GB TP4 load
        assert seconds(SERVICES[name]["healthcheck"]["start_period"]) >= 3600


def test_gpu_services():
    for name in ("m3serve-flash", "m3serve-rocm"):
        s = SERVICES[name]
        assert s["ipc"] == "host" and "shm_size" not in s, name  # shm_size is dead under ipc: host
        assert s["ulimits"] == {"memlock": -1, "stack": 67108864}, name
        assert "--load-model" in s["command"] and s["environment"]["M3SERVE_MODEL_DIR"] == "/weights"
    assert SERVICES["m3serve-flash"]["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 4
    rocm = SERVICES["m3serve-rocm"]
    assert rocm["devices"] == ["/dev/kfd", "/dev/dri"] and set(rocm["group_add"]) == {"video", "render"}
    assert rocm["build"]["args"] == {"PLATFORM": "rocm", "BASE_IMAGE": pins.IMAGES["rocm"].base}
    assert rocm["image"] != SERVICES["m3serve-flash"]["image"]


def test_gateways_follow_their_server():
    for name, g in GATEWAYS.items():
        cmd = g["command"]
        assert cmd[:2] == ["m3serve", "openai"] and cmd[cmd.index("--port") + 1] == "9000"
        server, port = cmd[cmd.index("--triton-url") + 1].split(":")
        assert port == "8001" and server in SERVERS and g["profiles"] == SERVERS[server]["profiles"]
        assert g["depends_on"] == {server: {"condition": "service_healthy"}}
        assert g["healthcheck"]["test"][-1] == "localhost:9000/health"
        assert "M3SERVE_OPENAI_API_KEY" in g["environment"] and g["environment"]["M3SERVE_OPENAI_API_KEY"] is None


def _instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", "\n".join(x for x in text.splitlines() if not x.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2)) for m in re.finditer(r"^(\w+)\s+(.*)$", joined, re.M)]


def test_dockerfile_conventions():
    ins = _instructions(DOCKERFILE)
    args = dict(v.split("=", 1) for k, v in ins if k == "ARG" and "=" in v)  # the defaults
    assert args["BASE_IMAGE"] == pins.IMAGES["cuda"].base and args["PLATFORM"] == "cuda"
    assert all(re.fullmatch(r"[\w./-]+:[\w.-]+", im.base) for im in pins.IMAGES.values())  # exact tags
    assert "latest" not in " ".join(v for k, v in ins if k in ("FROM", "ARG"))
    last = max(i for i, (k, _) in enumerate(ins) if k == "FROM")
    final = ins[last:]
    users = [v for k, v in final if k == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert any(k == "HEALTHCHECK" and "/v2/health/ready" in v for k, v in final)
    assert ("ENTRYPOINT", '["/opt/m3serve/src/docker/entrypoint.sh"]') in final
    labels = " ".join(v for k, v in final if k == "LABEL")
    for key in ("title", "description", "version", "licenses", "base.name"):
        assert f"org.opencontainers.image.{key}=" in labels
    assert any(k == "COPY" and v.startswith("--from=build") for k, v in final)  # multi-stage: no pip in the runtime
    # the clients run in the image: the client library is in every image's set
    assert all(any(x.startswith("tritonclient[grpc]==") for x in pins.image_requirements(im))
               for im in pins.IMAGES.values())


def test_dockerignore():
    entries = set((ROOT / ".dockerignore").read_text().split())
    for e in (".git", ".venv", ".cache", "*.whl", ".whl", "**/__pycache__", ".pytest_cache", "*.safetensors",
              ".secrets", "tests"):
        assert e in entries, e


MISSING_FEATURES = ("speculative_config: speculative decoding with tensor_parallel_size > 1 is not supported yet",
                    "attention_config.indexer_decode_cp: decode context parallelism is not supported yet")


@pytest.mark.parametrize("repo", ["minimax-m3.1-flash-tp4", "minimax-m3.1-flash-tp4-rocm"])
def test_flash_examples_load_or_fail_with_the_message_compose_quotes(repo, tmp_path, monkeypatch):
    """As published (TP4 + DSpark) the example loads once speculation runs under TP; until then every problem the
    engine names is quoted in compose's comment, so the comment stays true."""
    from m3serve.config import ConfigError
    from m3serve.triton.engine_args import engine_config
    (tmp_path / "MiniMax-M3.1-Flash").mkdir()
    monkeypatch.setenv("M3SERVE_MODEL_DIR", str(tmp_path))
    try:
        cfg, _ = engine_config(str(ROOT / "model_repository_examples" / repo / "m3" / "1"))
    except ConfigError as e:
        problems = str(e).removeprefix("model.json: ").split("; ")
        comment = " ".join(x.lstrip("# ") for x in COMPOSE_TEXT.splitlines() if x.startswith("#"))
        readme = " ".join((ROOT / "model_repository_examples" / "README.md").read_text().split())
        for p in problems:  # only features not there yet, each quoted where the example is described
            assert p.split(" (")[0] in MISSING_FEATURES, p
            assert p.split(" (")[0] in comment and p.split(" (")[0] in readme, p
    else:
        assert cfg.tensor_parallel_size == 4 and cfg.speculative_config["method"] == "dspark"


def test_start_up_driver_check():
    ok, msg = check_device.check_cuda("13.0", 12060)  # a 24.10-era host: R560, CUDA 12.6
    assert not ok and "R580 series or newer" in msg and "supports CUDA 12.6" in msg
    assert check_device.check_cuda("13.0", 13000)[0] and check_device.check_cuda("13.0", 13020)[0]
    ok, msg = check_device.check_cuda("13.0", None)  # started without GPUs: the CPU serves the tiny model
    assert ok and "runs on the CPU" in msg


def test_start_up_rocm_check(tmp_path, monkeypatch):
    assert check_device.check_rocm("7.2", str(tmp_path))[0]  # no /dev/kfd: a note
    (tmp_path / "kfd").touch()
    monkeypatch.setattr(check_device.os, "access", lambda path, mode: False)
    ok, msg = check_device.check_rocm("7.2", str(tmp_path))
    assert not ok and "--group-add video --group-add render" in msg


def test_torch_build_is_read_without_importing_torch(tmp_path, monkeypatch):
    (tmp_path / "version.py").write_text("__version__ = '2.11.0'\ncuda: Optional[str] = '13.0'\nhip = None\n")
    spec = type("Spec", (), {"submodule_search_locations": [str(tmp_path)]})
    monkeypatch.setattr(check_device.importlib.util, "find_spec", lambda name: spec)
    assert check_device.torch_build() == ("13.0", None)
    (tmp_path / "version.py").write_text("cuda: Optional[str] = None\nhip: Optional[str] = '7.2.26015'\n")
    assert check_device.torch_build() == (None, "7.2.26015")


def test_every_m3serve_variable_is_documented():
    """docs/configuration.md's table names every M3SERVE_* variable the code, scripts and container files read."""
    docs = (ROOT / "docs" / "configuration.md").read_text()
    files = [ROOT / "build.sh", ROOT / "Dockerfile", ROOT / "docker-compose.yml"]
    for folder in ("backend", "kernels", "docker", "clients", "benchmarks", "tests"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts]
    used = {v for p in files for v in re.findall(r"M3SERVE_[A-Z0-9_]*[A-Z0-9]", p.read_text())}
    documented = set(re.findall(r"`(M3SERVE_[A-Z0-9_]+)`", docs))
    assert "M3SERVE_LOG_LEVEL" in used and not used - documented, sorted(used - documented)


def test_entrypoint_checks_then_runs_the_command():
    import os
    import subprocess
    env = {**os.environ, "M3SERVE_PYTHON": sys.executable}
    p = subprocess.run([str(ROOT / "docker" / "entrypoint.sh"), "sh", "-c", "echo served; exit 7"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout) == (7, "served\n"), p.stderr  # a CPU torch: nothing to check, the command runs
    p = subprocess.run([str(ROOT / "docker" / "entrypoint.sh"), "true"], env={**env, "M3SERVE_PYTHON": "false"},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0  # a failing check stops the container before the command


def test_the_clients_imports_are_installed_in_every_image():
    """clients/ is copied into the images: every third-party module it imports is in each image's set."""
    mods = {m for p in (ROOT / "clients").glob("*.py")
            for m in re.findall(r"^\s*(?:from|import) ([A-Za-z_]\w*)", p.read_text(), re.M)}
    third_party = mods - set(sys.stdlib_module_names) - {"__future__", "m3serve"}
    assert third_party == {"numpy", "tritonclient", "tqdm", "openai"}
    for image in pins.IMAGES.values():
        names = {pins.req_name(x) for x in pins.image_requirements(image) if not x.startswith("-")}
        assert third_party <= names, (image.name, third_party - names)
