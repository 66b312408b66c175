"""A reduced draft vocabulary (model/dspark_vocab.py, speculative_config `draft_vocab_size`): the draft's base logits
and Markov bias over the subset equal the full draft's restricted to it, drafts are the subset's vocabulary ids, the
tensor-parallel share of the subset's lm_head rows gathers to the same logits as one rank, bad options and
checkpoints are refused by name, and greedy decoding through the engine (eager and the graphs' static-buffer path)
equals plain decoding with controlled drafts partly outside the subset. (The emitted distribution: the chi-square
tests of test_spec_verify.py and test_spec_engine.py; TP 2 on gloo: tests/parallel/test_tp_spec.py.)"""
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from m3serve.config import ConfigError
from m3serve.distributed.parallel import Parallel
from m3serve.engine.sampling_params import SamplingParams
from m3serve.executor.speculative.controlled import ControlledProposals
from m3serve.executor.speculative.probs import sampling_probs
from m3serve.executor.speculative.proposer import sample_block
from m3serve.model.dspark_loader import load_dspark
from m3serve.model.dspark_tiny import make_tiny_dspark
from m3serve.model.dspark_vocab import DraftVocab, select_draft_vocab
from m3serve.model.loader import CheckpointError
from m3serve.speculative_config import SpeculativeConfig
from m3serve.step_io import SamplingInput

K = 4


def subset_ids(n: int, seed: int = 3, vocab: int = 512) -> list[int]:
    """n distinct ids in a seeded "frequency" order (not sorted: the loader sorts them)."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:n].tolist()


@pytest.fixture(scope="module")
def vocab_draft_dir(tiny_model_dir, tmp_path_factory):
    """The tiny draft (the same seeded weights as the session's) with 300 of its 512 ids as draft_vocab_ids."""
    d = str(tmp_path_factory.mktemp("tiny_dspark_vocab"))
    make_tiny_dspark(tiny_model_dir, d, draft_vocab_ids=subset_ids(300))
    return d


def test_subset_logits_and_drafts_equal_the_full_draft_restricted(tiny_loaded, vocab_draft_dir):
    target = tiny_loaded[0]
    full, _ = load_dspark(vocab_draft_dir, target, "cpu", torch.float32)
    sub, _ = load_dspark(vocab_draft_dir, target, "cpu", torch.float32, draft_vocab_size=200)
    ids = sub.vocab_ids
    assert full.vocab_ids is None and ids.tolist() == sorted(subset_ids(300)[:200])
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, K, target.config.hidden_size, generator=g)
    u_full, u_sub = full.base_logits(h), sub.base_logits(h)
    assert u_sub.shape == (3, K, 200) and torch.allclose(u_sub, u_full[..., ids], atol=1e-5, rtol=1e-5)
    prev = torch.tensor([5, 300, 17])  # W1 is indexed by the full vocabulary: ids outside the subset too
    bias_full = full.markov_head.position(h[:, 0], prev, None)[0]
    bias_sub = sub.markov_head.position(h[:, 0], prev, None)[0]
    assert torch.allclose(bias_sub, bias_full[:, ids], atol=1e-5)
    anchors = torch.tensor([1, 2, 3])
    got = sample_block(sub.markov_head, None, h, u_sub, anchors, "greedy", vocab_ids=ids)
    z_sub = got.logits
    assert torch.equal(got.tokens, ids[z_sub.argmax(-1)]) and bool(torch.isin(got.tokens, ids).all())
    # z over the subset is the full draft's z (teacher-forced with the same previous tokens) at the subset's columns
    prevs = torch.cat([anchors[:, None], got.tokens[:, :-1]], 1)
    z_full = u_full + full.markov_head.block(h, prevs)
    assert torch.allclose(z_sub, z_full[..., ids], atol=1e-4)
    st = SamplingInput.full(3, temperature=0.9, top_k=50)
    u = torch.rand(3, K, generator=g)
    drawn = sample_block(sub.markov_head, None, h, u_sub, anchors, "probabilistic", st, u, vocab_ids=ids)
    assert drawn.probs.shape == (3, K, 200) and drawn.vocab_ids is ids
    assert torch.allclose(drawn.probs, sampling_probs(drawn.logits.flatten(0, 1), st.repeat_rows(K)).view(3, K, -1))
    col = torch.searchsorted(ids, drawn.tokens)
    assert bool((ids[col] == drawn.tokens).all()) and bool((drawn.probs.gather(2, col[..., None]) > 0).all())


@pytest.mark.parametrize("size", [2, 4])
def test_rank_shares_gather_to_one_ranks_logits(size):
    """Each rank's rows of a subset crowded into the low ids (as frequent tokens are), padded to the fullest rank:
    the ranks' logits concatenated in rank order and picked at `cols` are the one-rank subset logits."""
    v, hidden = 64, 8
    g = torch.Generator().manual_seed(size)
    weight = torch.randn(v, hidden, generator=g)
    ids = torch.tensor(sorted({*range(0, 20), 23, 40, 41, 63}))
    h = torch.randn(5, hidden, generator=g)
    want = F.linear(h, weight[ids])
    part = v // size
    shares = [DraftVocab.build(ids, weight[r * part:(r + 1) * part], v, Parallel(rank=r, size=size))
              for r in range(size)]
    assert all(torch.equal(s.cols, shares[0].cols) for s in shares)
    assert {s.head.shape[0] for s in shares} == {16 if size == 4 else 21}  # ids 0-15; 0-19, 23
    gathered = torch.cat([F.linear(h, s.head) for s in shares], -1)
    assert torch.allclose(gathered.index_select(-1, shares[0].cols), want, atol=1e-6)
    one = DraftVocab.build(ids, weight, v, None)
    assert one.cols is None and torch.allclose(one.logits(h, None), want, atol=1e-6)


def _with_tensor(src, dst, tensor):
    """A copy of the draft checkpoint `src` whose draft_vocab_ids is `tensor` (None: removed)."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    state = load_file(path)
    state.pop("draft_vocab_ids")
    if tensor is not None:
        state["draft_vocab_ids"] = tensor
    save_file(state, path)
    return str(dst)


def test_bad_draft_vocab_options_and_checkpoints_are_refused(tiny_loaded, tiny_draft, vocab_draft_dir, tiny_model_dir,
                                                             tmp_path):
    base = {"method": "dspark", "num_speculative_tokens": 3}
    for bad in (0, -4, True, "32768", 2.5):
        (problem,) = SpeculativeConfig.problems({**base, "draft_vocab_size": bad})
        assert problem.startswith("speculative_config.draft_vocab_size: must be an integer >= 1"), problem
    assert SpeculativeConfig.problems({**base, "draft_vocab_size": None}) == []
    assert SpeculativeConfig.from_dict({**base, "draft_vocab_size": 64}).draft_vocab_size == 64
    target = tiny_loaded[0]
    cases = [
        (vocab_draft_dir, 301, ConfigError, "draft_vocab_size: 301 is out of range"),
        (tiny_draft[2], 64, ConfigError, "has no draft_vocab_ids tensor"),
        (_with_tensor(vocab_draft_dir, tmp_path / "out", torch.tensor([3, 512, 7, -1])), 4, ConfigError,
         "id(s) [512, -1] outside the vocabulary [0, 512)"),
        (_with_tensor(vocab_draft_dir, tmp_path / "dup", torch.tensor([9, 4, 9, 4, 1])), 5, ConfigError,
         "duplicate id(s) [4, 9]"),
        (_with_tensor(vocab_draft_dir, tmp_path / "float", torch.tensor([1.0, 2.0])), 2, CheckpointError,
         "draft_vocab_ids: expected a 1-D int64 tensor, found F32"),
    ]
    for path, n, kind, msg in cases:
        with pytest.raises(kind) as e:
            load_dspark(path, target, "cpu", torch.float32, draft_vocab_size=n)
        assert msg in str(e.value), e.value
    # the first N only: ids past N are neither used nor in the way (here the duplicate 9 comes at the third)
    draft, _ = load_dspark(str(tmp_path / "dup"), target, "cpu", torch.float32, draft_vocab_size=2)
    assert draft.vocab_ids.tolist() == [4, 9]
    # without the option the tensor is ignored (a checkpoint may carry it), with or without a bad one
    assert load_dspark(str(tmp_path / "out"), target, "cpu", torch.float32)[0].vocab_ids is None
    with pytest.raises(ConfigError, match="duplicate id"):
        select_draft_vocab(torch.tensor([5, 5]), 2, 512)
    # the writer (make-tiny, the benchmarks' geometry, the learned trainer) refuses what the loader would
    for ids, msg in (([7, 3, 7], "duplicate id"), ([1, 600], "outside the vocabulary")):
        with pytest.raises(ConfigError, match=msg):
            make_tiny_dspark(tiny_model_dir, str(tmp_path / "w"), draft_vocab_ids=ids)


def _engine(make_engine, draft_dir, graphs, **spec):
    eng = make_engine(max_num_seqs=8, num_gpu_blocks_override=64, max_model_len=256, speculative_config={
        "method": "dspark", "num_speculative_tokens": K, "model": draft_dir, **spec})
    if graphs:
        eng.executor.worker.drafter.enable_graphs(8, 256)
    return eng


@pytest.mark.parametrize("graphs", [False, True])
def test_greedy_with_a_draft_vocab_equals_plain_decoding(graphs, make_engine, reference_greedy, tiny_model_dir,
                                                         tmp_path, eu):
    """Drafts from a subset holding about half of the tokens the target produces (controlled: the target's own token
    with p = 0.8 where it is in the subset): the output is plain greedy decoding, drafts were accepted and rejected,
    and every drafted token lies in the subset."""
    prompts = eu.random_prompts([9, 30, 17], seed=21)
    gens = [25, 18, 30]
    want = [reference_greedy(p, n) for p, n in zip(prompts, gens)]
    produced = sorted({t for w in want for t in w})
    ids = produced[::2] + [t for t in subset_ids(100, seed=5) if t not in produced]
    d = str(tmp_path / "draft")
    make_tiny_dspark(tiny_model_dir, d, draft_vocab_ids=ids)
    eng = _engine(make_engine, d, graphs, draft_vocab_size=len(ids))
    drafter = eng.executor.worker.drafter
    control = ControlledProposals({1000 + i: p + w for i, (p, w) in enumerate(zip(prompts, want))}, 0.8,
                                  drafter.draft.config.vocab_size)
    drafted = []
    drafter.proposal_hook = lambda prop, *a: (lambda out: (drafted.append(out.tokens), out)[1])(control(prop, *a))
    for i, (p, n) in enumerate(zip(prompts, gens)):
        eng.add_request(f"r{i}", prompt_token_ids=p, sampling_params=SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True, seed=1000 + i))
    got = eu.run_to_completion(eng)
    assert [got[f"r{i}"][0] for i in range(3)] == want
    st = eng.stats()
    assert 0 < st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]
    assert bool(torch.isin(torch.cat([t.flatten() for t in drafted]), torch.tensor(ids)).all())
    if graphs:
        assert drafter.graphs.num_steps > 0
