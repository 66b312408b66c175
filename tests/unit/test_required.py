"""A missing transformers (the independent oracle) or server wheel fails the test run; only
$M3SERVE_TEST_OPTIONAL turns its tests into skips (tests/support/required.py)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _collect(tmp_path, target, optional=""):
    """pytest --collect-only on `target` in a fresh process where `import transformers` fails."""
    hide = tmp_path / "hide"
    (hide / "transformers").mkdir(parents=True)
    (hide / "transformers" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")]),
               M3SERVE_TEST_OPTIONAL=optional)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--collect-only",
                           target], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("target", ["tests/reference/test_tp_parity.py", "tests/reference/test_hf_parity.py"])
def test_missing_transformers_fails_the_run(tmp_path, target):
    r = _collect(tmp_path, target)
    assert r.returncode != 0 and "transformers is not installed" in r.stdout, r.stdout[-2000:]
    assert "M3SERVE_TEST_OPTIONAL=transformers" in r.stdout


def test_missing_transformers_skips_only_where_allowed(tmp_path):
    r = _collect(tmp_path, "tests/reference/test_tp_parity.py", optional="transformers")
    assert r.returncode == 5, r.stdout[-2000:]  # 5: nothing collected (the module skipped), no error
    assert "SKIPPED [1]" in r.stdout and "M3SERVE_TEST_OPTIONAL names transformers" in r.stdout
