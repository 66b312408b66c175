"""What the suite needs installed. transformers (the only independent numerical oracle) and the server wheel
(tritonserver, tritonclient) are required: a missing one fails the run instead of turning its tests into skips.
`M3SERVE_TEST_OPTIONAL` (comma separated: `transformers`, `server`, `genai-perf`, `import-linter`, `index`: the package
index the pin check resolves against) names what may be missing on this machine; only those tests then skip, saying
why."""
from __future__ import annotations

import importlib
import os

import pytest

OPTIONAL_ENV = "M3SERVE_TEST_OPTIONAL"


def optional(what: str) -> bool:
    return what in {w.strip() for w in os.environ.get(OPTIONAL_ENV, "").split(",")}


def missing(why: str, what: str, needed: str) -> None:
    """Skip (where $M3SERVE_TEST_OPTIONAL names `what`) or fail (everywhere else: at module level a collection error,
    in a test a failure), saying `why` and `needed` (who requires it and what installs it)."""
    if optional(what):
        pytest.skip(f"{why}; {OPTIONAL_ENV} names {what}", allow_module_level=True)
    pytest.fail(f"{why}: {needed}; set {OPTIONAL_ENV}={what} only where it cannot be installed", pytrace=False)


def require(module: str, what: str = "transformers"):
    """`import module`; if it is missing, skip (where $M3SERVE_TEST_OPTIONAL names `what`) or fail (everywhere
    else: at module level a collection error, in a test a failure)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing(f"{module} is not installed ({e})", what, "the test suite requires it (./build.sh setup installs it)")


def require_server() -> None:
    """The real tritonserver (the nvidia-pytriton wheel's binary) and tritonclient, for tests/server."""
    import importlib.util

    require("tritonclient.grpc", "server")
    spec = importlib.util.find_spec("pytriton")
    where = list(spec.submodule_search_locations or []) if spec else []
    if not any(os.access(os.path.join(d, "tritonserver", "bin", "tritonserver"), os.X_OK) for d in where):
        missing("no tritonserver binary (the nvidia-pytriton wheel is not installed)", "server",
                "the server tests require it (./build.sh setup installs it)")


def require_genai_perf() -> str:
    """genai-perf with its perf_analyzer (`./build.sh genai-perf` makes .cache/genai-perf; $M3SERVE_GENAI_PERF names
    another launcher): its path, else a skip (where $M3SERVE_TEST_OPTIONAL names `genai-perf`) or a failure."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.environ.get("M3SERVE_GENAI_PERF") or os.path.join(root, ".cache", "genai-perf", "bin", "genai-perf")
    if os.access(path, os.X_OK):
        return path
    missing(f"no genai-perf at {path}", "genai-perf", "./build.sh test (or ./build.sh genai-perf --help) installs it")
