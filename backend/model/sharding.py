"""Which part of each weight a tensor-parallel rank holds, and which slice of a checkpoint tensor makes it.

A `Shard` is attached to every weight at construction (by the parallel layer that owns it) and read by the loader,
which then reads only that slice of the safetensors tensor (`safe_open(...).get_slice(name)[...]`): no rank reads
or holds more than its part. Rules per layer (M3 at TP4: 64 q / 4 KV heads -> 16 q + 1 KV head per rank):

| weight | split | shard |
|---|---|---|
| q/k/v_proj, indexer q_proj | column-parallel by heads (index head h follows KV head h) | rows |
| indexer k_proj (the shared index key), norms, router | replicated | - |
| o_proj, MLP / shared-expert down_proj | row-parallel (all-reduce after) | cols |
| MLP / shared-expert gate_up_proj | column-parallel, gate and up halves split alike | rows, parts=2 |
| routed experts, tensor-parallel | each expert's FFN split like an MLP | gate_up rows, down cols |
| routed experts, expert-parallel | E/N whole experts per rank | experts |
| embed_tokens, lm_head | vocab-parallel (rows); logits gathered to rank 0 | rows |

With fewer KV heads than ranks (M3's 4 at TP8) each KV head, with its index head, is held by size/H_kv ranks.

Quantized weights shard with their scales: splitting rows takes the same rows of the block scales; splitting K
(row-parallel) takes K/N columns of the weight, i.e. K/N/2 bytes of NVFP4 and K/N/16 (NVFP4) or K/N/32 (MXFP8)
block scales, so K/N must be a multiple of the format's block. The per-tensor NVFP4 second-level scale is
replicated.
"""
from __future__ import annotations

from dataclasses import dataclass

from m3serve.config import ConfigError, ModelConfig

# logical K elements per checkpoint column, by (format, tensor role)
_COL_FACTOR = {("nvfp4", "weight"): 2, ("nvfp4", "weight_scale"): 16, ("mxfp8", "weight_scale"): 32}
QUANT_BLOCK = {"nvfp4": 16, "mxfp8": 32}
_SCALAR_ROLES = ("weight_scale_2", "weight_global_scale", "input_scale", "k_scale", "v_scale")


@dataclass(frozen=True)
class Shard:
    """The part of a weight of logical shape [*lead, N, K] one rank holds (all of it by default)."""

    rows: tuple[int, int] | None = None  # [start, stop) within each of the `parts` equal row blocks of N
    parts: int = 1  # N is `parts` equal blocks (gate | up), each split alike
    cols: tuple[int, int] | None = None  # [start, stop) of K, in logical elements
    experts: tuple[int, int] | None = None  # [first, stop) of the expert (lead) axis

    @property
    def is_full(self) -> bool:
        return self.rows is None and self.cols is None and self.experts is None

    def local_expert(self, expert: int) -> int | None:
        """The local index of a global expert id, None when another rank holds it."""
        if self.experts is None:
            return expert
        first, stop = self.experts
        return expert - first if first <= expert < stop else None

    def source(self, shape: list[int], fmt: str, role: str, one_part: bool, stacked: bool, name: str = ""
               ) -> list[tuple[slice, ...]]:
        """Index tuples into a checkpoint tensor of `shape` that together make this rank's part (several when the
        tensor holds several row blocks: concatenate them along the rows). `one_part`: the tensor is one of the
        `parts` row blocks (a separate gate or up tensor); `stacked`: its first axis is the expert axis."""
        if self.is_full or role in _SCALAR_ROLES or len(shape) < 2:
            return [()]
        idx = [slice(None)] * len(shape)
        if stacked and self.experts is not None:
            idx[0] = slice(*self.experts)
        if self.cols is not None:
            f = _COL_FACTOR.get((fmt, role), 1)
            c0, c1 = self.cols
            if c0 % f or c1 % f:
                raise ConfigError(f"{name}: its row-parallel shard K[{c0}:{c1}] does not fall on whole {fmt} "
                                  f"blocks of {f}")
            idx[-1] = slice(c0 // f, c1 // f)
        if self.rows is None:
            return [tuple(idx)]
        r0, r1 = self.rows
        blocks = 1 if one_part else self.parts
        block = shape[-2] // blocks
        out = []
        for j in range(blocks):
            idx[-2] = slice(j * block + r0, j * block + r1)
            out.append(tuple(idx))
        return out


def check_divisible(cfg: ModelConfig, size: int, expert_parallel: bool) -> None:
    """Raise ConfigError naming every dimension of the model that `size` ranks cannot split evenly."""
    if size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    dims = [("num_attention_heads", cfg.num_attention_heads), ("vocab_size", cfg.vocab_size)]
    if cfg.num_key_value_heads % size and size % cfg.num_key_value_heads:  # fewer KV heads: replicated
        dims.append(("num_key_value_heads (or a divisor of tensor_parallel_size)", cfg.num_key_value_heads))
    if cfg.num_moe_layers:
        dims.append(("shared_intermediate_size", cfg.shared_intermediate_size))
        dims.append(("num_local_experts (expert parallel)", cfg.num_local_experts) if expert_parallel
                    else ("intermediate_size (each routed expert's FFN)", cfg.intermediate_size))
    if cfg.num_moe_layers < cfg.num_hidden_layers:
        dims.append(("dense_intermediate_size", cfg.dense_intermediate_size))
    bad = [f"{name}={value}" for name, value in dims if value % size]
    if bad:
        raise ConfigError(f"tensor_parallel_size={size} does not divide the model: {', '.join(bad)} "
                          "(each rank takes an equal part of these)")
