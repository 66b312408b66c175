"""The `m3serve` command: generate | quantize | capacity | make-tiny | train-learned | eval-tasks | openai."""
from __future__ import annotations

import argparse
import json
import sys

from m3serve.config import KV_CACHE_DTYPES, PRESETS, ConfigError


def _ids(s: str) -> list[int]:
    try:
        return [int(t) for t in s.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants comma-separated integers, got {s!r}") from None


def _engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine options (vLLM names)")
    g.add_argument("--device", default="auto")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    g.add_argument("--attention-config", type=json.loads, default={},
                   help='JSON, e.g. \'{"indexer_kv_dtype": "nvfp4"}\'')
    g.add_argument("--block-size", type=int)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks: rank 0 in this process, a worker process per other rank (GPU r, or CPU with gloo)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="routed experts: E/N whole experts per rank instead of each expert split over the ranks")
    g.add_argument("--num-gpu-blocks-override", type=int)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="queue the next decode step on the device before this step's tokens are back")
    g.add_argument("--speculative-config", type=json.loads, default=None,
                   help='JSON, e.g. \'{"method": "dspark", "num_speculative_tokens": 7, '
                        '"draft_sample_method": "probabilistic", "kv_cache_dtype": "fp8"}\' (draft: MODEL/dspark)')


def _engine_kwargs(a: argparse.Namespace) -> dict:
    keys = ["device", "dtype", "kv_cache_dtype", "attention_config", "block_size", "max_num_seqs",
            "max_num_batched_tokens", "max_model_len", "gpu_memory_utilization", "enable_prefix_caching",
            "tensor_parallel_size", "enable_expert_parallel", "num_gpu_blocks_override", "seed", "enforce_eager",
            "async_scheduling", "speculative_config"]
    return {k: getattr(a, k) for k in keys}


def cmd_generate(a) -> int:
    from m3serve import LLM, SamplingParams

    if not a.prompt_ids and not a.prompt:
        raise SystemExit("generate: give --prompt-ids or --prompt")
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                        seed=a.sampling_seed, ignore_eos=a.ignore_eos)
    prompts = list(a.prompt_ids or []) + list(a.prompt or [])
    with LLM(model=a.model, **_engine_kwargs(a)) as llm:
        for i, out in enumerate(llm.generate(prompts, sp)):
            rec = {"prompt_index": i, "token_ids": out.token_ids}
            if out.text:
                rec["text"] = out.text
            rec["finish_reason"] = out.finish_reason
            print(json.dumps(rec, ensure_ascii=False), flush=True)
    return 0


def cmd_quantize(a) -> int:
    from m3serve.model.quantize import DEFAULT_MODULES, quantize_checkpoint

    counts = quantize_checkpoint(a.model, a.out, a.scheme, tuple(a.modules or DEFAULT_MODULES))
    print(json.dumps({"out": a.out, "scheme": a.scheme, **counts}))
    return 0


def cmd_capacity(a) -> int:
    from m3serve.capacity import plan
    from m3serve.config import ModelConfig, preset

    cfg = preset(a.preset) if a.preset else ModelConfig.from_pretrained(a.model)
    ctx = {} if a.cuda_context_gb is None else {"cuda_context_gb": a.cuda_context_gb}
    out = plan(cfg, a.kv_cache_dtype, a.indexer_kv_dtype, a.gpus, a.gpu_memory_gb, a.seq_len, a.weights_gb,
               a.gpu_memory_utilization, **ctx)
    print(json.dumps(out, indent=2))
    return 0


def cmd_make_tiny(a) -> int:
    from m3serve.model.tiny import make_tiny

    cfg = make_tiny(a.out, seed=a.seed, layout=a.layout, dspark=a.dspark)
    print(json.dumps({"out": a.out, "layers": cfg.num_hidden_layers, "vocab_size": cfg.vocab_size,
                      "layer_types": cfg.layer_types, "mlp_layer_types": cfg.mlp_layer_types}))
    return 0


def cmd_train_learned(a) -> int:
    from m3serve.learn.train import TrainConfig, run

    fields = {f for f in TrainConfig.__dataclass_fields__}
    tc = TrainConfig(**{k: v for k, v in vars(a).items() if k in fields and v is not None})
    result = run(tc)
    draft = result["draft"].get("eval", {}).get("all", result["draft"])
    print(json.dumps({"out": tc.out, "eval_target": result["eval_target"], "draft": draft, "wall_s": result["wall_s"]}))
    return 0


def _train_options(p: argparse.ArgumentParser) -> None:
    from m3serve.learn.train import TrainConfig

    p.add_argument("--out", required=True, help="the checkpoint directory to write")
    p.add_argument("--pack", help="also write the checkpoint as part-aa.. (15 MB each) + train_log.json here")
    p.add_argument("--tasks", nargs="+", type=str)
    p.add_argument("--model-overrides", type=json.loads, help='learned_config fields, e.g. \'{"hidden_size": 128}\'')
    p.add_argument("--task-weights", type=json.loads,
                   help="train examples per task relative to --train-examples "
                   '(default \'{"arithmetic": 12, "retrieval": 0.5}\')')
    p.add_argument("--packed-turns", type=json.loads,
                   help='problems per training row by task (default \'{"arithmetic": 8, "retrieval": 32}\')')
    p.add_argument("--init-from", help="start from this checkpoint's weights (to go on with an earlier run; set "
                   "--dense-frac 0 --sparse-ramp-frac 0 to train with the sparse mask from the first step)")
    skip = {"out", "pack", "tasks", "model_overrides", "task_weights", "packed_turns", "init_from"}
    for name, f in TrainConfig.__dataclass_fields__.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f"default {f.default}")
        else:
            p.add_argument(flag, type=type(f.default), default=None, help=f"default {f.default}")


def cmd_openai(a) -> int:
    import os

    from m3serve.gateway.app import GatewayConfig, run

    cfg = GatewayConfig(triton_url=a.triton_url, model=a.model, served_model_name=a.served_model_name,
                        api_key=a.api_key or os.environ.get("M3SERVE_OPENAI_API_KEY") or None,
                        max_concurrent=a.max_concurrent, cors_origins=a.cors_origin or [])
    run(cfg, a.host, a.port, a.log_level, workers=a.workers)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="m3serve", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate from token-id (or text) prompts; one JSON line per prompt")
    g.add_argument("--model", required=True)
    g.add_argument("--prompt-ids", type=_ids, action="append")
    g.add_argument("--prompt", action="append", help="a text prompt (needs tokenizer.json)")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int)
    g.add_argument("--ignore-eos", action="store_true")
    _engine_options(g)
    g.set_defaults(fn=cmd_generate)

    q = sub.add_parser("quantize", help="write an NVFP4 / MXFP8 ModelOpt-style checkpoint")
    q.add_argument("--model", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--scheme", choices=["nvfp4", "mxfp8"], default="nvfp4")
    q.add_argument("--modules", nargs="+", help="experts shared_experts dense_mlp attention indexer; GROUP:SCHEME "
                                                "quantizes one group with another scheme (shared_experts:mxfp8)")
    q.set_defaults(fn=cmd_quantize)

    c = sub.add_parser("capacity", help="KV bytes per token, weight bytes, max concurrent sequences")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(PRESETS))
    src.add_argument("--model")
    c.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    c.add_argument("--indexer-kv-dtype", default=None, choices=KV_CACHE_DTYPES)
    c.add_argument("--gpus", type=int, default=1, help="tensor-parallel ranks (one GPU each); limits are per rank")
    c.add_argument("--gpu-memory-gb", type=float, default=141.0)
    c.add_argument("--seq-len", type=int, default=262144)
    c.add_argument("--weights-gb", type=float)
    c.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    c.add_argument("--cuda-context-gb", type=float, default=None,
                   help="memory the driver holds per process outside PyTorch (default: the planner's measured figure)")
    c.set_defaults(fn=cmd_capacity)

    t = sub.add_parser("make-tiny", help="generate the tiny random M3 model (+ tokenizer) for demos and tests")
    t.add_argument("--out", required=True)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--layout", choices=["original", "transformers"], default="original")
    t.add_argument("--dspark", action=argparse.BooleanOptionalAction, default=True,
                   help="also write its tiny DSpark draft to OUT/dspark (default; --no-dspark: the target only)")
    t.set_defaults(fn=cmd_make_tiny)

    tl = sub.add_parser("train-learned", help="train the learned tiny M3 and its DSpark draft (m3serve.learn.train)")
    _train_options(tl)
    tl.set_defaults(fn=cmd_train_learned)

    from m3serve.learn.evaluate import add_parser as add_eval_tasks
    add_eval_tasks(sub)  # eval-tasks

    o = sub.add_parser("openai", help="an OpenAI-compatible API (chat, completions) in front of tritonserver")
    o.add_argument("--triton-url", default="localhost:8001", help="tritonserver's gRPC address")
    o.add_argument("--model", default="m3", help="the Triton model (the m3 text contract)")
    o.add_argument("--served-model-name", help="the name clients send (default: --model)")
    o.add_argument("--host", default="127.0.0.1")
    o.add_argument("--port", type=int, default=9000)
    o.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $M3SERVE_OPENAI_API_KEY)")
    o.add_argument("--max-concurrent", type=int, default=0, help="429 beyond this many open requests (0: no limit)")
    o.add_argument("--cors-origin", action="append", help="allow this origin (CORS is off without one)")
    o.add_argument("--workers", type=int, default=1,
                   help="serve from this many processes on the one port (each relays its own requests; "
                        "--max-concurrent applies per worker)")
    o.add_argument("--log-level", default="info")
    o.set_defaults(fn=cmd_openai)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"m3serve {a.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
