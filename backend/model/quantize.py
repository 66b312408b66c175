"""`m3serve quantize`: write a ModelOpt-style NVFP4 / MXFP8 checkpoint from a bf16/fp32 one.

Streams: one source tensor at a time, output written shard by shard, in the original Hub layout
(per-expert w1/w2/w3), as the published M3 NVFP4 checkpoints are. Default modules: routed experts
and the shared expert; attention, indexer, router, embeddings, norms and lm_head stay as they are.
No activation calibration is done, so NVFP4 is written as weight-only (`W4A16_NVFP4`: no
`input_scale`), which is what Hopper runs anyway (formats.md 1.4).
"""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import safe_open
from tqdm import tqdm


from m3serve.config import ModelConfig
from m3serve.kernels import mxfp8, nvfp4
from m3serve.model import layout as L
from m3serve.model.checkpoint_writer import ShardWriter, pieces_for, write_config
from m3serve.model.loader import CheckpointError, list_tensors

MODULE_GROUPS = {
    "experts": ("mlp.experts.",),
    "shared_experts": ("mlp.shared_experts.",),
    "dense_mlp": ("mlp.gate_up_proj.", "mlp.down_proj."),
    "attention": ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "self_attn.o_proj."),
    "indexer": ("self_attn.indexer.q_proj.", "self_attn.indexer.k_proj."),
}
DEFAULT_MODULES = ("experts", "shared_experts")
# fnmatch patterns (original names) for what each group covers, for `exclude_modules`
_PATTERNS = {
    "experts": ["*block_sparse_moe.experts.*"],
    "shared_experts": ["*block_sparse_moe.shared_experts.*"],
    "dense_mlp": ["*.mlp.*"],
    "attention": ["*self_attn.q_proj", "*self_attn.k_proj", "*self_attn.v_proj", "*self_attn.o_proj"],
    "indexer": ["*self_attn.index_q_proj", "*self_attn.index_k_proj"],
}
_ALWAYS_EXCLUDED = ["lm_head", "*embed_tokens*", "*block_sparse_moe.gate", "*norm*", "vision_tower*",
                    "multi_modal_projector*", "*mtp*"]


def _group_of(path: str) -> str | None:
    for group, prefixes in MODULE_GROUPS.items():
        if any(path.startswith(p) or path == p.rstrip(".") for p in prefixes):
            return group
    return None


def _quantize_piece(name: str, t: torch.Tensor, scheme: str) -> dict[str, torch.Tensor]:
    if scheme == "nvfp4":
        packed, block_scale, scale_2 = nvfp4.quantize_nvfp4(t.float())
        return {f"{name}.weight": packed, f"{name}.weight_scale": block_scale,
                f"{name}.weight_scale_2": scale_2.reshape(()).float()}
    q, scale = mxfp8.quantize_mxfp8(t.float())
    return {f"{name}.weight": q, f"{name}.weight_scale_inv": scale}


def quantization_config(scheme: str, modules: tuple[str, ...]) -> dict:
    excluded = list(_ALWAYS_EXCLUDED)
    for group, pats in _PATTERNS.items():
        if group not in modules and group != "dense_mlp":
            excluded += pats
    if "dense_mlp" not in modules:
        excluded += ["*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj"]
    algo = {"nvfp4": "W4A16_NVFP4", "mxfp8": "MXFP8"}[scheme]
    return {"quant_method": "modelopt", "quant_algo": algo, "group_size": 16 if scheme == "nvfp4" else 32,
            "exclude_modules": excluded, "kv_cache_quant_algo": None,
            "producer": {"name": "m3serve", "version": "0.1.0"}, "quantized_modules": list(modules)}


def module_schemes(scheme: str, modules: tuple[str, ...]) -> dict[str, str]:
    """{group: scheme} from module entries "group" (quantized with `scheme`) or "group:scheme" (e.g.
    "shared_experts:mxfp8" next to NVFP4 experts, as M3.1-Flash ships them)."""
    out = {}
    for m in modules:
        group, _, own = m.partition(":")
        out[group] = own or scheme
    unknown = set(out) - set(MODULE_GROUPS)
    if unknown:
        raise ValueError(f"unknown module group(s) {sorted(unknown)}; choose from {sorted(MODULE_GROUPS)}")
    bad = {s for s in [scheme, *out.values()] if s not in ("nvfp4", "mxfp8")}
    if bad:
        raise ValueError(f"scheme must be nvfp4 or mxfp8, got {sorted(bad)[0]!r}")
    return out


def quantize_checkpoint(src: str, dst: str, scheme: str = "nvfp4", modules: tuple[str, ...] = DEFAULT_MODULES,
                        max_shard_bytes: int = 4 << 30, progress: bool = True) -> dict:
    """Quantize `modules` (group names, or "group:scheme" to override `scheme` for that group) of `src` into `dst`."""
    schemes = module_schemes(scheme, modules)
    modules = tuple(schemes)
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError("--out must differ from --model")
    cfg = ModelConfig.from_pretrained(src)
    weight_map = list_tensors(src)
    src_layout = L.detect_layout(weight_map)
    writer = ShardWriter(dst, max_shard_bytes)
    counts = {"quantized": 0, "kept": 0, "skipped": 0}
    bar = tqdm(total=len(weight_map), desc=f"quantizing ({scheme})", unit="tensor", disable=not progress)
    for shard in sorted(set(weight_map.values())):
        with safe_open(os.path.join(src, shard), "pt") as s:
            for name in s.keys():
                bar.update(1)
                if L.SKIP.search(name):
                    counts["skipped"] += 1
                    continue
                p = L.parse(name, src_layout)
                if p is None:
                    raise CheckpointError(f"unexpected tensor {name} in {src}")
                layer, path, part, expert, role = p
                if L.ROLES.get(role) != "weight":
                    raise CheckpointError(f"{name}: source is already quantized; quantize a bf16/fp32 checkpoint")
                t = s.get_tensor(name)
                group = _group_of(path)
                for pt, e, piece in pieces_for(L.ORIGINAL, path, part, expert, t):
                    out_name = L.checkpoint_name(L.ORIGINAL, layer, path, pt, e, "weight")
                    if group in schemes:
                        for k, v in _quantize_piece(out_name[: -len(".weight")], piece, schemes[group]).items():
                            writer.add(k, v)
                        counts["quantized"] += 1
                    else:
                        writer.add(out_name, piece.clone())
                        counts["kept"] += 1
    bar.close()
    writer.close()
    cfg.quantization_config = quantization_config(scheme, modules)
    if len(set(schemes.values())) > 1 or scheme not in schemes.values():
        cfg.quantization_config["module_schemes"] = schemes
    write_config(dst, cfg, L.ORIGINAL)
    with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
        qc = cfg.quantization_config
        json.dump({"producer": qc["producer"], "quantization": {
            "quant_algo": qc["quant_algo"], "kv_cache_quant_algo": None, "group_size": qc["group_size"],
            "exclude_modules": qc["exclude_modules"]}}, f, indent=2)
    for extra in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if os.path.isfile(os.path.join(src, extra)):
            shutil.copy(os.path.join(src, extra), os.path.join(dst, extra))
    return counts
