"""What a model config may set (backend/triton/parameters.py): every parameter of the shipped configs is known,
a hook or unknown name is refused naming it, tokenizer_dir stays inside its bases, and the test engine factory
comes from the environment only, per model."""
from __future__ import annotations

import glob
import os
import re

import pytest

from m3serve.config import ConfigError
from m3serve.triton import parameters as P

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_every_parameter_of_the_shipped_configs_is_known():
    found = set()
    for path in glob.glob(os.path.join(ROOT, "model_repository*", "**", "config.pbtxt"), recursive=True):
        with open(path) as f:
            found |= set(re.findall(r'key:\s*"(\w+)"\s*value:\s*{\s*string_value', f.read()))
    assert found and found <= set(P.PARAMETERS), found - set(P.PARAMETERS)
    P.check({k: "x" for k in found})


@pytest.mark.parametrize("params, named", [
    ({"engine_factory": "os:system"}, "engine_factory: a model config never picks code"),
    ({"my_hook": "/tmp/evil.py:run"}, "my_hook: a model config never picks code"),
    ({"max_tokenz": "4", "m3serve_role": "text"}, "max_tokenz not taken by m3serve"),
])
def test_unknown_parameters_and_hooks_are_refused_by_name(params, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        P.check(params)


def test_tokenizer_dir_stays_inside_its_bases(tmp_path):
    model_dir, version = tmp_path / "models", tmp_path / "repo" / "pre" / "1"
    (model_dir / "tok").mkdir(parents=True)
    (version / "local").mkdir(parents=True)
    bases = [str(version), str(model_dir)]
    assert P.inside_path("tok", bases, "tokenizer_dir") == str(model_dir / "tok")
    assert P.inside_path("./local", bases, "tokenizer_dir") == str(version / "local")
    for bad in (str(model_dir / "tok"), "../../../models/tok", "tok/../../models/tok", "~/tok", "$HOME/tok", ""):
        with pytest.raises(ConfigError, match="must be a relative path inside the model folder"):
            P.inside_path(bad, bases, "tokenizer_dir")
    with pytest.raises(ConfigError, match="not found"):
        P.inside_path("nope", bases, "tokenizer_dir")


def test_the_test_engine_factory_comes_from_the_environment_per_model():
    env = {P.TEST_FACTORY_ENV: "m3=/t/faulty.py:make; m3null=bench:null_engine"}
    assert P.test_engine_factory("m3", env) == "/t/faulty.py:make"
    assert P.test_engine_factory("m3null", env) == "bench:null_engine"
    assert P.test_engine_factory("m3_ids", env) is None
    assert P.test_engine_factory("m3_ids", {P.TEST_FACTORY_ENV: "geometry.py:async_engine"}) == "geometry.py:async_engine"
    assert P.test_engine_factory("m3", {}) is None
