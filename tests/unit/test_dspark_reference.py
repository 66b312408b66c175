"""The DSpark draft's forward against an independent reference written from design/dspark.md
(tests/support/dspark_ref.py: plain torch on the checkpoint's tensors): block hidden states, base logits, the
Markov head's sequential greedy loop and the confidences. The draft's other tests compare it with itself
(incremental cache against recompute); this one fails on a convention both sides would share: shown below for a
causal block mask and for block positions off by one."""
import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import m3serve.model.dspark as dspark_module
from m3serve.executor.speculative.proposer import sample_block
from support.dspark_ref import draft_block


@pytest.fixture(scope="module")
def checkpoint(tiny_draft):
    d = tiny_draft[2]
    w = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        w.update(load_file(f))
    with open(os.path.join(d, "config.json")) as f:
        return w, json.load(f)


def _compare(draft, w, cfg, t, seed):
    """Raises AssertionError where the model's block for random features of t positions and a random anchor differs
    from the reference's."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(t, len(cfg["target_layer_ids"]) * cfg["hidden_size"], generator=g)
    anchor = int(torch.randint(0, cfg["vocab_size"] - 1, (1,), generator=g))
    ref = draft_block(w, cfg, feats, anchor)
    rows = draft.context_kv(feats, torch.arange(t))
    h = draft.block_hidden(torch.tensor([anchor]), torch.tensor([t]),
                           lambda layer: (rows[layer][0][None], rows[layer][1][None]))
    base = draft.base_logits(h)
    prop = sample_block(draft.markov_head, draft.confidence_head, h, base, torch.tensor([anchor]), "greedy")
    scale = float(ref["base"].abs().max())
    assert float((h[0].double() - ref["h"]).abs().max()) < 1e-4 * float(ref["h"].abs().max())
    assert float((base[0].double() - ref["base"]).abs().max()) < 1e-4 * scale
    assert torch.equal(prop.tokens[0], ref["tokens"])
    assert float((prop.logits[0].double() - ref["logits"]).abs().max()) < 1e-4 * scale
    assert torch.allclose(prop.confidence[0].double(), ref["confidence"], atol=1e-5)


@pytest.mark.parametrize("t,seed", [(1, 0), (9, 1), (40, 2)])
def test_draft_matches_the_reference(tiny_draft, checkpoint, t, seed):
    _compare(tiny_draft[0], *checkpoint, t, seed)


def test_reference_catches_a_causal_block_mask(tiny_draft, checkpoint, monkeypatch):
    real = dspark_module.block_mask
    monkeypatch.setattr(dspark_module, "block_mask", lambda ctx_len, n, g, window, causal: real(ctx_len, n, g, window,
                                                                                                True))
    with pytest.raises(AssertionError):
        _compare(tiny_draft[0], *checkpoint, 9, 1)


def test_reference_catches_block_positions_off_by_one(tiny_draft, checkpoint, monkeypatch):
    """design/dspark.md's pitfall (slot k at position t+k+1 instead of t+k): the anchor one position late."""
    real = dspark_module.DSparkDraft.block_hidden
    monkeypatch.setattr(dspark_module.DSparkDraft, "block_hidden",
                        lambda self, ids, positions, context: real(self, ids, positions + 1, context))
    with pytest.raises(AssertionError):
        _compare(tiny_draft[0], *checkpoint, 9, 1)
