"""Load a MiniMax-M3 checkpoint (sharded safetensors) into `M3ForCausalLM`.

- Only safetensors are read (never pickle), no remote code is run.
- Both layouts: the original Hub names and transformers 5.25 `save_pretrained` names (layout.py).
- Tensors stream shard by shard, one at a time, with a progress bar.
- Each module's format is read off the tensors present: bf16/fp32, NVFP4 (ModelOpt `weight` uint8 +
  `weight_scale` e4m3 + `weight_scale_2`, or compressed-tensors `weight_packed` +
  `weight_global_scale` = the reciprocal), MXFP8 (`weight` e4m3 + `weight_scale_inv` E8M0 per 32).
- A missing, unexpected or misshapen tensor is an error naming it.
- Tensor parallelism: built with a `Parallel` of rank r of N, the model holds only rank r's shard, and each
  tensor is read through `get_slice` for just that part (`Shard.source`, model/sharding.py); expert-parallel
  ranks skip the other ranks' experts' tensors altogether.
"""
from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from tqdm import tqdm

from m3serve.config import ConfigError, ModelConfig
from m3serve.distributed.parallel import Parallel
from m3serve.model import layout as L
from m3serve.model.sharding import QUANT_BLOCK, Shard
from m3serve.model.m3 import M3ForCausalLM, Rotary
from m3serve.model.weights import QuantWeight

log = logging.getLogger(__name__)

_FLOAT_DTYPES = {"F32", "BF16", "F16", "F64"}
_REQUIRED_ROLES = {"dense": {"weight"}, "nvfp4": {"weight", "weight_scale", "weight_scale_2"},
                   "mxfp8": {"weight", "weight_scale"}}


class CheckpointError(ValueError):
    pass


@dataclass
class LoadReport:
    layout: str
    formats: dict[str, str] = field(default_factory=dict)  # module path -> format, non-dense only
    num_tensors: int = 0
    kv_scales: dict[int, tuple[float, float]] = field(default_factory=dict)


def list_tensors(model_dir: str) -> dict[str, str]:
    """name -> shard file, from `model.safetensors.index.json` or the safetensors files present."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        for shard in set(weight_map.values()):
            if not shard.endswith(".safetensors") or os.path.basename(shard) != shard:
                raise CheckpointError(f"index names a shard {shard!r} that is not a local .safetensors file")
            if not os.path.isfile(os.path.join(model_dir, shard)):
                raise CheckpointError(f"index names shard {shard}, which is missing from {model_dir}")
        return dict(weight_map)
    shards = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not shards:
        raise CheckpointError(f"no .safetensors weights in {model_dir} (other formats are never loaded)")
    out = {}
    for shard in shards:
        with safe_open(os.path.join(model_dir, shard), "pt") as s:
            out.update({k: shard for k in s.keys()})
    return out


def read_headers(model_dir: str, weight_map: dict[str, str]) -> dict[str, tuple[str, list[int]]]:
    by_shard = defaultdict(list)
    for name, shard in weight_map.items():
        by_shard[shard].append(name)
    meta = {}
    for shard, names in by_shard.items():
        with safe_open(os.path.join(model_dir, shard), "pt") as s:
            keys = set(s.keys())
            for n in names:
                if n not in keys:
                    raise CheckpointError(f"tensor {n} is listed in the index but missing from {shard}")
                sl = s.get_slice(n)
                meta[n] = (sl.get_dtype(), sl.get_shape())
    return meta


def _detect_formats(parsed: dict, meta: dict) -> dict[tuple[int | None, str], str]:
    roles = defaultdict(dict)  # (layer, path) -> {role: dtype}
    for name, (layer, path, _part, _e, role) in parsed.items():
        roles[(layer, path)].setdefault(L.ROLES.get(role, role), (meta[name][0], name))
    formats = {}
    for key, r in roles.items():
        wdtype, wname = r.get("weight", (None, None))
        if wdtype is None:
            some = next(iter(r.values()))[1]
            raise CheckpointError(f"{some}: no weight tensor beside it for module {key[1]} of layer {key[0]}")
        if wdtype in _FLOAT_DTYPES:
            fmt = "dense"
        elif wdtype == "U8" and ("weight_scale_2" in r or "weight_global_scale" in r):
            fmt = "nvfp4"
        elif wdtype == "F8_E4M3" and r.get("weight_scale", ("",))[0] == "U8":
            fmt = "mxfp8"
        else:
            found = ", ".join(f"{k}={v[0]}" for k, v in sorted(r.items()))
            raise CheckpointError(f"{wname}: unsupported weight format ({found}); expected bf16/fp32, "
                                  "NVFP4 (uint8 + e4m3 weight_scale + weight_scale_2) or MXFP8 "
                                  "(e4m3 + uint8 weight_scale_inv)")
        formats[key] = fmt
    return formats


def _resolve(model: M3ForCausalLM, layer: int | None, path: str):
    full = path if layer is None else f"model.layers.{layer}.{path}"
    parent_name, _, attr = full.rpartition(".")
    parent = model.get_submodule(parent_name)
    return parent, attr, full


class _Coverage:
    """What has been loaded, row by row, so a missing tensor can be named."""

    def __init__(self):
        self.rows: dict[tuple, torch.Tensor] = {}
        self.params: set[str] = set()

    def mark(self, full: str, role: str, qw: QuantWeight, index, rows):
        key = (full, role)
        if key not in self.rows:
            self.rows[key] = torch.zeros(*qw.lead, qw.n, dtype=torch.bool)
        m = self.rows[key][index] if index is not None else self.rows[key]
        m[..., rows] = True


def load_model(model_dir: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               config: ModelConfig | None = None, progress: bool = True, parallel: Parallel | None = None
               ) -> tuple[M3ForCausalLM, LoadReport]:
    """The model (this rank's shard of it, with `parallel`) and a report of what was loaded."""
    cfg = config or ModelConfig.from_pretrained(model_dir)
    weight_map = list_tensors(model_dir)
    meta = read_headers(model_dir, weight_map)
    layout = L.detect_layout(weight_map)
    report = LoadReport(layout=layout)

    parsed = {}
    for name in weight_map:
        if L.SKIP.search(name):
            continue
        p = L.parse(name, layout)
        if p is None:
            raise CheckpointError(f"unexpected tensor {name} (not part of the MiniMax-M3 text model, "
                                  f"{layout} layout)")
        if p[0] is not None and p[0] >= cfg.num_hidden_layers:
            raise CheckpointError(f"tensor {name} is for layer {p[0]}, config has {cfg.num_hidden_layers}")
        parsed[name] = p
    formats = _detect_formats(parsed, meta)

    with torch.device("meta"):
        model = M3ForCausalLM(cfg, dtype, parallel=parallel)
    for (layer, path), fmt in formats.items():
        parent, attr, full = _resolve(model, layer, path)
        old = getattr(parent, attr)
        if fmt != "dense":
            if not isinstance(old, QuantWeight):
                raise CheckpointError(f"{full}: a {fmt} tensor where only a plain tensor is supported")
            setattr(parent, attr, _quant_weight(old, fmt, dtype, full, parallel))
            report.formats[full] = fmt
    model.to_empty(device=device)
    model.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta).to(device)

    cov = _Coverage()
    shards = sorted(set(weight_map[n] for n in parsed))
    bar = tqdm(total=len(parsed), desc="loading weights", unit="tensor", disable=not progress)
    for shard in shards:
        with safe_open(os.path.join(model_dir, shard), "pt", device="cpu") as s:
            for name in s.keys():
                if name not in parsed:
                    continue
                _load_one(model, cfg, name, parsed[name], _Reader(s, name, meta[name][1]), cov, report)
                bar.update(1)
    bar.close()
    report.num_tensors = len(parsed)
    if cfg.tie_word_embeddings and ("lm_head.w", "weight") not in cov.rows:
        model.lm_head.w.weight = model.model.embed_tokens.weight
        cov.mark("lm_head.w", "weight", model.lm_head.w, None, slice(None))
    _check_complete(model, cov, layout)
    model.eval()
    log.info("loaded %d tensors (%s layout) from %s; quantized modules: %d", len(parsed), layout,
             model_dir, len(report.formats))
    return model, report


def _quant_weight(old: QuantWeight, fmt: str, dtype, full: str, parallel: Parallel | None) -> QuantWeight:
    """A quantized weight in the place of the dense one the model was built with (same shard)."""
    block = QUANT_BLOCK[fmt]
    if old.shard.cols is not None and old.k % block:
        raise CheckpointError(
            f"{full}: a row-parallel {fmt} weight splits K={old.k * parallel.size} into {old.k} per rank over "
            f"tensor_parallel_size={parallel.size}; {fmt} needs K per rank to be a multiple of its block of {block} "
            "(scales cover blocks of K): use a smaller tensor_parallel_size")
    return QuantWeight(old.n, old.k, fmt, dtype, old.lead, device="meta", shard=old.shard)


class _Reader:
    """One checkpoint tensor of an open shard file, read whole or by the slices a `Shard` asks for."""

    def __init__(self, handle, name: str, shape: list[int]):
        self.handle, self.name, self.shape = handle, name, list(shape)

    def read(self, shard: Shard = Shard(), fmt: str = "dense", role: str = "weight", one_part: bool = False,
             stacked: bool = False) -> torch.Tensor:
        try:
            index = shard.source(self.shape, fmt, role, one_part, stacked, self.name)
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        if index == [()]:
            return self.handle.get_tensor(self.name)
        sl = self.handle.get_slice(self.name)
        parts = [sl[i] for i in index]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


def _load_one(model, cfg, name, p, reader: _Reader, cov: _Coverage, report: LoadReport) -> None:
    layer, path, part, expert, raw_role = p
    role = L.ROLES.get(raw_role)
    if role is None:
        raise CheckpointError(f"unexpected tensor {name}: unknown role {raw_role!r}")
    parent, attr, full = _resolve(model, layer, path)
    target = getattr(parent, attr)
    if role in ("k_scale", "v_scale"):
        t = reader.read()
        k, v = report.kv_scales.get(layer, (1.0, 1.0))
        report.kv_scales[layer] = (float(t), v) if role == "k_scale" else (k, float(t))
        return
    if isinstance(target, QuantWeight):
        if part in ("gate", "up"):
            half = target.n // 2
            rows = slice(0, half) if part == "gate" else slice(half, target.n)
        else:
            rows = slice(None)
        if expert is not None:
            if not 0 <= expert < cfg.num_local_experts:
                raise CheckpointError(f"{name}: expert {expert} out of range (config has {cfg.num_local_experts})")
            expert = target.shard.local_expert(expert)
            if expert is None:
                return  # another rank's expert: not read at all
        t = reader.read(target.shard, target.fmt, role, part in ("gate", "up"), part == "stack")
        if role == "weight_global_scale":  # compressed-tensors: quant-side g; we keep the dequant side 1/g
            t, role = 1.0 / t.float(), "weight_scale_2"
        try:
            target.load(role, t, index=expert, rows=rows, name=name)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        cov.mark(full, role, target, expert, rows)
        return
    if role != "weight":
        raise CheckpointError(f"unexpected tensor {name}: {full} is a plain tensor, not quantized")
    t = reader.read(getattr(parent, "shard", Shard()))
    if tuple(t.shape) != tuple(target.shape):
        raise CheckpointError(f"{name}: expected shape {tuple(target.shape)}, found {tuple(t.shape)}")
    with torch.no_grad():
        target.copy_(t)
    cov.params.add(full)


def _check_complete(model: M3ForCausalLM, cov: _Coverage, layout: str) -> None:
    missing = []
    for full, mod in model.named_modules():
        if isinstance(mod, QuantWeight):
            for role in sorted(_REQUIRED_ROLES[mod.fmt]):
                got = cov.rows.get((full, role))
                if got is not None and bool(got.all()):
                    continue
                missing.append(_name_missing(layout, full, mod, role, got))
    for full, _ in list(model.named_parameters()):
        if full not in cov.params and ".w." not in full:
            missing.append(_name_missing(layout, full, None, "weight", None))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError("checkpoint is missing tensor(s): " + ", ".join(missing[:5]) + more)


def _name_missing(layout, full, mod, role, got) -> str:
    layer = None
    path = full
    if full.startswith("model.layers."):
        rest = full[len("model.layers."):]
        layer_s, _, path = rest.partition(".")
        layer = int(layer_s)
    if mod is None:
        return L.checkpoint_name(layout, layer, path, None, None, role)
    expert = part = None
    if got is not None:
        idx = (~got).nonzero()[0].tolist()
        if mod.lead:
            expert = idx[0] + (mod.shard.experts[0] if mod.shard.experts else 0)  # a global id
        row = idx[-1]
    else:
        row = 0
        expert = 0 if mod.lead else None
    split = any(p == path and pt in ("gate", "up") for p, pt in L.LAYER_MAPS[layout].values())
    if split:
        part = "gate" if row < mod.n // 2 else "up"
    elif mod.lead and any(p == path and pt == "stack" for p, pt in L.LAYER_MAPS[layout].values()):
        part, expert = "stack", None
    return L.checkpoint_name(layout, layer, path, part, expert, role)
