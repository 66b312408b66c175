"""Tensor / expert parallelism without processes: each rank's loader reads only its shard (bytes counted at the
safetensors calls), the ranks' shards put back together are the full model (dense, NVFP4, MXFP8), a row-parallel
split that breaks a quantization block is refused by name; the step's one-buffer encoding and the shared-memory
channel; config, CLI and capacity per rank."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os

import pytest
import safetensors
import torch

from m3serve.config import ConfigError, EngineConfig, preset
from m3serve.distributed import shm_channel as ch
from m3serve.distributed import step_codec
from m3serve.distributed.parallel import Parallel
from m3serve.step_io import SamplerOutput, SamplingInput, SpeculativeInput, StepInput
from m3serve.model import loader
from m3serve.model.loader import CheckpointError, load_model
from m3serve.model.sharding import check_divisible
from m3serve.model.quantize import quantize_checkpoint
from m3serve.model.tiny import make_tiny
from m3serve.model.weights import QuantWeight
from support.steps import assert_same

TP4 = dict(num_attention_heads=8, num_key_value_heads=4, index_n_heads=4)  # 4 ranks divide every split


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny4") / "m")
    make_tiny(d, seed=5, **TP4)
    return d


class _Counting:
    """safe_open as the loader sees it, counting the bytes of every tensor it hands out."""

    def __init__(self, counter: list[int]):
        self.counter = counter

    def __call__(self, path, framework, device="cpu"):
        outer = self

        @contextlib.contextmanager
        def opened():
            with safetensors.safe_open(path, framework, device=device) as handle:
                yield _Handle(handle, outer.counter)

        return opened()


class _Handle:
    def __init__(self, handle, counter):
        self.handle, self.counter = handle, counter

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, name):
        return self._count(self.handle.get_tensor(name))

    def get_slice(self, name):
        sl, outer = self.handle.get_slice(name), self

        class _Slice:
            def get_dtype(self):
                return sl.get_dtype()

            def get_shape(self):
                return sl.get_shape()

            def __getitem__(self, index):
                return outer._count(sl[index])

        return _Slice()

    def _count(self, t):
        self.counter[0] += t.numel() * t.element_size()
        return t


def _load_counting(monkeypatch, d, parallel=None):
    counter = [0]
    monkeypatch.setattr(loader, "safe_open", _Counting(counter))
    model, report = load_model(d, progress=False, parallel=parallel)
    monkeypatch.undo()
    return model, counter[0]


def _checkpoint_bytes(d) -> tuple[int, int]:
    """(all tensor bytes, bytes of the tensors every rank needs whole: norms, routers, the shared index key)."""
    total = replicated = 0
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            with safetensors.safe_open(os.path.join(d, f), "pt") as s:
                for name in s.keys():
                    t = s.get_tensor(name)
                    n = t.numel() * t.element_size()
                    total += n
                    if any(k in name for k in ("norm", "gate.weight", "e_score_correction_bias", "index_k_proj")):
                        replicated += n
    return total, replicated


@pytest.mark.parametrize("size,ep", [(2, False), (4, False), (4, True)])
def test_each_rank_reads_and_holds_only_its_shard(tiny4, monkeypatch, size, ep):
    assert len([f for f in os.listdir(tiny4) if f.endswith(".safetensors")]) > 1  # a sharded checkpoint
    total, replicated = _checkpoint_bytes(tiny4)
    full, full_read = _load_counting(monkeypatch, tiny4)
    assert full_read == total
    full_numel = sum(t.numel() for t in full.state_dict().values())
    rep_numel = sum(t.numel() for k, t in full.state_dict().items()
                    if any(s in k for s in ("norm", "gate.weight", "e_score_correction_bias", "indexer.k_proj")))
    for rank in range(size):
        model, read = _load_counting(monkeypatch, tiny4, Parallel(rank, size, ep))
        assert read == replicated + (total - replicated) // size, (rank, read)
        numel = sum(t.numel() for t in model.state_dict().values())
        assert numel == rep_numel + (full_numel - rep_numel) // size


# logical K elements per stored column of each QuantWeight buffer
K_PER_COLUMN = {"weight": 1, "qweight": 1, "packed": 2, "block_scale": 16, "scale_e8m0": 32}


def _place(full: torch.Tensor, local: torch.Tensor, shard, k_per_column: int = 1) -> None:
    """Write a rank's local weight [*lead, n, k] into the full tensor where its shard says it belongs."""
    idx = [slice(None)] * full.dim()
    if shard.experts is not None:
        idx[0] = slice(*shard.experts)
    if shard.cols is not None:
        idx[-1] = slice(shard.cols[0] // k_per_column, shard.cols[1] // k_per_column)
    if shard.rows is None:
        full[tuple(idx)] = local
        return
    r0, r1 = shard.rows
    block, part = full.shape[-2] // shard.parts, r1 - r0
    for j in range(shard.parts):
        idx[-2] = slice(j * block + r0, j * block + r1)
        full[tuple(idx)] = local[..., j * part:(j + 1) * part, :]


def _reassembled_equals(d, size, ep, buffers=("weight",)):
    """Every weight of the ranks' models, put back by its shard, equals the full model's."""
    full = dict(load_model(d, progress=False)[0].named_modules())
    ranks = [dict(load_model(d, progress=False, parallel=Parallel(r, size, ep))[0].named_modules())
             for r in range(size)]
    checked = 0
    for name, mod in full.items():
        if not isinstance(mod, QuantWeight):
            continue
        for buf in [b for b, _ in mod.named_buffers() if b in buffers]:
            want = getattr(mod, buf)
            got = torch.zeros_like(want)
            got_bits = got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got
            for r in ranks:
                local, shard = getattr(r[name], buf), r[name].shard
                local = local.view(torch.uint8) if local.dtype == torch.float8_e4m3fn else local
                if buf == "scale_2":  # one per output row [*lead, n]: split with the rows, whole across K
                    _place(got_bits.unsqueeze(-1), local.unsqueeze(-1), dataclasses.replace(shard, cols=None))
                else:
                    _place(got_bits, local, shard, K_PER_COLUMN[buf])
            assert torch.equal(got_bits, want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want), name
            checked += 1
    emb = torch.cat([r["model.embed_tokens"].weight for r in ranks])
    assert torch.equal(emb, full["model.embed_tokens"].weight)
    return checked


@pytest.mark.parametrize("size,ep", [(2, False), (2, True)])
def test_shards_put_back_together_are_the_full_model(tiny4, size, ep):
    assert _reassembled_equals(tiny4, size, ep) > 20


def test_fewer_kv_heads_than_ranks_are_replicated(tiny_model_dir):
    """The tiny model has 2 KV (and index) heads: at TP4 each is held by 2 ranks, with its group of q heads."""
    assert _reassembled_equals(tiny_model_dir, 4, False) > 20
    for rank in range(4):
        attn = load_model(tiny_model_dir, progress=False, parallel=Parallel(rank, 4))[0].model.layers[1].self_attn
        assert (attn.n_heads, attn.n_kv, attn.indexer.n_heads) == (1, 1, 1)
        assert attn.k_proj.w.shard.rows == (rank // 2 * 32, rank // 2 * 32 + 32)  # head_dim 32


@pytest.mark.parametrize("scheme,buffers", [("nvfp4", ("packed", "block_scale", "scale_2")),
                                            ("mxfp8", ("qweight", "scale_e8m0"))])
def test_quantized_weights_shard_with_their_scales(tiny4, tmp_path, scheme, buffers):
    d = str(tmp_path / scheme)
    quantize_checkpoint(tiny4, d, scheme, ("experts", "shared_experts", "dense_mlp", "attention"), progress=False)
    assert _reassembled_equals(d, 2, False, buffers) > 20
    if scheme == "mxfp8":  # K/4 = 16 of an expert's down projection: not a whole MXFP8 block of 32
        with pytest.raises(CheckpointError, match=r"row-parallel mxfp8 .* multiple of its block of 32"):
            load_model(d, progress=False, parallel=Parallel(1, 4))
    else:
        load_model(d, progress=False, parallel=Parallel(3, 4))  # K/4 = 16: whole NVFP4 blocks


def test_divisibility_errors_name_every_dimension():
    cfg = preset("minimax-m3")
    for size, ep in ((4, False), (8, False), (8, True)):  # TP8: each of the 4 KV heads on 2 ranks
        check_divisible(cfg, size, ep)
    with pytest.raises(ConfigError, match=r"num_attention_heads=64, vocab_size=200064, num_key_value_heads .*=4, "
                                          r"shared_intermediate_size=3072, num_local_experts \(expert parallel\)=128"):
        check_divisible(cfg, 3 * 5, True)


def _step(with_sampling: bool = True) -> StepInput:
    step = StepInput.contiguous([[5, 6, 7], [9]], [0, 4])
    step.block_tables = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    step.slot_mapping = torch.tensor([48, 49, 50, 4], dtype=torch.int64)
    if with_sampling:
        step.sampling = SamplingInput(
            temperature=torch.tensor([0.0, 0.7]), top_k=torch.tensor([0, 5], dtype=torch.int32),
            top_p=torch.tensor([1.0, 0.9]), min_p=torch.zeros(2), seeds=torch.tensor([-1, 7]),
            positions=torch.tensor([3, 5]), needs_top_k=True, max_num_logprobs=3,
            suppress_token_ids=torch.tensor([[2, -1], [-1, -1]]))
    return step


def _speculative_step() -> StepInput:
    """A speculative step (it reaches every rank with its sampling fields and its SpeculativeInput)."""
    step = _step()
    i64 = dict(dtype=torch.int64)
    step.speculative = SpeculativeInput(torch.tensor([0], **i64), torch.tensor([0], **i64), torch.tensor([0], **i64),
                          torch.tensor([2], **i64), torch.tensor([1, 2], **i64), torch.tensor([0, 1], **i64),
                          torch.tensor([1], **i64), 3)
    return step


def test_step_encodes_to_one_buffer_and_back():
    for obj in (_step(), _step(False), _speculative_step(),
                SamplerOutput(torch.tensor([1, 2]), torch.tensor([-0.5, -1.25]))):
        enc = step_codec.encode(obj)
        buf = torch.zeros(enc.nbytes, dtype=torch.uint8)
        enc.write_into(buf)
        back = step_codec.decode(buf)
        assert_same(obj, back)
        buf.fill_(0xFF)  # the decoded tensors own their bytes
        assert_same(obj, back)
    with pytest.raises(TypeError, match="cannot be sent"):
        step_codec.encode(SamplerOutput(torch.tensor([1]), torch.tensor([0.5]), top_token_ids="x"))


def test_shared_memory_channel_grows_and_reports_a_closed_peer():
    b = ch.Broadcaster(1, initial_bytes=4096)
    r = ch.Receiver(*(os.dup(fd) for fd in b.worker_fds(0)))
    b.spawned()
    try:
        r.status("ready", num_pages=3)
        assert b.poll_status(1.0) == [(1, {"event": "ready", "num_pages": 3})]
        big = _step()
        big.block_tables = torch.arange(20_000, dtype=torch.int32).view(2, -1)  # 80 KB: the file grows
        for obj in (_step(), big, _step(False)):
            b.send(ch.STEP, 7, obj)
            cmd, arg, got = r.wait(0.1, lambda: True)
            assert (cmd, arg) == (ch.STEP, 7)
            assert_same(obj, got)
        b.send(ch.INIT, 12)
        assert r.wait(0.1, lambda: True) == (ch.INIT, 12, None)
        assert r.wait(0.05, lambda: False)[0] == ch.SHUTDOWN  # parent gone: stop waiting
    finally:
        r.close()
    assert b.poll_status(1.0) == [(1, {"event": "closed"})]
    with pytest.raises(ConnectionError, match="rank 1 is gone"):
        b.send(ch.STEP, 0, _step())
    b.close()


def test_engine_config_cli_and_capacity_per_rank():
    from m3serve.capacity import plan
    from m3serve.cli import _engine_kwargs, build_parser

    EngineConfig(model="x", tensor_parallel_size=4, enable_expert_parallel=True).validate()
    with pytest.raises(ConfigError, match="tensor_parallel_size: must be an integer >= 1"):
        EngineConfig(model="x", tensor_parallel_size=0).validate()
    with pytest.raises(ConfigError, match="'cuda:1' names one GPU"):
        EngineConfig(model="x", tensor_parallel_size=2, device="cuda:1").validate()
    a = build_parser().parse_args(["generate", "--model", "m", "-tp", "4", "--enable-expert-parallel"])
    kw = _engine_kwargs(a)
    assert kw["tensor_parallel_size"] == 4 and kw["enable_expert_parallel"] is True
    flash = preset("minimax-m3.1-flash")
    one, four = plan(flash, "nvfp4", gpus=1), plan(flash, "nvfp4", gpus=4)
    assert one["per_rank"]["weight_bytes"] == one["weight_bytes"]
    # a quarter of the weights, plus three quarters of what every rank holds in full: the routers (fp32), the
    # index-key projections (bf16) and down_proj's per-row NVFP4 scales (fp32, one per hidden row of each expert)
    full = (flash.num_local_experts * flash.hidden_size * flash.num_moe_layers * 4
            + flash.hidden_size * flash.index_head_dim * flash.num_sparse_layers * 2
            + 4 * flash.num_local_experts * flash.num_moe_layers * flash.hidden_size)
    assert 0.3e9 < full < 0.5e9
    assert four["per_rank"]["weight_bytes"] - four["weight_bytes"] / 4 == pytest.approx(0.75 * full, abs=4)
    assert four["per_rank"]["cache_bytes_per_token"] == 34_560 // 4 + 4_104  # its KV heads + every index key


def test_the_tp4_example_repositories_load_one_engine():
    """At TP4 one engine takes the 4 GPUs: each example repository holds one LLM model (text or ids role)."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "model_repository_examples")
    for example in sorted(os.listdir(root)):
        if not os.path.isdir(os.path.join(root, example)):
            continue
        llm_models = []
        for model in os.listdir(os.path.join(root, example)):
            with open(os.path.join(root, example, model, "config.pbtxt")) as f:
                pbtxt = f.read()
            if 'string_value: "text"' in pbtxt or 'string_value: "ids"' in pbtxt:
                llm_models.append(model)
                with open(os.path.join(root, example, model, "1", "model.json")) as f:
                    assert json.load(f)["tensor_parallel_size"] == 4
        assert llm_models == ["m3"], (example, llm_models)
