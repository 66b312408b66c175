"""The DSpark draft model: its config against the target, checkpoint loading (round trip and errors that
name the tensor), the Markov head's sequential loop against its teacher-forced form (test 6), rank 0 =
DFlash, and the tiny draft run on the tiny target's real tapped hidden states."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from m3serve.config import ConfigError
from m3serve.executor.speculative.draft_cache import DraftKVCache
from m3serve.executor.speculative.probs import sampling_probs
from m3serve.step_io import SamplingInput
from m3serve.executor.speculative.proposer import insert_context, propose, sample_block
from m3serve.model.dspark_config import DSparkConfig
from m3serve.model.dspark_heads import ConfidenceHead, MarkovHead
from m3serve.model.dspark_loader import load_dspark
from m3serve.model.dspark_taps import TapRecorder
from m3serve.model.dspark_tiny import make_tiny_dspark, random_dspark_state
from m3serve.model.loader import CheckpointError
from support.reference import ReferenceRunner

BASE = {"architectures": ["Qwen3DSparkModel"], "block_size": 7, "target_layer_ids": [0, 2], "mask_token_id": 5,
        "markov_rank": 8, "num_hidden_layers": 1}


def test_config_completes_from_the_target_and_checks_it(tiny_loaded):
    t = tiny_loaded[0].config
    cfg = DSparkConfig.from_dict(BASE, t)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        t.num_attention_heads, t.num_key_value_heads, t.head_dim)
    assert (cfg.intermediate_size, cfg.rope_theta, cfg.rotary_dim) == (t.dense_intermediate_size, t.rope_theta,
                                                                        t.rotary_dim)
    assert not cfg.rms_norm_unit_offset and cfg.hidden_act == "silu" and cfg.layer_types == ["full_attention"]
    assert DSparkConfig.from_dict({**BASE, "head_dim": 16, "num_key_value_heads": 4}, t).head_dim == 16
    bad = [("architectures", ["Gemma4DSparkModel"], "Gemma4DSparkModel"), ("hidden_size", 128, "hidden_size"),
           ("d2t", [1], "d2t"), ("num_target_layers", 7, "num_target_layers"),
           ("target_layer_ids", [2, 1], "strictly increasing"), ("target_layer_ids", [0, 4], "must lie in"),
           ("mask_token_id", 99999, "mask_token_id"), ("markov_head_type", "lstm", "markov_head_type"),
           ("attention_bias", True, "attention_bias"), ("layer_types", ["sliding_attention"], "sliding_window")]
    for key, value, message in bad:
        with pytest.raises(ConfigError, match=message):
            DSparkConfig.from_dict({**BASE, key: value}, t)
    with pytest.raises(ConfigError, match="block_size"):
        DSparkConfig.from_dict({k: v for k, v in BASE.items() if k != "block_size"}, t)
    swa = DSparkConfig.from_dict({**BASE, "num_hidden_layers": 2, "sliding_window": 8,
                                  "layer_types": ["full_attention", "sliding_attention"]}, t)
    assert swa.attention_window(0) == (None, False) and swa.attention_window(1) == (8, True)


def test_tapped_layer_count_comes_from_fc(tiny_loaded):
    t, h = tiny_loaded[0].config, tiny_loaded[0].config.hidden_size
    assert DSparkConfig.from_dict(BASE, t).with_taps_from_fc(2 * h).target_layer_ids == [0, 2]
    # speculators' implicit final layer: one more feature than ids -> the target's last layer (HF's last state)
    assert DSparkConfig.from_dict(BASE, t).with_taps_from_fc(3 * h).target_layer_ids == [0, 2, t.num_hidden_layers - 1]
    with pytest.raises(ConfigError, match="4 tapped layers"):
        DSparkConfig.from_dict(BASE, t).with_taps_from_fc(4 * h)
    with pytest.raises(ConfigError, match="not a multiple"):
        DSparkConfig.from_dict(BASE, t).with_taps_from_fc(2 * h + 1)


def test_tiny_draft_round_trip_shares_embedding_and_lm_head(tiny_draft, tiny_loaded):
    draft, report, d = tiny_draft
    target = tiny_loaded[0]
    written = random_dspark_state(draft.config, seed=0)
    state = draft.state_dict()
    assert set(state) == set(written)
    for name, t in written.items():
        assert torch.equal(state[name].float(), t.to(torch.bfloat16).float()), name
    assert draft.shared.embed_tokens is target.model.embed_tokens and draft.shared.lm_head is target.lm_head
    assert "embed_tokens.weight" not in state and "lm_head.weight" not in state
    assert report.shared_checked == ["embed_tokens.weight", "lm_head.weight"] and not report.shared_mismatch
    assert draft.tap_layers == [0, 1, 2] and draft.block_size == 7
    assert sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)) < 600_000


def _rewrite(src, dst, edit):
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    save_file(edit(load_file(path)), path)
    return dst


@pytest.mark.parametrize("edit,message", [
    (lambda sd: {k: v for k, v in sd.items() if k != "layers.1.mlp.up_proj.weight"}, "layers.1.mlp.up_proj.weight"),
    (lambda sd: {**sd, "markov_head.markov_w1.weight": sd["markov_head.markov_w1.weight"][:, :8].clone()},
     r"markov_head.markov_w1.weight: expected shape \[512, 16\], found \[512, 8\]"),
    (lambda sd: {**sd, "layers.0.self_attn.q_proj.bias": torch.zeros(128)},
     "unexpected tensor layers.0.self_attn.q_proj.bias"),
    (lambda sd: {**sd, "fc.weight": sd["fc.weight"][:, :100].clone()}, "not a multiple"),
    (lambda sd: {**sd, "norm.weight": sd["norm.weight"].to(torch.int32)}, "norm.weight: expected a floating-point"),
    (lambda sd: {**sd, "lm_head.weight": sd["lm_head.weight"][:100].clone()}, r"lm_head.weight: expected shape"),
], ids=["missing", "misshapen", "unexpected", "fc-width", "int-dtype", "shared-shape"])
def test_loader_names_the_bad_tensor(tiny_draft, tiny_loaded, tmp_path, edit, message):
    d = _rewrite(tiny_draft[2], tmp_path / "bad", edit)
    with pytest.raises((CheckpointError, ConfigError), match=message):
        load_dspark(str(d), tiny_loaded[0])


def test_loader_takes_vllm_prefix_fp8_scales_and_flags_a_foreign_embedding(tiny_draft, tiny_loaded, tmp_path):
    def edit(sd):
        out = {("model." + k if k != "lm_head.weight" else k): v for k, v in sd.items()}
        out["model.layers.1.self_attn.k_scale"] = torch.tensor(0.25)
        out["model.embed_tokens.weight"] = out["model.embed_tokens.weight"] + 1.0
        return out

    draft, report = load_dspark(str(_rewrite(tiny_draft[2], tmp_path / "pref", edit)), tiny_loaded[0])
    assert report.kv_scales == {1: (0.25, 1.0)}
    assert report.shared_mismatch == ["embed_tokens.weight"] and report.shared_checked == ["lm_head.weight"]
    assert all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), tiny_draft[0].state_dict().values()))


def _random_heads(kind, g, v=20, r=4, hid=12):
    head = MarkovHead(kind, v, r, hid, torch.float32)
    conf = ConfidenceHead(hid, r)
    for p in list(head.parameters()) + list(conf.parameters()):
        p.copy_(torch.randn(p.shape, generator=g) * 0.7)
    return head, conf


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_markov_sequential_loop_equals_teacher_forced(kind):
    g = torch.Generator().manual_seed(0)
    s, k, v, hid = 6, 5, 20, 12
    head, conf = _random_heads(kind, g, v=v, hid=hid)
    h, base = torch.randn(s, k, hid, generator=g), torch.randn(s, k, v, generator=g)
    anchor = torch.randint(0, v, (s,), generator=g)
    st = SamplingInput.full(s, temperature=0.9, top_k=12)
    prop = sample_block(head, conf, h, base, anchor, "probabilistic", st, torch.rand(s, k, generator=g))
    prev = torch.cat([anchor[:, None], prop.tokens[:, :-1]], 1)
    assert torch.allclose(prop.logits, base + head.block(h, prev), atol=1e-5)
    assert torch.allclose(prop.confidence, conf(h, head.prev_embedding(prev)), atol=1e-6)
    assert torch.allclose(prop.probs, sampling_probs(prop.logits.flatten(0, 1), st.repeat_rows(k)).view(s, k, v))
    assert bool((prop.probs.gather(2, prop.tokens[..., None]) > 0).all())
    # the bias follows the previous token: other previous tokens give other logits
    assert not torch.allclose(head.block(h, prev), head.block(h, (prev + 1) % v))
    # the engine's step keeps no logits (keep_logits=False): the same draws otherwise
    g.manual_seed(5)
    u = torch.rand(s, k, generator=g)
    kept, lean = (sample_block(head, conf, h, base, anchor, "probabilistic", st, u, keep_logits=keep)
                  for keep in (True, False))
    assert lean.logits is None and kept.logits is not None and torch.equal(lean.tokens, kept.tokens)
    assert torch.equal(lean.probs, kept.probs) and torch.equal(lean.confidence, kept.confidence)


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_gated_and_rnn_heads_load_under_their_checkpoint_names(tiny_model_dir, tiny_loaded, tmp_path, kind):
    make_tiny_dspark(tiny_model_dir, str(tmp_path), markov_head_type=kind)
    draft, _ = load_dspark(str(tmp_path), tiny_loaded[0])
    extra = {"gated": "markov_head.gate_proj", "rnn": "markov_head.joint_proj"}[kind]
    assert {extra + ".weight", extra + ".bias"} <= set(draft.state_dict()) and draft.markov_head.kind == kind


def test_markov_rank_zero_is_dflash(tiny_model_dir, tiny_loaded, tmp_path):
    g = torch.Generator().manual_seed(1)
    h, base = torch.randn(3, 4, 8, generator=g), torch.randn(3, 4, 10, generator=g)
    prop = sample_block(None, None, h, base, torch.zeros(3, dtype=torch.long), "greedy")
    assert torch.equal(prop.logits, base) and torch.equal(prop.tokens, base.argmax(-1))
    assert torch.equal(prop.confidence, torch.ones(3, 4))
    make_tiny_dspark(tiny_model_dir, str(tmp_path), markov_rank=0, enable_confidence_head=False,
                     confidence_head_with_markov=False)
    draft, _ = load_dspark(str(tmp_path), tiny_loaded[0])
    assert draft.markov_head is None and draft.confidence_head is None
    assert not any(k.startswith(("markov", "confidence")) for k in draft.state_dict())


def _tiny_prefill(target, prompt, layer_ids):
    """The target over `prompt` (fp32, contiguous cache): (final hidden [n, H], tapped features [n, m*H])."""
    with TapRecorder(target, layer_ids) as rec:
        hidden = ReferenceRunner(target).hidden(prompt)
    return hidden, rec.take()


def test_taps_are_the_layer_outputs(tiny_loaded):
    target = tiny_loaded[0]
    prompt = torch.randint(0, 500, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    n, h = target.config.num_hidden_layers, target.config.hidden_size
    hidden, feats = _tiny_prefill(target, prompt, [-1, 1, n - 1])
    assert feats.shape == (21, 3 * h)
    assert torch.equal(feats[:, :h], target.model.embed_tokens(torch.tensor(prompt)))
    assert torch.equal(feats[:, 2 * h:], hidden)  # the last id is HF's last hidden state: post-norm
    assert not torch.allclose(feats[:, h:2 * h], feats[:, :h])


def test_tiny_draft_on_real_tapped_hidden_states(tiny_loaded, tiny_draft):
    """Prefill the tiny target capturing the draft's taps, insert them into a paged draft cache through the
    target's pages, draft a block: the same block as a recompute from the features, valid distributions."""
    target, draft = tiny_loaded[0], tiny_draft[0]
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 500, (37,), generator=g).tolist()
    hidden, feats = _tiny_prefill(target, prompt, draft.tap_layers)
    anchor = target.compute_logits(hidden[-1:]).argmax(-1)
    t = torch.tensor([len(prompt)])
    bs, table = 16, torch.tensor([[5, 2, 7]], dtype=torch.int32)
    pos = torch.arange(len(prompt))
    slots = table[0, pos // bs].long() * bs + pos % bs
    st, u = SamplingInput.full(1, temperature=0.8, top_p=0.95), torch.rand(1, 7, generator=g)
    rows = draft.context_kv(feats, pos)
    want = sample_block(draft.markov_head, draft.confidence_head, *_block(draft, anchor, t, rows), anchor,
                        "probabilistic", st, u)
    for kv_dtype, tol in (("float32", 1e-5), ("fp8", 0.06)):
        cache = DraftKVCache.for_draft(draft.config, 8, bs, kv_dtype)
        insert_context(draft, cache, feats, pos, slots)
        got = propose(draft, cache, anchor, t, table, 7, "probabilistic", st, u)
        err = float((got.logits - want.logits).abs().max() / want.logits.abs().max())
        assert err < tol, (kv_dtype, err)  # measured: 5e-7 (fp32), 0.024 (fp8)
    assert torch.allclose(got.probs.sum(-1), torch.ones(1, 7)) and bool((got.tokens < 512).all())
    assert torch.allclose(got.confidence, want.confidence, atol=0.05)
    assert ((got.confidence > 0) & (got.confidence < 1)).all()


def _block(draft, anchor, t, rows):
    """(h, U) of a block over contiguous context rows (row j = position j) for one sequence."""
    h = draft.block_hidden(anchor, t, lambda layer: (rows[layer][0][None], rows[layer][1][None]))
    return h, draft.base_logits(h)


def test_make_tiny_cli_writes_a_loadable_draft(tmp_path, capsys):
    from m3serve.cli import main
    from m3serve.model.loader import load_model

    out = str(tmp_path / "tiny")
    assert main(["make-tiny", "--out", out, "--layout", "transformers", "--dspark"]) == 0
    target, _ = load_model(out, progress=False)
    draft, report = load_dspark(os.path.join(out, "dspark"), target)
    assert report.shared_checked == ["embed_tokens.weight", "lm_head.weight"]
    with open(os.path.join(out, "dspark", "config.json")) as f:
        assert json.load(f)["target_layer_ids"] == draft.tap_layers == [0, 1, 2]
