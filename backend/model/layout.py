"""Checkpoint name maps: the original Hub layout and what transformers 5.25 `save_pretrained` writes.

Each map takes a per-layer name suffix (without the tensor role, e.g. `.weight_scale`) to
`(module path in M3ForCausalLM, part)`; `part` is None (the whole tensor), "gate"/"up" (a half of a
fused gate|up weight) or "stack" (all experts in one tensor). `{e}` stands for an expert index.
"""
from __future__ import annotations

import re

ORIGINAL = "original"
TRANSFORMERS = "transformers"

_ATTN = {
    "self_attn.q_proj": ("self_attn.q_proj.w", None),
    "self_attn.k_proj": ("self_attn.k_proj.w", None),
    "self_attn.v_proj": ("self_attn.v_proj.w", None),
    "self_attn.o_proj": ("self_attn.o_proj.w", None),
}
_NORMS = {
    "self_attn.q_norm": ("self_attn.q_norm.weight", None),
    "self_attn.k_norm": ("self_attn.k_norm.weight", None),
    "input_layernorm": ("input_layernorm.weight", None),
    "post_attention_layernorm": ("post_attention_layernorm.weight", None),
}

LAYER_MAPS = {
    ORIGINAL: {
        **_ATTN, **_NORMS,
        "self_attn.index_q_proj": ("self_attn.indexer.q_proj.w", None),
        "self_attn.index_k_proj": ("self_attn.indexer.k_proj.w", None),
        "self_attn.index_q_norm": ("self_attn.indexer.q_norm.weight", None),
        "self_attn.index_k_norm": ("self_attn.indexer.k_norm.weight", None),
        "mlp.gate_proj": ("mlp.gate_up_proj.w", "gate"),
        "mlp.up_proj": ("mlp.gate_up_proj.w", "up"),
        "mlp.down_proj": ("mlp.down_proj.w", None),
        "block_sparse_moe.gate": ("mlp.gate.weight", None),
        "block_sparse_moe.e_score_correction_bias": ("mlp.gate.e_score_correction_bias", None),
        "block_sparse_moe.experts.{e}.w1": ("mlp.experts.gate_up_proj", "gate"),
        "block_sparse_moe.experts.{e}.w3": ("mlp.experts.gate_up_proj", "up"),
        "block_sparse_moe.experts.{e}.w2": ("mlp.experts.down_proj", None),
        "block_sparse_moe.shared_experts.gate_proj": ("mlp.shared_experts.gate_up_proj.w", "gate"),
        "block_sparse_moe.shared_experts.up_proj": ("mlp.shared_experts.gate_up_proj.w", "up"),
        "block_sparse_moe.shared_experts.down_proj": ("mlp.shared_experts.down_proj.w", None),
    },
    TRANSFORMERS: {
        **_ATTN, **_NORMS,
        "self_attn.indexer.q_proj": ("self_attn.indexer.q_proj.w", None),
        "self_attn.indexer.k_proj": ("self_attn.indexer.k_proj.w", None),
        "self_attn.indexer.q_norm": ("self_attn.indexer.q_norm.weight", None),
        "self_attn.indexer.k_norm": ("self_attn.indexer.k_norm.weight", None),
        "mlp.gate_up_proj": ("mlp.gate_up_proj.w", None),
        "mlp.down_proj": ("mlp.down_proj.w", None),
        "mlp.gate": ("mlp.gate.weight", None),
        "mlp.gate.e_score_correction_bias": ("mlp.gate.e_score_correction_bias", None),
        "mlp.experts.gate_up_proj": ("mlp.experts.gate_up_proj", "stack"),
        "mlp.experts.down_proj": ("mlp.experts.down_proj", "stack"),
        # per-expert exports made with transformers-side names (seen in third-party NVFP4 checkpoints)
        "mlp.experts.{e}.gate_proj": ("mlp.experts.gate_up_proj", "gate"),
        "mlp.experts.{e}.up_proj": ("mlp.experts.gate_up_proj", "up"),
        "mlp.experts.{e}.down_proj": ("mlp.experts.down_proj", None),
        "mlp.shared_experts.gate_up_proj": ("mlp.shared_experts.gate_up_proj.w", None),
        "mlp.shared_experts.gate_proj": ("mlp.shared_experts.gate_up_proj.w", "gate"),
        "mlp.shared_experts.up_proj": ("mlp.shared_experts.gate_up_proj.w", "up"),
        "mlp.shared_experts.down_proj": ("mlp.shared_experts.down_proj.w", None),
    },
}

GLOBAL_MAPS = {
    ORIGINAL: {"language_model.model.embed_tokens": "model.embed_tokens.weight",
               "language_model.model.norm": "model.norm.weight",
               "language_model.lm_head": "lm_head.w"},
    TRANSFORMERS: {"model.embed_tokens": "model.embed_tokens.weight", "model.norm": "model.norm.weight",
                   "lm_head": "lm_head.w",
                   "model.language_model.embed_tokens": "model.embed_tokens.weight",
                   "model.language_model.norm": "model.norm.weight"},
}
LAYER_PREFIXES = {ORIGINAL: ("language_model.model.layers.",),
                  TRANSFORMERS: ("model.layers.", "model.language_model.layers.")}

# tensors that are not the text model: skipped (vision tower, projectors, MTP draft modules)
SKIP = re.compile(r"(^|\.)(vision_tower|multi_modal_projector|patch_merge_mlp|mtp)\.")

# tensors named without a role suffix: a module's buffer, not a weight (the Hub and transformers both spell
# `...e_score_correction_bias`)
BARE_TENSORS = {"mlp.gate.e_score_correction_bias"}

# tensor roles (the name's last component) -> normalized role; compressed-tensors and MXFP8 spellings
ROLES = {
    "weight": "weight", "weight_scale": "weight_scale", "weight_scale_2": "weight_scale_2",
    "input_scale": "input_scale", "weight_packed": "weight", "weight_global_scale": "weight_global_scale",
    "input_global_scale": "input_scale", "weight_scale_inv": "weight_scale",
    "k_scale": "k_scale", "v_scale": "v_scale",
}


def detect_layout(names) -> str:
    return ORIGINAL if any(n.startswith("language_model.") for n in names) else TRANSFORMERS


def _compile(layout: str):
    out = []
    for suffix, target in LAYER_MAPS[layout].items():
        pat = re.escape(suffix).replace(r"\{e\}", r"(?P<e>\d+)")
        out.append((re.compile(rf"^{pat}(?:\.(?P<role>\w+))?$"), target))
    return out


_COMPILED = {layout: _compile(layout) for layout in LAYER_MAPS}


def parse(name: str, layout: str):
    """checkpoint name -> (layer | None, module path, part, expert | None, raw role), or None if unknown."""
    for prefix in LAYER_PREFIXES[layout]:
        if name.startswith(prefix):
            rest = name[len(prefix):]
            layer_s, _, suffix = rest.partition(".")
            if not layer_s.isdigit():
                return None
            for pat, (path, part) in _COMPILED[layout]:
                m = pat.match(suffix)
                if m and (m.group("role") is None or m.group("role") in ROLES):
                    e = m.groupdict().get("e")
                    return int(layer_s), path, part, None if e is None else int(e), m.group("role") or "weight"
            return None
    base, _, role = name.rpartition(".")
    path = GLOBAL_MAPS[layout].get(base)
    if path is not None:
        return None, path, None, None, role
    return None


def checkpoint_name(layout: str, layer: int | None, path: str, part, expert, role: str) -> str:
    """The inverse of `parse`, for error messages naming the tensor a checkpoint should have held."""
    if layer is None:
        for base, p in GLOBAL_MAPS[layout].items():
            if p == path:
                return f"{base}.{role}"
    for suffix, (p, pt) in LAYER_MAPS[layout].items():
        if p == path and pt == part and (("{e}" in suffix) == (expert is not None) or part == "stack"):
            s = suffix.replace("{e}", str(expert))
            bare = part == "stack" or path in BARE_TENSORS  # stored under the module name itself
            tail = "" if bare and role == "weight" else f".{role}"
            return f"{LAYER_PREFIXES[layout][0]}{layer}.{s}{tail}"
    return f"layer {layer} {path} ({part}, expert {expert}) {role}"
