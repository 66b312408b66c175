"""The package graph's contracts (pyproject.toml's [tool.importlinter], run by `./build.sh test` before pytest) hold
for the tree, and break when a layer imports one above it or two modules import each other."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from support.required import require

ROOT = Path(__file__).resolve().parents[2]
# lint-imports' own entry point, through this interpreter: the same wherever import-linter is importable (a venv, or
# wheels unpacked onto PYTHONPATH without their console scripts, as on the device)
LINT = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"]

require("importlinter", "import-linter")


def _tree(tmp_path: Path) -> Path:
    """m3serve/ as build.sh's lint_imports lays it out (backend/ with kernels/ inside), copied so it can be edited."""
    pkg = tmp_path / "m3serve"
    shutil.copytree(ROOT / "backend", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "kernels", pkg / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    return pkg


def _lint(tmp_path: Path) -> subprocess.CompletedProcess:
    path = [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))  # the copy's m3serve first
    return subprocess.run([*LINT, "--config", str(ROOT / "pyproject.toml"), "--no-cache", "--no-logo"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def _add_import(path: Path, line: str) -> None:
    text = path.read_text()
    head = "from __future__ import annotations\n"
    assert head in text
    path.write_text(text.replace(head, head + line + "\n", 1))


def test_the_tree_keeps_every_contract(tmp_path):
    _tree(tmp_path)
    r = _lint(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 5 kept, 0 broken." in r.stdout


def test_a_layer_importing_one_above_it_breaks_the_layers(tmp_path):
    pkg = _tree(tmp_path)
    _add_import(pkg / "model" / "m3.py", "from m3serve.engine import scheduler  # noqa")  # model -> engine
    r = _lint(tmp_path)
    assert r.returncode != 0
    assert "m3serve.model is not allowed to import m3serve.engine" in r.stdout
    assert "m3serve.model.m3 -> m3serve.engine.scheduler" in r.stdout


def test_the_triton_layer_reaching_the_kernels_breaks_its_contract(tmp_path):
    pkg = _tree(tmp_path)
    _add_import(pkg / "triton" / "schema.py", "from m3serve.kernels import dispatch  # noqa")
    r = _lint(tmp_path)
    assert r.returncode != 0
    assert "m3serve.triton is not allowed to import m3serve.kernels" in r.stdout


def test_the_runner_choosing_an_attention_backend_breaks_the_layers_own_their_caches(tmp_path):
    pkg = _tree(tmp_path)  # what model_runner.py did before the layers were bound to their caches
    _add_import(pkg / "executor" / "model_runner.py", "from m3serve.model.layers import attention  # noqa")
    r = _lint(tmp_path)
    assert r.returncode != 0
    assert "m3serve.executor is not allowed to import m3serve.model.layers" in r.stdout


def test_an_import_circle_between_siblings_breaks_the_acyclic_contract(tmp_path):
    pkg = _tree(tmp_path)  # the circle this tree had: grouped_gemm <-> grouped_gemm_mma
    _add_import(pkg / "kernels" / "grouped_gemm.py", "from . import grouped_gemm_mma  # noqa")
    r = _lint(tmp_path)
    assert r.returncode != 0
    assert "No cycles are allowed in m3serve.kernels." in r.stdout


def test_the_gateway_and_the_triton_stub_do_not_import_torch():
    """The OpenAI gateway (one process per worker, beside the server) and the Triton stub's request side talk to the
    engine over gRPC / a pipe: importing them must not load torch (2 s and hundreds of MB per process; the gateway
    imported it through `m3serve/__init__` -> sampling_params -> step_io until 2026-12-06)."""
    code = ("import sys\n"
            "import m3serve.gateway.app, m3serve.engine.client, m3serve.triton.text_contract, "
            "m3serve.triton.ids_contract, m3serve.triton.responder\n"
            "print(sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
