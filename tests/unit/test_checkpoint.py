"""Loader, quantizer and checkpoint formats on the project's own tiny checkpoints."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from m3serve.kernels import mxfp8, nvfp4
from m3serve.model import layout as L
from m3serve.model.loader import CheckpointError, list_tensors, load_model
from m3serve.model.quantize import quantize_checkpoint
from m3serve.model.tiny import make_tiny
from support.required import require


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny") / "m")
    make_tiny(d, seed=3)
    return d


@pytest.fixture(scope="module")
def tiny_nvfp4(tiny, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("q") / "nvfp4")
    quantize_checkpoint(tiny, d, "nvfp4", progress=False)
    return d


def _all_tensors(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_tiny_has_every_layer_kind(tiny):
    model, report = load_model(tiny, progress=False)
    cfg = model.config
    assert report.layout == L.ORIGINAL
    assert set(cfg.layer_types) == {"full_attention", "minimax_m3_sparse"}
    assert set(cfg.mlp_layer_types) == {"dense", "sparse"}
    size = sum(os.path.getsize(os.path.join(tiny, f)) for f in os.listdir(tiny))
    assert size < 8 << 20
    assert len(list_tensors(tiny)) > 50 and len(set(list_tensors(tiny).values())) > 1  # sharded


def test_make_tiny_is_deterministic(tiny, tmp_path):
    again = str(tmp_path / "again")
    make_tiny(again, seed=3)
    a, b = _all_tensors(tiny), _all_tensors(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_transformers_layout_loads_to_the_same_weights(tiny, tmp_path):
    d = str(tmp_path / "tf")
    make_tiny(d, seed=3, layout=L.TRANSFORMERS)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in list_tensors(d))
    m1, _ = load_model(tiny, progress=False)
    m2, r2 = load_model(d, progress=False)
    assert r2.layout == L.TRANSFORMERS
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)


def test_nvfp4_quantize_load_dequantize_within_bounds(tiny, tiny_nvfp4):
    src, _ = load_model(tiny, progress=False)
    q, report = load_model(tiny_nvfp4, progress=False)
    assert report.formats, "nothing was loaded as NVFP4"
    assert all(f == "nvfp4" for f in report.formats.values())
    assert any("experts" in k for k in report.formats) and any("shared_experts" in k for k in report.formats)
    assert not any("self_attn" in k for k in report.formats)  # attention is kept by default
    for layer_q, layer_s in zip(q.model.layers, src.model.layers):
        if not hasattr(layer_q.mlp, "experts"):
            continue
        for name in ("gate_up_proj", "down_proj"):
            wq = getattr(layer_q.mlp.experts, name).dequantize(dtype=torch.float32)
            ws = getattr(layer_s.mlp.experts, name).dequantize(dtype=torch.float32)
            rel = ((wq - ws).norm() / ws.norm()).item()
            assert rel < 0.13, (name, rel)
            # per element: within the block's E2M1 step (amax_j / 6 after the E4M3 scale rounding)
            blocks = ws.reshape(*ws.shape[:-1], -1, 16)
            bound = blocks.abs().amax(-1, keepdim=True) / 6 * (1 + 2 ** -3) + 1e-6
            assert ((wq - ws).reshape(blocks.shape).abs() <= bound).all()


def test_nvfp4_packing_and_scale_conventions_on_disk(tiny, tiny_nvfp4):
    """Element 2i in the low nibble; weight_scale e4m3 per 16; weight_scale_2 = amax / (6 * 448)."""
    src = _all_tensors(tiny)
    q = _all_tensors(tiny_nvfp4)
    base = "language_model.model.layers.1.block_sparse_moe.experts.5.w1"
    packed, scale, s2 = q[base + ".weight"], q[base + ".weight_scale"], q[base + ".weight_scale_2"]
    w = src[base + ".weight"].float()
    assert packed.dtype == torch.uint8 and packed.shape == (w.shape[0], w.shape[1] // 2)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (w.shape[0], w.shape[1] // 16)
    assert s2.dtype == torch.float32 and s2.numel() == 1
    assert torch.isclose(s2, w.abs().max() / 2688.0, rtol=1e-6)
    lo = nvfp4.E2M1_VALUES[(packed[0, 0] & 0xF).long()] * scale[0, 0].float() * s2
    hi = nvfp4.E2M1_VALUES[(packed[0, 0] >> 4).long()] * scale[0, 0].float() * s2
    step = w[0, :16].abs().max() / 6 * 1.13
    assert abs(lo - w[0, 0]) <= step and abs(hi - w[0, 1]) <= step
    cfg = json.load(open(os.path.join(tiny_nvfp4, "config.json")))
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["group_size"] == 16 and "lm_head" in qc["exclude_modules"]


def _logits(model, ids):
    from support.reference import reference_logits
    return reference_logits(model, ids)


def test_nvfp4_model_stays_close_to_bf16(tiny, tiny_nvfp4, tmp_path):
    """~10% weight noise in the experts moves the logits of this random model by ~20%; a model with
    other weights is ~140% away. Measured: 0.17-0.26 mean relative logit error."""
    other = str(tmp_path / "other")
    make_tiny(other, seed=4)
    a, b, c = (load_model(d, progress=False)[0] for d in (tiny, tiny_nvfp4, other))
    ids = list(range(3, 60))
    la, lb, lc = _logits(a, ids), _logits(b, ids), _logits(c, ids)
    rel_q = ((la - lb).norm(dim=-1) / la.norm(dim=-1)).mean().item()
    rel_other = ((la - lc).norm(dim=-1) / la.norm(dim=-1)).mean().item()
    assert rel_q < 0.35 and rel_q < rel_other / 3, (rel_q, rel_other)
    assert (la.argmax(-1) == lb.argmax(-1)).float().mean() > 0.5


def test_mxfp8_round_trip(tiny, tmp_path):
    d = str(tmp_path / "mx")
    quantize_checkpoint(tiny, d, "mxfp8", modules=("experts", "shared_experts", "attention"), progress=False)
    raw = _all_tensors(d)
    name = "language_model.model.layers.0.self_attn.q_proj"
    assert raw[name + ".weight"].dtype == torch.float8_e4m3fn and raw[name + ".weight_scale_inv"].dtype == torch.uint8
    src, _ = load_model(tiny, progress=False)
    q, report = load_model(d, progress=False)
    assert report.formats["model.layers.0.self_attn.q_proj.w"] == "mxfp8"
    ws = src.model.layers[0].self_attn.q_proj.w.dequantize(dtype=torch.float32)
    wq = q.model.layers[0].self_attn.q_proj.w.dequantize(dtype=torch.float32)
    assert ((wq - ws).abs() <= ws.abs() * 2 ** -4 + 2 ** -12).all()
    assert torch.equal(wq, mxfp8.dequantize_mxfp8(raw[name + ".weight"], raw[name + ".weight_scale_inv"]))


def test_mixed_nvfp4_experts_mxfp8_shared_expert(tiny, tmp_path):
    """`--modules experts shared_experts:mxfp8`: M3.1-Flash's mix, each group in its own format."""
    d = str(tmp_path / "mixed")
    quantize_checkpoint(tiny, d, "nvfp4", modules=("experts", "shared_experts:mxfp8"), progress=False)
    _, report = load_model(d, progress=False)
    fmts = {k: v for k, v in report.formats.items() if ".mlp." in k and "layers.1." in k}
    assert {v for k, v in fmts.items() if ".experts." in k} == {"nvfp4"}, fmts
    assert {v for k, v in fmts.items() if "shared_experts" in k} == {"mxfp8"}, fmts
    qc = json.load(open(os.path.join(d, "config.json")))["quantization_config"]
    assert qc["module_schemes"] == {"experts": "nvfp4", "shared_experts": "mxfp8"}
    with pytest.raises(ValueError, match="scheme must be"):
        quantize_checkpoint(tiny, str(tmp_path / "bad"), "nvfp4", modules=("experts:int3",), progress=False)


def _rewrite(d, fn):
    """Apply fn(name, tensor) -> (name, tensor) | None to every tensor, keeping the index in sync."""
    index_path = os.path.join(d, "model.safetensors.index.json")
    index = json.load(open(index_path))
    new_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        out = {}
        for k, v in load_file(os.path.join(d, shard)).items():
            r = fn(k, v)
            if r is not None:
                out[r[0]] = r[1]
                new_map[r[0]] = shard
        save_file(out, os.path.join(d, shard))
    index["weight_map"] = new_map
    json.dump(index, open(index_path, "w"))


def test_compressed_tensors_nvfp4_names_load_identically(tiny_nvfp4, tmp_path):
    """compressed-tensors: weight_packed + weight_global_scale (the quant-side reciprocal)."""
    d = _copy(tiny_nvfp4, tmp_path / "ct")

    def to_ct(k, v):
        if k.endswith(".weight") and v.dtype == torch.uint8:
            return k[: -len(".weight")] + ".weight_packed", v
        if k.endswith(".weight_scale_2"):
            return k[: -len(".weight_scale_2")] + ".weight_global_scale", 1.0 / v
        return k, v

    _rewrite(d, to_ct)
    assert any(k.endswith(".weight_packed") for k in list_tensors(d))
    a, _ = load_model(tiny_nvfp4, progress=False)
    b, rb = load_model(d, progress=False)
    assert rb.formats
    wa = a.model.layers[1].mlp.experts.gate_up_proj.dequantize(dtype=torch.float32)
    wb = b.model.layers[1].mlp.experts.gate_up_proj.dequantize(dtype=torch.float32)
    assert torch.allclose(wa, wb, rtol=1e-6, atol=0)


@pytest.mark.parametrize("source, gone", [
    ("tiny", "language_model.model.layers.2.block_sparse_moe.experts.3.w3.weight"),
    ("tiny_nvfp4", "language_model.model.layers.1.block_sparse_moe.shared_experts.down_proj.weight_scale"),
])
def test_missing_tensor_is_named(source, gone, request, tmp_path):
    d = _copy(request.getfixturevalue(source), tmp_path / "m")
    _rewrite(d, lambda k, v: None if k == gone else (k, v))
    with pytest.raises(CheckpointError, match=gone.replace(".", r"\.")):
        load_model(d, progress=False)


def test_misshapen_tensor_names_expected_and_found(tiny, tmp_path):
    d = _copy(tiny, tmp_path / "m")
    bad = "language_model.model.layers.0.self_attn.k_proj.weight"
    _rewrite(d, lambda k, v: (k, v[:-1].clone()) if k == bad else (k, v))
    with pytest.raises(CheckpointError) as e:
        load_model(d, progress=False)
    msg = str(e.value)
    assert bad in msg and "expected shape (64, 64)" in msg and "found (63, 64)" in msg


def test_unexpected_tensor_and_bad_formats_are_errors(tiny, tmp_path):
    d = _copy(tiny, tmp_path / "m")
    _rewrite(d, lambda k, v: ("language_model.model.layers.0.self_attn.bogus.weight", v)
             if k.endswith("layers.0.self_attn.k_norm.weight") else (k, v))
    with pytest.raises(CheckpointError, match="bogus"):
        load_model(d, progress=False)
    d2 = _copy(tiny, tmp_path / "m2")
    bad = "language_model.model.layers.0.self_attn.o_proj.weight"
    _rewrite(d2, lambda k, v: (k, v.to(torch.int8)) if k == bad else (k, v))
    with pytest.raises(CheckpointError, match="unsupported weight format"):
        load_model(d2, progress=False)


def test_only_safetensors_are_read(tmp_path):
    d = tmp_path / "pickle"
    d.mkdir()
    torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")
    (d / "config.json").write_text(json.dumps({"model_type": "minimax_m3_vl_text", "num_hidden_layers": 1}))
    with pytest.raises(CheckpointError, match="no .safetensors"):
        load_model(str(d), progress=False)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../evil.safetensors"}}))
    with pytest.raises(CheckpointError, match="not a local .safetensors"):
        list_tensors(str(d))


def test_index_naming_a_missing_shard(tiny, tmp_path):
    d = _copy(tiny, tmp_path / "m")
    shard = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[0]
    os.remove(os.path.join(d, shard))
    with pytest.raises(CheckpointError, match=shard):
        load_model(d, progress=False)


def test_quantize_refuses_quantized_source(tiny_nvfp4, tmp_path):
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(tiny_nvfp4, str(tmp_path / "x"), "nvfp4", progress=False)


def _peak_tensors_alive(model_dir, monkeypatch, opener):
    """Load through `opener` (a `safe_open` stand-in) with every tensor it hands out tracked by a weak reference:
    (files opened, the most tensors read from the checkpoint alive at once, tensors read)."""
    import weakref

    import m3serve.model.loader as loader
    opened, alive, stats = [], [], {"peak": 0, "reads": 0}

    def track(t):
        alive[:] = [r for r in alive if r() is not None]
        alive.append(weakref.ref(t))
        stats["peak"], stats["reads"] = max(stats["peak"], len(alive)), stats["reads"] + 1
        return t

    class Slice:
        def __init__(self, inner):
            self.inner = inner

        def __getitem__(self, i):
            return track(self.inner[i])

        def __getattr__(self, name):  # get_dtype, get_shape
            return getattr(self.inner, name)

    class Spy:
        def __init__(self, path, *a, **k):
            self.inner = opener(path, *a, **k)
            opened.append(os.path.basename(path))

        def __enter__(self):
            self.ctx = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.ctx.keys()

        def get_slice(self, n):
            return Slice(self.ctx.get_slice(n))

        def get_tensor(self, n):
            return track(self.ctx.get_tensor(n))

    monkeypatch.setattr(loader, "safe_open", Spy)
    load_model(model_dir, progress=False)
    return opened, stats["peak"], stats["reads"]


class _EagerShard:
    """A broken loader's view of a shard: every tensor read when the file is opened (`load_file`), then served
    from memory, the way a loader that does not stream holds a whole shard."""

    def __init__(self, path, *a, **k):
        self.path = path

    def __enter__(self):
        self.tensors = load_file(self.path)
        return self

    def __exit__(self, *exc):
        self.tensors = None

    def keys(self):
        return list(self.tensors)

    def get_tensor(self, n):
        return self.tensors[n]

    def get_slice(self, n):
        with safe_open(self.path, "pt") as s:
            return s.get_slice(n)  # read_headers asks a slice only for its dtype and shape


def test_loader_streams_one_tensor_at_a_time(tiny, monkeypatch):
    """The loader reads safetensors one tensor at a time, shard by shard: at most two tensors read from the
    checkpoint are alive at once (the gate and up halves of one fused weight before they are joined), never a shard."""
    opened, peak, reads = _peak_tensors_alive(tiny, monkeypatch, safe_open)
    tensors = list_tensors(tiny)
    shards = sorted(set(tensors.values()))
    # headers once per shard, then one streaming pass per shard
    assert sorted(opened) == sorted(shards * 2)
    assert reads >= len(tensors)
    assert peak <= 2, f"{peak} checkpoint tensors alive at once"
    assert min(sum(1 for v in tensors.values() if v == sh) for sh in shards) > 2


def test_streaming_check_fails_on_an_eager_loader(tiny, monkeypatch):
    """The check above catches a loader that reads whole shards up front, which the old check (the files opened)
    let pass."""
    opened, peak, _ = _peak_tensors_alive(tiny, monkeypatch, _EagerShard)
    tensors = list_tensors(tiny)
    shards = sorted(set(tensors.values()))
    assert sorted(opened) == sorted(shards * 2)
    assert peak >= max(sum(1 for v in tensors.values() if v == sh) for sh in shards) > 2


def test_transformers_layout_loads_in_transformers(tmp_path):
    """make-tiny's transformers layout is what transformers 5.25 loads with nothing missing: the router bias is
    `...e_score_correction_bias` (a buffer, no `.weight` suffix; with one, transformers left it at zero)."""
    require("transformers")
    os.environ.setdefault("USE_HUB_KERNELS", "0")
    from transformers import MiniMaxM3VLForCausalLM

    d = str(tmp_path / "tf")
    make_tiny(d, seed=3, layout=L.TRANSFORMERS, dspark=False)
    names = list_tensors(d)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    hf, info = MiniMaxM3VLForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours, _ = load_model(d, progress=False)
    bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().sum() > 0
    assert torch.equal(bias, ours.model.layers[1].mlp.gate.e_score_correction_bias.float().to(bias.device))
