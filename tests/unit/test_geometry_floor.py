"""benchmarks/geometry.py's byte floor of a speculative step (bench_spec's "byte floor" column): the verify forward
reads the routed experts of (K + 1) x B tokens but the cache once, the draft side its weights once, the Markov W2
once per draft position and the lm_head rows it drafts from."""
import os
import sys
from types import SimpleNamespace

import pytest
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import geometry  # noqa: E402


class _Draft(nn.Module):
    """The parts draft_bytes reads: own weights (fp32 8x8 = 256 bytes), the Markov W2 (100 x 4 = 1,600 bytes), the
    shared lm_head (100 x 8 = 3,200 bytes), one draft layer of 1 KV head x 8."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 8, bias=False)
        self.markov_head = nn.Module()
        self.markov_head.markov_w2 = nn.Linear(4, 100, bias=False)
        self.config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=8, vocab_size=100)
        self.shared = SimpleNamespace(lm_head=nn.Linear(8, 100, bias=False))


def test_expected_experts():
    g = geometry
    assert g.expected_experts(128, 4, 1) == pytest.approx(4.0)
    assert g.expected_experts(128, 4, 8) == pytest.approx(128 * (1 - (124 / 128) ** 8))  # ~28.7 of 128
    assert g.expected_experts(128, 4, 2) < 8 and g.expected_experts(128, 4, 10_000) == pytest.approx(128)


def test_draft_bytes_count_w2_per_position_and_the_head_rows_drafted_from():
    g = geometry
    d = _Draft()
    kv = 2 * 1 * 10 * 2 * 1 * 8  # batch 2, 1 layer, 10 context rows, K and V, 1 head x 8, one byte
    assert g.draft_bytes(d, 3, 10, 2) == 256 + 3 * 1600 + 3200 + kv
    assert g.draft_bytes(d, 3, 10, 2, draft_head_rows=25) == 256 + 3 * 1600 + 800 + kv
    assert g.draft_bytes(d, 3, 10, 2, kv_bytes_per_element=2) == 256 + 3 * 1600 + 3200 + 2 * kv


def test_the_verify_forward_reads_more_experts_and_the_cache_once():
    g = geometry
    cfg = g.flash_geometry(3, 1, **g.SMOKE)
    expert = 1000
    wb = {"layers": [{"attention": 500, "mlp": 300, "expert": 0, "moe": False}]
          + [{"attention": 500, "mlp": 200, "expert": expert, "moe": True}] * 2, "head": 4000}
    d, b, k, ctx = _Draft(), 2, 3, 64
    f = g.speculative_floor(wb, cfg, d, b, ctx, k)
    e = lambda t: g.expected_experts(cfg.num_local_experts, cfg.num_experts_per_tok, t)  # noqa: E731
    assert f["plain"] == g.step_bytes(wb, cfg, b, ctx, [e(b)] * 2)
    more = 2 * (e(b * (k + 1)) - e(b)) * expert + b * k * cfg.hidden_size * 2  # experts, the k extra rows' input
    assert f["verify"] - f["plain"] == pytest.approx(more, abs=2)
    assert f["draft"] == g.draft_bytes(d, k, ctx, b)
    assert f["ratio"] == pytest.approx((f["verify"] + f["draft"]) / f["plain"]) and f["ratio"] > 1
    smaller = g.speculative_floor(wb, cfg, d, b, ctx, k, draft_head_rows=10)
    assert smaller["ratio"] < f["ratio"] and f["draft"] - smaller["draft"] == 3200 - 320
