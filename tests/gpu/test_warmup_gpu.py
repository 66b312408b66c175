"""No request waits on a compile: once the engine is built (the load-time warm-up ran, executor/warmup.py), a mix
of prompt lengths (1 to 700 tokens: single and chunked prefills, mixed steps), batch sizes and sampling options
compiles no Triton kernel, with DSpark speculative decoding too (the compile counter of benchmarks/geometry.py: Triton's compilation listener, which
also sees loads from the disk cache). The warm-up's time is in the engine's stats."""
from __future__ import annotations

import pytest
import torch

from m3serve import LLM, SamplingParams
from m3serve.model.quantize import quantize_checkpoint

import geometry

pytestmark = pytest.mark.gpu


def _mix(llm):
    g = torch.Generator().manual_seed(9)
    lengths = [1, 2, 7, 16, 17, 33, 100, 128, 129, 300, 513, 700]
    prompts = [torch.randint(3, 480, (n,), generator=g).tolist() for n in lengths]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True)
    for batch in (1, 3, 8, 12):
        for i in range(0, len(prompts), batch):
            llm.generate(prompts[i:i + batch], [greedy if j % 2 else sampled for j in range(len(prompts[i:i + batch]))])


@pytest.mark.parametrize("scheme,eager,speculative", [(None, False, False), ("nvfp4", False, False),
                                                      ("mxfp8", True, False), (None, False, True)])
def test_no_kernel_compiles_after_the_engine_is_ready(tiny_model_dir, tmp_path, scheme, eager, speculative):
    model = tiny_model_dir
    if scheme:
        model = str(tmp_path / scheme)
        quantize_checkpoint(tiny_model_dir, model, scheme, modules=("experts", "shared_experts", "dense_mlp"),
                            progress=False)
    with LLM(model=model, device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=16,
             max_num_batched_tokens=512, enforce_eager=eager,
             speculative_config={"method": "dspark", "num_speculative_tokens": 7} if speculative else None) as llm:
        stats = llm.engine.stats()
        assert stats["warmup_seconds"] > 0 and stats["load_seconds"] >= stats["warmup_seconds"]
        report = llm.engine.executor.worker.warmup  # (its compiles may be 0: an earlier test compiled them already)
        assert report is not None and report.steps > 10 and report.seconds > 0
        geometry.log_compiles()
        seen = len(geometry.COMPILES)
        _mix(llm)
        late = geometry.COMPILES[seen:]
    import triton
    triton.knobs.compilation.listener = None
    assert not late, f"{len(late)} kernels compiled after the engine was ready: {[name for _, _, name in late]}"
