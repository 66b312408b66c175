"""The typed step input: built from scheduled sequences, it carries only tensors, lists and scalars, so it survives
pickle and `torch.distributed.broadcast_object_list` to another rank unchanged."""
import os
import pickle
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.scheduler import ScheduledBatch
from m3serve.engine.sequence import Sequence
from m3serve.step_io import SamplingInput, StepInput
from m3serve.engine.step_builder import StepBuilder
from support.steps import assert_same

B = 4


def _scheduled() -> ScheduledBatch:
    """A mixed step: a decode with penalties and logprobs, a prefill chunk, a finished prefill below min_tokens."""
    a = Sequence("a", 0, [5, 6, 7, 8, 9], SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.3,
                                                             logprobs=2), 10, seed=(1 << 64) - 1)
    a.token_ids += [11, 12]
    a.num_computed_tokens, a.pages = 6, [3, 1]
    b = Sequence("b", 1, list(range(20, 31)), SamplingParams(temperature=0.0), 10, seed=7)
    b.pages = [0, 2, 5]
    c = Sequence("c", 2, [1, 2, 3], SamplingParams(top_p=0.5, min_tokens=2, stop_token_ids=[4]), 10, seed=9)
    c.pages = [4]
    return ScheduledBatch([a, b, c], [1, 6, 3])


def test_step_builder_fields():
    step, seqs = StepBuilder(B, {2}).build(_scheduled())
    assert [s.request_id for s in seqs] == ["a", "c"]  # b's chunk does not finish its prompt
    assert step.input_ids.tolist() == [12, 20, 21, 22, 23, 24, 25, 1, 2, 3]
    assert step.positions.tolist() == [6, 0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert step.query_start_loc_cpu == [0, 1, 7, 10] and step.seq_lens_cpu == [7, 6, 3]
    assert step.slot_mapping.tolist() == [1 * B + 2] + [0, 1, 2, 3, 2 * B, 2 * B + 1] + [16, 17, 18]
    assert step.block_tables.tolist() == [[3, 1, 0], [0, 2, 5], [4, 0, 0]]
    assert step.logits_indices.tolist() == [0, 9] and not step.is_decode
    s = step.sampling
    assert s.temperature.tolist() == [0.800000011920929, 1.0] and s.top_k.tolist() == [5, 0]
    assert s.seeds.tolist() == [-1, 9] and s.positions.tolist() == [7, 3]
    assert (s.needs_top_k, s.needs_top_p, s.needs_min_p, s.all_greedy) == (True, True, False, False)
    assert s.max_num_logprobs == 2
    assert s.prompt_token_ids.tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, -1, -1]]
    assert s.output_token_ids.tolist() == [[11, 12], [-1, -1]] and s.frequency_penalty is None
    assert s.suppress_token_ids.tolist() == [[-1, -1], [2, 4]]  # c is below min_tokens: EOS and its stop id


def test_step_input_pickles():
    step, _ = StepBuilder(B, {2}).build(_scheduled())
    step.attn_tiles = torch.tensor([[0, 0, 1]], dtype=torch.int32)
    back = pickle.loads(pickle.dumps(step))
    assert_same(step, back)
    assert isinstance(back.sampling, SamplingInput)


def _rank(rank: int, path: str, result: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    obj = [StepBuilder(B, {2}).build(_scheduled())[0] if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    if rank == 1:
        torch.save(obj[0], result)
    dist.destroy_process_group()


def test_step_input_broadcasts_to_another_rank():
    with tempfile.TemporaryDirectory() as d:
        result = os.path.join(d, "received.pt")
        mp.spawn(_rank, args=(os.path.join(d, "store"), result), nprocs=2, join=True)
        received = torch.load(result, weights_only=False)
    assert isinstance(received, StepInput)
    assert_same(StepBuilder(B, {2}).build(_scheduled())[0], received)


def test_block_table_rows_follow_page_changes():
    """Rows of the block table come from each sequence's page array: grown past its first capacity, trimmed, then
    grown again (a rejected draft's lookahead page returned, a new one taken), and replaced (freed, readmitted)."""
    s = Sequence("s", 0, list(range(72)), SamplingParams(temperature=0.0), 10)
    for p in range(40):
        s.pages.append(100 + p)
    s.pages.truncate(18)
    s.pages.append(7)
    s.num_computed_tokens = 71
    other = Sequence("o", 1, [1, 2], SamplingParams(temperature=0.0), 10)
    other.pages, other.num_computed_tokens = [9], 1
    batch = ScheduledBatch([s, other], [1, 1], [0, 0])
    step, _ = StepBuilder(B, set()).build(batch)
    assert step.block_tables.tolist() == [[100 + p for p in range(18)] + [7], [9] + [0] * 18]
    assert step.slot_mapping.tolist() == [117 * B + 3, 9 * B + 1] and step.positions.tolist() == [71, 1]
    ahead, _ = StepBuilder(B, set()).build(batch, prev_rows=[0, 1])  # the tokens a running step samples
    assert ahead.slot_mapping.tolist() == [7 * B + 0, 9 * B + 2] and ahead.positions.tolist() == [72, 2]
    s.pages = []
    assert not s.pages and step.block_tables[0, 18] == 7  # the step's table is a copy, not a view of the pages
