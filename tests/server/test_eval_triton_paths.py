"""`m3serve eval-tasks`' Triton paths against the real tritonserver on the CPU: a random-weight learned checkpoint
served as the demo serves the trained one (the shipped repository, its model named in model.json, special tokens
kept by the ensemble's postprocessing), and the `m3` text contract and the `ensemble` answer every prompt exactly
as the engine in this process does (docs/quality.md: "through tritonserver the accuracy equals the engine's")."""
from __future__ import annotations

import os
import re

import pytest

from tritonserver_proc import copy_models, start_server

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]
MODELS = ["m3", "m3_ids", "preprocessing", "postprocessing", "ensemble"]


def test_triton_paths_answer_as_the_engine(tmp_path):
    from m3serve.learn.config import make_learned
    from m3serve.learn.evaluate import evaluate

    models = tmp_path / "models"
    model = str(models / "learned-random")
    make_learned(model, dtype="float32")
    repo = copy_models(tmp_path / "repo", MODELS)
    for name in MODELS:  # as build.sh demo rewrites the shipped repository for the learned model
        for path in (os.path.join(repo, name, "config.pbtxt"), os.path.join(repo, name, "1", "model.json")):
            if os.path.exists(path):
                text = open(path).read().replace('"tiny-m3"', '"learned-random"')
                if name == "postprocessing":
                    text = re.sub(r'("skip_special_tokens"[^}]*string_value: )"true"', r'\1"false"', text)
                open(path, "w").write(text)
    srv = start_server(repo, str(tmp_path / "server.log"), {"M3SERVE_MODEL_DIR": str(models)}, wait_models=MODELS)
    try:
        report = evaluate(model, n=2, paths=("engine", "triton-m3", "triton-ensemble"), device="cpu",
                          dtype="float32", triton_url=srv.grpc_url, tasks=("arithmetic", "tool_call", "multi_turn"),
                          max_model_len=1024)
    finally:
        srv.stop()
    assert report["same_replies_as_engine"] == {"triton-m3": True, "triton-ensemble": True}, \
        report["replies_unlike_engine"]
    engine = report["replies"]["engine"]
    assert all(len(replies) == 2 for replies in engine.values()) and any(r for rs in engine.values() for r in rs)
