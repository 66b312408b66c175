"""The MiniMax-M3.1-Flash geometry with fewer layers, random weights in the real formats, built on the device in
seconds (no checkpoint): NVFP4 routed experts, MXFP8 shared expert, bf16 attention / dense MLP / embeddings /
lm_head; and the byte accounting of a decode step (the byte roofline). Shared by the benchmarks.

  cfg = flash_geometry(num_layers=4, dense_layers=1)       # layer 0: full attention + dense MLP; then MSA + MoE
  model = random_model(cfg, "cuda")
  engine = make_engine(model, max_model_len=..., ...)      # an LLMEngine over it (token ids only, no tokenizer)
"""
from __future__ import annotations

import torch

from m3serve.config import FULL, KV_BYTES_PER_ELEMENT, SPARSE, EngineConfig, ModelConfig, preset
from m3serve.model.m3 import M3ForCausalLM, Rotary
from m3serve.model.weights import QuantWeight


# a toy of the same kinds (CPU smoke runs: the interpreter-free torch paths)
SMOKE = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=8,
             intermediate_size=128, shared_intermediate_size=128, dense_intermediate_size=256, vocab_size=4096,
             index_n_heads=2, index_head_dim=64, index_block_size=16, index_topk_blocks=2)
# the toy with M3's head ratios (16 query heads per KV head, one index head per KV head): at TP 4 a rank holds
# 4 query heads, 1 KV head and 1 index head, as a rank of M3.1-Flash at TP 4 holds 16, 1 and 1
SMOKE_TP4 = dict(SMOKE, num_attention_heads=16, num_key_value_heads=4, index_n_heads=4)


def geometry_checkpoint(out_dir: str, num_layers: int, dense_layers: int = 1, **over) -> ModelConfig:
    """A small checkpoint on disk with the geometry's layer kinds (`flash_geometry`, widths from `over`, e.g.
    SMOKE_TP4) and the tiny tokenizer: routed experts NVFP4, the rest bf16. Tensor-parallel workers load their
    shards from it (an in-process random model cannot be shared with other processes). Written via `make_tiny`'s
    writer and the quantizer into `out_dir` (a sibling `out_dir.bf16` holds the unquantized source)."""
    from m3serve.model.quantize import quantize_checkpoint
    from m3serve.model.tiny import make_tiny

    geo = flash_geometry(num_layers, dense_layers, **over)
    keep = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "dtype",
            "quantization_config")  # the tiny tokenizer's ids, a short context, the checkpoint's own dtype
    fields = {k: getattr(geo, k) for k in geo.__dataclass_fields__ if k not in keep}
    make_tiny(out_dir + ".bf16", dspark=False, **fields)
    quantize_checkpoint(out_dir + ".bf16", out_dir, "nvfp4", modules=("experts",), progress=False)
    return ModelConfig.from_pretrained(out_dir)


def flash_geometry(num_layers: int, dense_layers: int = 1, **over) -> ModelConfig:
    """M3.1-Flash's shapes with `num_layers` layers, the first `dense_layers` full-attention + dense MLP (as M3's
    first three are), the rest MSA + MoE."""
    base = preset("minimax-m3.1-flash")
    d = {k: getattr(base, k) for k in base.__dataclass_fields__}
    d.update(num_hidden_layers=num_layers, layer_types=[FULL] * dense_layers + [SPARSE] * (num_layers - dense_layers),
             mlp_layer_types=["dense"] * dense_layers + ["sparse"] * (num_layers - dense_layers))
    d.update(over)
    return ModelConfig(**d)


def _fill_quant(w: QuantWeight, g: torch.Generator) -> None:
    """Random codes and scales with weights of magnitude ~0.02 (realistic dynamic range, never NaN)."""
    if w.fmt == "nvfp4":
        w.packed.copy_(torch.randint(0, 256, w.packed.shape, dtype=torch.uint8, device=w.packed.device, generator=g))
        w.block_scale.copy_((torch.rand(w.block_scale.shape, device=w.block_scale.device, generator=g) + 0.5)
                            .to(torch.float8_e4m3fn))
        w.scale_2.fill_(0.004)
    elif w.fmt == "mxfp8":
        w.qweight.copy_((torch.randn(w.qweight.shape, device=w.qweight.device, generator=g) * 2)
                        .to(torch.float8_e4m3fn))
        w.scale_e8m0.fill_(127 - 7)
    else:
        w.weight.normal_(0, 0.02, generator=g)


@torch.no_grad()
def random_model(cfg: ModelConfig, device: str | torch.device = "cuda", seed: int = 0,
                 expert_fmt: str = "nvfp4", shared_fmt: str = "mxfp8", parallel=None) -> M3ForCausalLM:
    """`parallel`: build only that rank's shard (`benchmarks/bench_rank.py`: rank 0 of a TP4 deployment)."""
    formats = {i: {"experts": expert_fmt, "shared_experts": shared_fmt} for i in range(cfg.num_hidden_layers)
               if cfg.is_moe(i)}
    with torch.device("meta"):
        model = M3ForCausalLM(cfg, torch.bfloat16, formats, parallel)
    model.to_empty(device=device)
    model.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta).to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    for mod in model.modules():
        if isinstance(mod, QuantWeight):
            _fill_quant(mod, g)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.zero_()  # Gemma-style offsets: scale 1
        elif "e_score_correction_bias" in name:
            p.zero_()
        else:
            p.normal_(0, 0.02, generator=g)
    return model.eval()


def make_engine(model: M3ForCausalLM, **options):
    """An `LLMEngine` over `model` (no tokenizer: token-id prompts), NVFP4 KV and index keys by default."""
    from m3serve.engine.llm_engine import LLMEngine

    opts = dict(model="random-m3.1-flash-geometry", kv_cache_dtype="nvfp4",
                attention_config={"indexer_kv_dtype": "nvfp4"}, enable_prefix_caching=False, max_num_seqs=64)
    opts.update(options)
    return LLMEngine(EngineConfig(**opts), model=model)


def async_engine(config: EngineConfig):
    """Engine factory for the Triton model ($M3SERVE_TEST_ENGINE_FACTORY = "m3_ids=benchmarks/geometry.py:async_engine") and the
    engine-direct benchmark: an `AsyncLLMEngine` over `random_model(flash_geometry($M3SERVE_GEOMETRY_LAYERS))` on the
    GPU, with model.json's sizes (max_model_len, max_num_seqs, num_gpu_blocks_override, max_num_batched_tokens) and
    scheduling (max_waiting_steps, waiting_served_ratio, max_prefill_tokens_with_decodes).
    With a `speculative_config` there, a random DSpark draft (`write_draft`) in a temporary folder, and with
    $M3SERVE_GEOMETRY_CONTROL = '{"p": P, "prompt_len": N, "max_tokens": M}' controlled acceptance
    (`control_acceptance`)."""
    import json
    import os
    import tempfile

    from m3serve.engine.async_engine import AsyncLLMEngine

    smoke = not torch.cuda.is_available()  # the CPU: the toy geometry (a smoke test of the serving path)
    device = "cpu" if smoke else "cuda"
    cfg = flash_geometry(int(os.environ.get("M3SERVE_GEOMETRY_LAYERS", "4")), **(SMOKE if smoke else {}))
    model = random_model(cfg, device)
    if not smoke:
        log_compiles()
        python_speed()
    speculative_config = config.speculative_config or None
    if speculative_config:
        draft = tempfile.mkdtemp(prefix="geometry_draft_")
        write_draft(model, draft, 1, speculative_config["num_speculative_tokens"], 16 if smoke else 256)
        speculative_config = dict(speculative_config, model=draft)
    engine = make_engine(model, device=device, dtype="bfloat16", max_model_len=config.max_model_len,
                         max_num_seqs=config.max_num_seqs, num_gpu_blocks_override=config.num_gpu_blocks_override,
                         max_num_batched_tokens=config.max_num_batched_tokens, enforce_eager=config.enforce_eager,
                         speculative_config=speculative_config, max_waiting_steps=config.max_waiting_steps,
                         waiting_served_ratio=config.waiting_served_ratio,
                         max_prefill_tokens_with_decodes=config.max_prefill_tokens_with_decodes)
    control = os.environ.get("M3SERVE_GEOMETRY_CONTROL")
    if speculative_config and control:
        c = json.loads(control)
        control_acceptance(engine, c["p"], bench_prompt_ids(c["prompt_len"]), c["max_tokens"])
    return AsyncLLMEngine(engine.config, engine=engine)


def bench_prompt_ids(n: int, variant: int = 0) -> list[int]:
    """The benchmarks' prompt of n token ids; variants 0..496 are 497 different prompts (every token shifted), for
    benchmarks whose requests must differ (bench_server's --prompts distinct)."""
    return [3 + (7919 * i + 331 * variant) % 497 for i in range(n)]


def write_draft(model: M3ForCausalLM, out_dir: str, num_layers: int, k: int, markov_rank: int,
                draft_vocab_ids: list[int] | None = None) -> None:
    """A random DSpark draft for `model` in `out_dir` (taps: layer 0, the middle, the one before the last; the same
    weights every call), with `draft_vocab_ids` (most frequent first) if given: the subset
    `speculative_config.draft_vocab_size` takes its first N of."""
    from m3serve.model.dspark_tiny import random_dspark_state, tiny_dspark_config, write_dspark

    n = model.config.num_hidden_layers
    taps = sorted({0, (n - 1) // 2, max(n - 2, 0)})
    cfg = tiny_dspark_config(model.config, num_hidden_layers=num_layers, block_size=max(k, 7), target_layer_ids=taps,
                             mask_token_id=model.config.vocab_size - 1, markov_rank=markov_rank)
    state = {name: t.to(model.dtype) for name, t in random_dspark_state(cfg).items()}
    write_dspark(out_dir, cfg, state, draft_vocab_ids)


def control_acceptance(engine, p: float, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Controlled acceptance for requests that all send `prompt_ids`, greedy (bench_server): the target's greedy
    continuation recorded through the speculative engine itself (random drafts: all rejected, so the tokens are the
    verify path's), then `ControlledProposals` (executor/speculative/controlled.py) in front of the draft with that continuation
    for every request (looked up under one key: requests carry the engine's random seeds, so their coins are shared
    too: every request accepts at the same positions). Returns the continuation."""
    from m3serve.engine.sampling_params import SamplingParams
    from m3serve.executor.speculative.controlled import ControlledProposals

    engine.add_request("control-recording", prompt_token_ids=prompt_ids, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens += o.new_token_ids
    drafter = engine.executor.worker.drafter
    control = ControlledProposals({0: prompt_ids + tokens}, p, engine.model_config.vocab_size, drafter.runner.device)
    drafter.proposal_hook = lambda prop, ids, pos, seeds: control(prop, ids, pos, torch.zeros_like(seeds))
    return tokens


def python_speed() -> float:
    """Time a fixed pure-Python workload (dicts, lists, small calls: the engine's host work in kind), best of 5, and
    print `[python] <ms> ms <executable> shared=<libpython shared>` to stderr, from where the engine is built:
    engine-direct's process, the server's engine process, or (engine_process "false") the interpreter embedded in
    Triton's backend stub (2026-12-03 on the H200: 28 ms there against 18 ms in python3)."""
    import sys
    import sysconfig
    import time

    class _Row:
        __slots__ = ("a", "b")

        def __init__(self, a, b):
            self.a, self.b = a, b

    def work():
        d: dict = {}
        rows = [_Row(i, i % 7) for i in range(50000)]
        for r in rows:
            d[r.b] = d.get(r.b, 0) + r.a
        return sum(len(str(r.a)) for r in rows) + len(d)

    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - t0)
    print(f"[python] {1e3 * best:.2f} ms {sys.executable} shared={sysconfig.get_config_var('Py_ENABLE_SHARED')}",
          file=sys.stderr, flush=True)
    return best


COMPILES: list[tuple[float, float, str]] = []  # (unix time, seconds, kernel) of each compile `log_compiles` saw


def log_compiles() -> None:
    """Print every Triton kernel compile of this process (a fresh one, or a load from Triton's disk cache) to stderr:
    `[compile] <unix time> <seconds> <kernel> <fresh|cached>`. A compile inside a timed run is a stall the benchmark
    must not count as serving speed (the server's lines land in its log). Triton's compilation listener, not the JIT
    hooks: those serialize each specialization to JSON first, which fails for the Gluon kernels' layouts
    (2026-12-03 on the H200: `DistributedLinearLayout is not JSON serializable` in the mma MoE kernel's compile)."""
    import sys
    import time

    import triton

    if triton.knobs.compilation.listener is not None:
        return  # installed already (engine-direct builds the engine once per run)

    def listener(*, src, times, cache_hit, **_):
        seconds = (times.ir_initialization + times.total_lowering + times.store_results) / 1e6
        name = getattr(src, "name", type(src).__name__)
        COMPILES.append((time.time(), seconds, name))
        print(f"[compile] {time.time():.3f} {seconds:.3f} {name} {'cached' if cache_hit else 'fresh'}",
              file=sys.stderr, flush=True)

    triton.knobs.compilation.listener = listener


# ---- byte accounting --------------------------------------------------------------------------------------
def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def weight_bytes(model: M3ForCausalLM) -> dict:
    """Bytes of each part a decode step reads: per layer (attention, dense MLP or router + shared expert, one routed
    expert), and the final norm + lm_head."""
    layers = []
    for layer in model.model.layers:
        attn = _storage_bytes(list(layer.self_attn.parameters()) + list(layer.self_attn.buffers())
                              + list(layer.input_layernorm.parameters()) + list(layer.post_attention_layernorm.parameters()))
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            e, packed = mlp.experts, getattr(mlp.method, "weights", None)
            router = _storage_bytes(list(mlp.gate.parameters()))
            if packed is not None:  # a kernel method holds the experts in its own layout (the module's are released)
                expert, rest = packed.expert_bytes(), router + packed.shared_bytes()
            else:
                expert = _storage_bytes(list(e.buffers())) // e.num_experts
                rest = router + _storage_bytes(list(mlp.shared_experts.buffers()))
            layers.append({"attention": attn, "mlp": rest, "expert": expert, "moe": True})
        else:
            layers.append({"attention": attn, "mlp": _storage_bytes(list(mlp.buffers())), "expert": 0, "moe": False})
    head = _storage_bytes(list(model.lm_head.buffers()) + list(model.model.norm.parameters()))
    return {"layers": layers, "head": head}


def kv_read_bytes(cfg: ModelConfig, kv_dtype: str, index_dtype: str, context: int) -> int:
    """Cache bytes one sequence's decode reads over all layers: the whole context on full-attention layers; the
    index keys of the whole context plus the top-k selected blocks of K and V on MSA layers."""
    e, ei = KV_BYTES_PER_ELEMENT[kv_dtype], KV_BYTES_PER_ELEMENT[index_dtype]
    kv_token = 2 * cfg.num_key_value_heads * cfg.head_dim * e
    selected = min(context, cfg.index_topk_blocks * cfg.index_block_size)
    total = 0.0
    for layer in range(cfg.num_hidden_layers):
        if cfg.is_sparse_attention(layer):
            total += context * cfg.index_head_dim * ei + selected * kv_token
        else:
            total += context * kv_token
    return int(total)


def step_bytes(wb: dict, cfg: ModelConfig, batch: int, context: int, experts_touched: list[float],
               kv_dtype: str = "nvfp4", index_dtype: str = "nvfp4") -> int:
    """The byte floor of one decode step of `batch` sequences at `context` tokens: every weight it must read once
    (the routed experts actually touched, per MoE layer) plus the cache it must read."""
    total, moe = wb["head"] + batch * cfg.hidden_size * 2, iter(experts_touched)
    for part in wb["layers"]:
        total += part["attention"] + part["mlp"] + (next(moe) * part["expert"] if part["moe"] else 0)
    return int(total + batch * kv_read_bytes(cfg, kv_dtype, index_dtype, context))


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct routed experts `tokens` tokens touch in one MoE layer when each token's top_k are a uniform random
    choice, independent of the other tokens': E (1 - (1 - k / E)^T). (A random model routes about so; a trained one's
    neighbouring tokens may share more experts.)"""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def draft_bytes(draft, k: int, context: int, batch: int, draft_head_rows: int | None = None,
                kv_bytes_per_element: int = 1) -> int:
    """Bytes the draft side of one speculative step must read: the draft's own weights once (layers, fc, norms,
    confidence head), the Markov head's W2 once per draft position (k: all its rows, as the draft holds only a draft
    vocabulary's), the target's lm_head rows it drafts from once (every row, or `draft_head_rows` with a draft
    vocabulary), and each sequence's draft KV over the context (every draft layer; FP8: one byte an element)."""
    cfg = draft.config
    markov = draft.markov_head
    w2 = _storage_bytes([markov.markov_w2.weight]) if markov is not None else 0
    own = _storage_bytes(list(draft.parameters()) + list(draft.buffers())) - w2
    lm = draft.shared.lm_head
    head = _storage_bytes(list(lm.parameters()) + list(lm.buffers()))
    if draft_head_rows is not None:
        head = head * draft_head_rows // cfg.vocab_size
    kv = batch * cfg.num_hidden_layers * context * 2 * cfg.num_key_value_heads * cfg.head_dim * kv_bytes_per_element
    return own + k * w2 + head + kv


def speculative_floor(wb: dict, cfg: ModelConfig, draft, batch: int, context: int, k: int,
                      draft_head_rows: int | None = None, kv_dtype: str = "nvfp4", index_dtype: str = "nvfp4",
                      draft_kv_bytes_per_element: int = 1) -> dict:
    """The byte floor of one speculative step (the target's forward over k + 1 tokens per sequence, which touches the
    routed experts of (k + 1) x batch tokens and reads the cache once, plus the draft side, `draft_bytes`) against a
    plain decode step's (the experts of `batch` tokens), routing uniform (`expected_experts`). `ratio` is the fewest
    plain steps a speculative step can cost where both are bound by their bytes."""
    moe = sum(1 for part in wb["layers"] if part["moe"])
    touched = lambda tokens: [expected_experts(cfg.num_local_experts, cfg.num_experts_per_tok, tokens)] * moe  # noqa: E731
    plain = step_bytes(wb, cfg, batch, context, touched(batch), kv_dtype, index_dtype)
    verify = step_bytes(wb, cfg, batch * (k + 1), context, touched(batch * (k + 1)), kv_dtype, index_dtype)
    verify -= batch * k * kv_read_bytes(cfg, kv_dtype, index_dtype, context)  # k + 1 queries read one cache
    draft_side = draft_bytes(draft, k, context, batch, draft_head_rows, draft_kv_bytes_per_element)
    return {"plain": plain, "verify": verify, "draft": draft_side, "speculative": verify + draft_side,
            "ratio": (verify + draft_side) / plain}
