"""Session fixtures for the engine tests: the tiny model (made once), loaded once in fp32, engines that
share it, and the reference greedy path (the model over a ContiguousCache, one sequence at a time)."""
import os

import pytest
import torch

from m3serve.config import EngineConfig
from support.reference import ReferenceRunner

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    """(model fp32 on CPU, load report, tokenizer), shared by every engine of the session."""
    from m3serve.model.loader import load_model
    from m3serve.text.tokenizer import Tokenizer

    model, report = load_model(tiny_model_dir, "cpu", torch.float32, progress=False)
    return model, report, Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def make_engine(tiny_model_dir, tiny_loaded):
    from m3serve.engine.llm_engine import LLMEngine

    model, report, tok = tiny_loaded

    def make(**options):
        options.setdefault("max_model_len", 512)
        cfg = EngineConfig(model=tiny_model_dir, device="cpu", **options)
        return LLMEngine(cfg, model=model, load_report=report, tokenizer=tok)

    return make


@pytest.fixture(scope="session")
def reference_greedy(tiny_loaded):
    """prompt ids, n -> the standalone greedy continuation (fp32 contiguous cache), memoized."""
    model = tiny_loaded[0]
    memo = {}

    def run(prompt, n, kv_dtype="float32"):
        key = (tuple(prompt), n, kv_dtype)
        if key not in memo:
            ref = ReferenceRunner(model, kv_dtype)
            feed, out = list(prompt), []
            for _ in range(n):
                out.append(int(ref.logits(feed)[-1].argmax()))
                feed = [out[-1]]
            memo[key] = out
        return memo[key]

    return run


def random_prompts(lengths, seed=0, vocab=500):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run_to_completion(engine, max_steps=10_000):
    """Step until idle; {request_id: (token_ids, finish_reason, outputs)}."""
    res = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            toks, _, outs = res.setdefault(o.request_id, ([], None, []))
            toks += o.new_token_ids
            outs.append(o)
            res[o.request_id] = (toks, o.finish_reason, outs)
    assert not engine.has_unfinished_requests(), "engine did not finish"
    return res


def run_staggered(engine, prompts, gens, every: int) -> dict:
    """Greedy requests r0, r1, ... (prompt ids, max tokens), one added before every `every`-th step while the others
    run, the block manager checked after each step: {request id: token ids}."""
    from m3serve.engine.sampling_params import SamplingParams

    res, pending, step = {}, list(range(len(prompts))), 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i = pending.pop(0)
            engine.add_request(f"r{i}", prompt_token_ids=prompts[i],
                               sampling_params=SamplingParams(temperature=0.0, max_tokens=gens[i], ignore_eos=True))
        for o in engine.step():
            res.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
        check_invariants(engine)
    return res


def check_invariants(engine):
    """Ref counts equal the number of live sequences holding each page; free list = unreferenced pages."""
    bm, sch = engine.block_manager, engine.scheduler
    counts = [0] * bm.num_pages
    for seq in sch.running:
        assert len(seq.pages) * bm.block_size >= max(seq.num_computed_tokens, seq.num_tokens - 1)
        for p in seq.pages:
            counts[p] += 1
    for seq in sch.waiting:
        assert not seq.pages
    assert [p.ref_count for p in bm.pages] == counts
    assert set(bm.free_ids) == {i for i, c in enumerate(counts) if c == 0}
    for h, pid in bm.cached.items():
        assert bm.pages[pid].hash == h


def run_queued(engine, late=None, abort_at=None, max_steps=500):
    """Step to completion (async scheduling's tests): request (id, prompt, params) = late[step] added before that step,
    abort_at = (step, request id) aborted before it; the block manager checked whenever no step is queued, and whole
    at the end. ({request id: (tokens, finish reason, text, logprobs)}, the steps that left a step queued)."""
    late, res, queued, step = late or {}, {}, 0, 0

    def collect(o):
        toks, _, text, lps = res.get(o.request_id, ([], None, "", []))
        res[o.request_id] = (toks + list(o.new_token_ids), o.finish_reason, text + o.text,
                             lps + list(o.logprobs or []))

    while engine.has_unfinished_requests():
        if step in late:
            rid, p, sp = late[step]
            engine.add_request(rid, prompt_token_ids=p, sampling_params=sp)
        if abort_at is not None and step == abort_at[0]:
            out = engine.abort_request(abort_at[1])
            if out is not None:
                collect(out)
        for o in engine.step():
            collect(o)
        queued += engine._inflight is not None
        if engine._inflight is None:
            check_invariants(engine)
        step += 1
        assert step < max_steps
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages
    return res, queued


def same_outputs(a, b):
    """Two `run_queued` results agree: tokens, finish reasons, texts; logprobs to 1e-5."""
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid][:3] == b[rid][:3], rid
        assert len(a[rid][3]) == len(b[rid][3])
        for da, db in zip(a[rid][3], b[rid][3]):
            assert da.keys() == db.keys() and all(abs(da[t] - db[t]) < 1e-5 for t in da)


@pytest.fixture(scope="session")
def eu():
    """Engine test utilities (a fixture, so test files need not import conftest by name)."""
    from types import SimpleNamespace

    return SimpleNamespace(random_prompts=random_prompts, run_to_completion=run_to_completion,
                           check_invariants=check_invariants, run_queued=run_queued, same_outputs=same_outputs,
                           run_staggered=run_staggered)


@pytest.fixture(scope="session")
def tiny_draft(tiny_model_dir, tiny_loaded, tmp_path_factory):
    """(the tiny DSpark draft, loaded in fp32 for the session's tiny target, its load report, its directory)."""
    from m3serve.model.dspark_loader import load_dspark
    from m3serve.model.dspark_tiny import make_tiny_dspark

    d = str(tmp_path_factory.mktemp("tiny_dspark"))
    make_tiny_dspark(tiny_model_dir, d)
    draft, report = load_dspark(d, tiny_loaded[0], "cpu", torch.float32)
    return draft, report, d
