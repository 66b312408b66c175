"""Write checkpoints: sharded safetensors + `model.safetensors.index.json` + config, in either layout.

Used by `make-tiny` and by the quantizer (which streams: tensors are written shard by shard)."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors.torch import save_file

from m3serve.config import ModelConfig
from m3serve.model import layout as L


class ShardWriter:
    def __init__(self, out_dir: str, max_shard_bytes: int = 4 << 30):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.max_bytes = out_dir, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[dict[str, torch.Tensor] | list[str]] = []
        self.weight_map: dict[str, str] = {}
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.weight_map or name in self.pending:
            raise ValueError(f"duplicate tensor {name}")
        n = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + n > self.max_bytes:
            self._flush()
        self.pending[name] = t.contiguous()
        self.pending_bytes += n
        self.total += n

    def _flush(self) -> None:
        idx = len(self.shards)
        tmp = f"model-{idx + 1:05d}.safetensors.tmp"
        save_file(self.pending, os.path.join(self.out_dir, tmp), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.shards:
            self._flush()
        n = len(self.shards)
        for i, names in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, f"model-{i + 1:05d}.safetensors.tmp"),
                       os.path.join(self.out_dir, final))
            self.weight_map.update({k: final for k in names})
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": self.weight_map}, f, indent=1)


def canonical_part(layout: str, path: str) -> str | None:
    """How `layout` stores the module at `path`: split into gate/up, stacked, or whole."""
    for p, part in L.LAYER_MAPS[layout].values():
        if p == path:
            return part
    return None


def pieces_for(layout: str, path: str, part: str | None, expert: int | None,
               t: torch.Tensor) -> Iterator[tuple[str | None, int | None, torch.Tensor]]:
    """Cut a tensor (as parsed from any layout) into the pieces `layout` stores: (part, expert, tensor)."""
    want = canonical_part(layout, path)
    if part == "stack" and want != "stack":
        for e in range(t.shape[0]):
            yield from pieces_for(layout, path, None, e, t[e])
        return
    if part is None and want in ("gate", "up"):
        half = t.shape[0] // 2
        yield "gate", expert, t[:half]
        yield "up", expert, t[half:]
        return
    yield part, expert, t


def hf_config_dict(cfg: ModelConfig, layout: str) -> dict:
    """config.json: transformers' text config, or for the original layout the VL wrapper with the
    legacy spellings (`sparse_attention_config`, `moe_layer_freq`) the Hub config uses."""
    text = cfg.to_hf_dict()
    if layout == L.TRANSFORMERS:
        return text
    legacy = {"sparse_attention_freq": [int(t == "minimax_m3_sparse") for t in cfg.layer_types],
              "sparse_num_index_heads": cfg.index_n_heads, "sparse_index_dim": cfg.index_head_dim,
              "sparse_block_size": cfg.index_block_size, "sparse_topk_blocks": cfg.index_topk_blocks,
              "sparse_local_block": cfg.index_local_blocks, "sparse_score_type": "max",
              "sparse_disable_index_value": True}
    for k in ("layer_types", "index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks",
              "index_local_blocks", "architectures"):
        text.pop(k, None)
    text["sparse_attention_config"] = legacy
    text["moe_layer_freq"] = [int(t == "sparse") for t in text.pop("mlp_layer_types")]
    text["model_type"] = "minimax_m3_vl_text"
    quant = text.pop("quantization_config", None)
    out = {"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
           "text_config": text, "image_token_index": 200025, "video_token_index": 200026}
    if quant:
        out["quantization_config"] = quant
    return out


def write_config(out_dir: str, cfg: ModelConfig, layout: str) -> None:
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg, layout), f, indent=2)


def write_checkpoint(out_dir: str, cfg: ModelConfig, state: dict[str, torch.Tensor], layout: str = L.ORIGINAL,
                     dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 4 << 30) -> None:
    """`state` uses transformers names (what `random_state` and `MiniMaxM3VLForCausalLM` hold)."""
    w = ShardWriter(out_dir, max_shard_bytes)
    for name, t in state.items():
        p = L.parse(name, L.TRANSFORMERS)
        if p is None:
            raise ValueError(f"cannot place tensor {name}")
        layer, path, part, expert, role = p
        keep_fp32 = path.startswith("mlp.gate.")  # the router stays fp32, as in the real checkpoints
        for pt, e, piece in pieces_for(layout, path, part, expert, t):
            out = piece if keep_fp32 else piece.to(dtype)
            w.add(L.checkpoint_name(layout, layer, path, pt, e, role), out.float() if keep_fp32 else out)
    w.close()
    write_config(out_dir, cfg, layout)
