"""`m3serve eval-tasks`: exact-match accuracy of a model on the tasks' held-out eval sets, per task and per path.

Paths (each gets the same prompts, the chat template's generation prompt, and the same token budget per task):

  reference        transformers 5.25 `MiniMaxM3VLForCausalLM`, greedy `generate` (skipped when transformers is missing)
  engine           the m3serve engine (`LLM`), greedy, --dtype
  nvfp4            routed experts NVFP4 + shared expert MXFP8 (`m3serve quantize --modules experts
                   shared_experts:mxfp8` into a temporary directory)
  nvfp4-kv         that, plus kv_cache_dtype nvfp4 and attention_config indexer_kv_dtype nvfp4
  nvfp4-a8         nvfp4 with the portable expert kernels' FP8 dots at every step (`Tuning(mma=False, a8=True)`:
                   e4m3 activations, the decoded weights rounded to e4m3; on GPUs of sm_89+, elsewhere without them)
  dspark-greedy    speculative_config dspark, K=7, the draft in MODEL/dspark, greedy
  dspark-sampled   the same at temperature 1, probabilistic drafts, a fixed seed per prompt
  triton-m3        a running tritonserver (--triton-url), model `m3` (text contract; messages + tools on the server)
  triton-ensemble  the same server's `ensemble` (preprocessing -> m3_ids -> postprocessing; the rendered prompt text)
  openai           an OpenAI-compatible gateway (`m3serve openai`, --openai-url) in front of that server, through the
                   `openai` client: /v1/chat/completions with the example's messages, tools and chat_template_kwargs;
                   its parsed message (content, reasoning_content, tool_calls) written back as text by the chat
                   template (`Example.reply_text`)

The engine paths put every prompt in one `generate` call (the DSpark paths one call per task, so that the
engine's spec_decode_* counters give acceptance per task). Replies are decoded with special tokens kept (the tool-call
markup is made of them) and checked by `Example.check`. The Triton paths need a repository serving the learned
model with special tokens kept in the text (`./build.sh demo` writes one: docs/quality.md).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from m3serve.learn.render import prompt_ids
from m3serve.learn.tasks import TASKS, Example, make_examples

PATHS = ("reference", "engine", "nvfp4", "nvfp4-kv", "nvfp4-a8", "dspark-greedy", "dspark-sampled", "triton-m3",
         "triton-ensemble", "openai")
DEFAULT_PATHS = ("reference", "engine")
SLACK_TOKENS = 16  # tokens allowed past the longest answer of a task
DSPARK = {"method": "dspark", "num_speculative_tokens": 7}
SAMPLED_SEED = 1234
MAX_MODEL_LEN = 2048
QUANT_MODULES = ("experts", "shared_experts:mxfp8")


def eval_sets(n: int, seed: int = 0, tasks=TASKS) -> dict[str, list[Example]]:
    return {t: make_examples(t, "eval", n, seed=seed) for t in tasks}


def token_budgets(sets: dict[str, list[Example]], tok, slack: int = SLACK_TOKENS) -> dict[str, int]:
    """max new tokens per task: the longest answer (+ eos) plus `slack` (a longer reply is wrong anyway)."""
    return {t: max(len(tok.encode(ex.answer)) for ex in exs) + 1 + slack for t, exs in sets.items()}


def reply_text(tok, ids: list[int]) -> str:
    """A reply's text with special tokens kept, the stop token(s) at its end dropped."""
    ids = list(ids)
    while ids and ids[-1] == tok.eos_token_id:
        ids.pop()
    return tok.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------- generators: {task: [reply text]}, {task: extra}

def generate_reference(model_dir: str, sets, tok, budgets, device: str, dtype: str, batch: int | None = None):
    """Greedy `generate` of the transformers reference. `batch` > 1 runs prompts of equal length together (no
    padding, so MSA's blocks stay where they are); default: 64 on CUDA, 1 on CPU (where the CI compares it with the
    engine token for token)."""
    import torch
    from transformers import MiniMaxM3VLForCausalLM

    batch = batch or (64 if device.startswith("cuda") else 1)
    torch_dtype = getattr(torch, dtype if dtype != "auto" else "bfloat16")
    model = MiniMaxM3VLForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    out = {}
    with torch.no_grad():
        for task, exs in sets.items():
            prompts = [prompt_ids(ex, tok) for ex in exs]
            by_len: dict[int, list[int]] = {}
            for i, p in enumerate(prompts):
                by_len.setdefault(len(p), []).append(i)
            texts: list[str | None] = [None] * len(exs)
            for idx in by_len.values():
                for k in range(0, len(idx), batch):
                    rows = idx[k:k + batch]
                    ids = torch.tensor([prompts[i] for i in rows], device=device)
                    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budgets[task],
                                         do_sample=False, eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.eos_token_id)
                    for i, row in zip(rows, gen[:, ids.shape[1]:].tolist()):
                        texts[i] = reply_text(tok, row[:row.index(tok.eos_token_id) + 1]
                                              if tok.eos_token_id in row else row)
            out[task] = texts
    return out, {}


def spec_counters(llm) -> tuple[int, int, int]:
    """The engine's cumulative (drafts, drafted tokens, accepted tokens); (0, 0, 0) without speculation."""
    s = llm.engine.stats()
    return s.get("spec_decode_num_drafts", 0), s.get("spec_decode_num_draft_tokens", 0), \
        s.get("spec_decode_num_accepted_tokens", 0)


def spec_acceptance(before: tuple[int, int, int], after: tuple[int, int, int]) -> dict:
    """Acceptance between two `spec_counters` readings: rate, mean accepted length (tokens per speculative step,
    the bonus token included), drafts, drafted tokens verified per draft."""
    drafts, drafted, accepted = (a - b for a, b in zip(after, before))
    return {"acceptance_rate": accepted / max(drafted, 1),
            "mean_accepted_length": 1.0 + accepted / drafts if drafts else 0.0, "num_drafts": drafts,
            "verified_per_draft": drafted / drafts if drafts else 0.0}


def engine_options(device: str, dtype: str, max_model_len: int = MAX_MODEL_LEN, speculative: bool = False) -> dict:
    """`LLM` options of the engine paths (with `speculative`, dspark-greedy's)."""
    eng = dict(device=device, dtype=dtype, max_model_len=max_model_len, seed=0)
    return dict(eng, speculative_config=dict(DSPARK)) if speculative else eng


def generate_engine(model_dir: str, sets, tok, budgets, sampled: bool = False, **engine_kwargs):
    """Greedy (or, with `sampled`, temperature 1 with seed SAMPLED_SEED + i) through `LLM`. With a speculative
    config, one generate call per task and that task's acceptance from the spec_decode counters."""
    from m3serve import LLM, SamplingParams

    def params(task: str, i: int) -> SamplingParams:
        if sampled:
            return SamplingParams(max_tokens=budgets[task], temperature=1.0, seed=SAMPLED_SEED + i)
        return SamplingParams(max_tokens=budgets[task], temperature=0.0)

    spec = bool(engine_kwargs.get("speculative_config"))
    groups = [[t] for t in sets] if spec else [list(sets)]
    texts, extra = {}, {}
    with LLM(model=model_dir, **engine_kwargs) as llm:
        for tasks in groups:
            before = spec_counters(llm)
            prompts = [prompt_ids(ex, tok) for t in tasks for ex in sets[t]]
            sps = [params(t, i) for t in tasks for i in range(len(sets[t]))]
            outs = iter(llm.generate(prompts, sps))
            for t in tasks:
                texts[t] = [reply_text(tok, next(outs).token_ids) for _ in sets[t]]
            if spec:
                extra[tasks[0]] = spec_acceptance(before, spec_counters(llm))
    return texts, extra


def triton_requests(url: str, model: str, requests: list[list], timeout: float = 600.0, window: int = 0
                    ) -> list[str]:
    """Send every request (a list of InferInput) on one gRPC stream, at most `window` in flight (0: all at once, the
    next one sent as one finishes); each reply's text_output joined."""
    import queue

    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    done: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: done.put((result, error)))
    texts: dict[str, list[str]] = {str(i): [] for i in range(len(requests))}
    sent = 0

    def send() -> None:
        nonlocal sent
        client.async_stream_infer(model, requests[sent], request_id=str(sent), enable_empty_final_response=True)
        sent += 1

    try:
        while sent < (min(window, len(requests)) if window > 0 else len(requests)):
            send()
        left = set(texts)
        deadline = time.monotonic() + timeout
        while left:
            result, error = done.get(timeout=max(1.0, deadline - time.monotonic()))
            if error is not None:
                raise RuntimeError(f"{model}: {error}")
            resp = result.get_response()
            out = result.as_numpy("text_output")
            if out is not None:
                texts[resp.id].extend(b.decode("utf-8") for b in out.reshape(-1))
            final = resp.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                left.discard(resp.id)
                if sent < len(requests):
                    send()
    finally:
        client.stop_stream()
        client.close()
    return ["".join(texts[str(i)]) for i in range(len(requests))]


def triton_inputs(model: str, ex, tok, budget: int) -> list:
    """One eval example as a request of `model`: the `m3` text contract's messages and tools (rendered on the server),
    or for the `ensemble` the rendered prompt's text; greedy, `budget` tokens, special tokens kept."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    def tensor(name, value, batch=False):
        arr = np.array([value.encode() if isinstance(value, str) else value],
                       dtype=object if isinstance(value, str) else None)
        if batch:
            arr = arr.reshape(1, 1)
        t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        return t

    if model == "ensemble":  # raw text: the rendered prompt (its special strings tokenize back to the ids)
        text = tok.decode(prompt_ids(ex, tok), skip_special_tokens=False)
        return [tensor("text_input", text, True), tensor("max_tokens", np.int32(budget), True),
                tensor("stream", False, True), tensor("temperature", np.float32(0.0), True),
                tensor("exclude_input_in_output", True, True)]
    sp = {"max_tokens": budget, "temperature": 0, "skip_special_tokens": False}
    inputs = [tensor("messages", json.dumps(ex.messages)), tensor("stream", False),
              tensor("exclude_input_in_output", True), tensor("sampling_parameters", json.dumps(sp)),
              tensor("chat_template_kwargs", json.dumps(ex.chat_template_kwargs))]
    if ex.tools:
        inputs.append(tensor("tools", json.dumps(ex.tools)))
    return inputs


def triton_replies(url: str, model: str, exs, tok, budget: int, window: int = 0) -> list[str]:
    """`exs`' replies from `model` (triton_inputs), at most `window` requests in flight (0: all)."""
    # the ensemble's text keeps the stop token when special tokens are kept: drop it, as reply_text does
    return [r.removesuffix(tok.eos_token) for r in
            triton_requests(url, model, [triton_inputs(model, ex, tok, budget) for ex in exs], window=window)]


def generate_triton(url: str, model: str, sets, tok, budgets):
    return {t: triton_replies(url, model, exs, tok, budgets[t]) for t, exs in sets.items()}, {}


def openai_reply(message: dict) -> dict:
    """An OpenAI chat completion's message as the chat template's assistant message (tool-call arguments, a JSON
    string in the API, back to an object; a missing content is empty)."""
    reply = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("reasoning_content"):
        reply["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        reply["tool_calls"] = [{"type": "function", "function": {
            "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in message["tool_calls"]]
    return reply


def generate_openai(url: str, sets, budgets, api_key: str | None = None, concurrency: int = 16):
    """Every example through /v1/chat/completions (greedy, `concurrency` requests in flight); the replies as text."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    client = openai.OpenAI(base_url=url, api_key=api_key or "unused", timeout=600.0, max_retries=0)
    model = client.models.list().data[0].id

    def ask(task: str, ex) -> str:
        extra = {"chat_template_kwargs": ex.chat_template_kwargs}
        r = client.chat.completions.create(model=model, messages=ex.messages, tools=ex.tools or openai.NOT_GIVEN,
                                           temperature=0, max_tokens=budgets[task], extra_body=extra)
        return ex.reply_text(openai_reply(r.choices[0].message.model_dump()))

    with ThreadPoolExecutor(concurrency) as pool:
        futures = {t: [pool.submit(ask, t, ex) for ex in exs] for t, exs in sets.items()}
        return {t: [f.result() for f in fs] for t, fs in futures.items()}, {}


# ---------------------------------------------------------------- the command

def _quantized(model_dir: str, tmp: str) -> str:
    from m3serve.model.quantize import quantize_checkpoint

    out = os.path.join(tmp, "nvfp4")
    if not os.path.isdir(out):
        quantize_checkpoint(model_dir, out, "nvfp4", QUANT_MODULES, progress=False)
    return out


def path_runner(path: str, model_dir: str, tmp: str, device: str, dtype: str, triton_url: str | None,
                max_model_len: int, openai_url: str | None = None) -> Callable:
    """A function (sets, tok, budgets) -> (texts, extra) for `path`."""
    eng = engine_options(device, dtype, max_model_len)
    if path == "reference":
        return lambda s, t, b: generate_reference(model_dir, s, t, b, device, dtype)
    if path == "engine":
        return lambda s, t, b: generate_engine(model_dir, s, t, b, **eng)
    if path == "nvfp4":
        return lambda s, t, b: generate_engine(_quantized(model_dir, tmp), s, t, b, **eng)
    if path == "nvfp4-a8":
        def fp8_dots(s, t, b):
            from m3serve.kernels.dispatch import tuned
            with tuned(mma=False, a8=True):
                return generate_engine(_quantized(model_dir, tmp), s, t, b, **eng)
        return fp8_dots
    if path == "nvfp4-kv":
        return lambda s, t, b: generate_engine(_quantized(model_dir, tmp), s, t, b, kv_cache_dtype="nvfp4",
                                               attention_config={"indexer_kv_dtype": "nvfp4"}, **eng)
    if path == "dspark-greedy":
        return lambda s, t, b: generate_engine(model_dir, s, t, b, **engine_options(device, dtype, max_model_len,
                                                                                    speculative=True))
    if path == "dspark-sampled":
        return lambda s, t, b: generate_engine(model_dir, s, t, b, sampled=True, **eng, speculative_config=dict(
            DSPARK, draft_sample_method="probabilistic"))
    if path in ("triton-m3", "triton-ensemble"):
        if not triton_url:
            raise ValueError(f"path {path} needs --triton-url")
        return lambda s, t, b: generate_triton(triton_url, path.removeprefix("triton-"), s, t, b)
    if path == "openai":
        if not openai_url:
            raise ValueError("path openai needs --openai-url")
        return lambda s, t, b: generate_openai(openai_url, s, b, os.environ.get("M3SERVE_OPENAI_API_KEY"))
    raise ValueError(f"unknown path {path!r}; one of {PATHS}")


def score(sets, texts) -> dict[str, dict]:
    out = {}
    for task, exs in sets.items():
        ok = [ex.check(txt) for ex, txt in zip(exs, texts[task], strict=True)]
        out[task] = {"correct": sum(ok), "n": len(ok), "accuracy": sum(ok) / len(ok)}
    return out


def evaluate(model_dir: str, n: int = 200, paths=DEFAULT_PATHS, device: str = "cpu", dtype: str = "auto",
             triton_url: str | None = None, seed: int = 0, tasks=TASKS, max_model_len: int = MAX_MODEL_LEN,
             slack: int = SLACK_TOKENS, log: Callable[[str], None] | None = None,
             on_path: Callable[[dict], None] | None = None, openai_url: str | None = None) -> dict:
    """Run `paths` on `n` eval examples per task; the report dict (also what --out writes). `on_path(report)` is
    called after each path (the report so far), so that a run cut short keeps the paths it finished."""
    from m3serve.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(model_dir)
    sets = eval_sets(n, seed, tasks)
    budgets = token_budgets(sets, tok, slack)
    report = {"model": model_dir, "n_per_task": n, "seed": seed, "device": device, "dtype": dtype,
              "tasks": list(sets), "paths": {}, "replies": {}}
    with tempfile.TemporaryDirectory(prefix="m3serve-eval-") as tmp:
        for path in paths:
            if path == "reference" and not _transformers_ok():
                report["paths"][path] = {"skipped": "transformers (with MiniMaxM3VLForCausalLM) is not importable"}
                continue
            run = path_runner(path, model_dir, tmp, device, dtype, triton_url, max_model_len, openai_url)
            t0 = time.perf_counter()
            texts, extra = run(sets, tok, budgets)
            scores = score(sets, texts)
            for task, e in extra.items():
                scores[task].update(e)
            report["paths"][path] = {"seconds": round(time.perf_counter() - t0, 2), "tasks": scores}
            report["replies"][path] = texts
            if log:
                log(f"{path}: " + ", ".join(f"{t} {s['accuracy']:.3f}" for t, s in scores.items()))
            if on_path:
                on_path(report)
    if "engine" in report["replies"]:  # greedy paths that must answer as the engine does, token for token
        same = [p for p in ("reference", "dspark-greedy", "triton-m3", "triton-ensemble", "openai")
                if p in report["replies"]]
        report["same_replies_as_engine"] = {p: report["replies"][p] == report["replies"]["engine"] for p in same}
        report["replies_unlike_engine"] = {p: unlike(report["replies"]["engine"], report["replies"][p]) for p in same}
    return report


def unlike(base: dict[str, list[str]], other: dict[str, list[str]], show: int = 3) -> dict[str, dict]:
    """Per task: how many replies differ from `base`'s, and the first `show` of them (index, both texts)."""
    out = {}
    for task, texts in base.items():
        diff = [i for i, (a, b) in enumerate(zip(texts, other[task], strict=True)) if a != b]
        out[task] = {"n": len(diff), "of": len(texts),
                     "first": [{"i": i, "engine": texts[i], "path": other[task][i]} for i in diff[:show]]}
    return out


def _transformers_ok() -> bool:
    try:
        from transformers import MiniMaxM3VLForCausalLM  # noqa: F401
    except ImportError:
        return False
    return True


def format_table(report: dict) -> str:
    tasks = report["tasks"]
    head = ["path"] + tasks + ["seconds"]
    rows = [head]
    for path, r in report["paths"].items():
        if "skipped" in r:
            rows.append([path] + ["-"] * len(tasks) + [f"skipped: {r['skipped']}"])
            continue
        cells = []
        for t in tasks:
            s = r["tasks"][t]
            cell = f"{100 * s['accuracy']:.1f}"
            if "acceptance_rate" in s:
                cell += f" (acc {s['acceptance_rate']:.2f}, len {s['mean_accepted_length']:.2f})"
            cells.append(cell)
        rows.append([path] + cells + [str(r["seconds"])])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


def _commit(where: str | None = None) -> str | None:
    """HEAD of the git checkout holding `where` (default: this file); None outside one."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=where or os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch
        return torch.cuda.get_device_name(0)
    return platform.processor() or platform.machine()


def add_parser(sub) -> None:
    e = sub.add_parser("eval-tasks", help="exact-match accuracy on the learned tasks, per task and per path")
    e.add_argument("--model", required=True)
    e.add_argument("--n", type=int, default=200, help="eval examples per task")
    e.add_argument("--paths", nargs="+", default=list(DEFAULT_PATHS), choices=PATHS)
    e.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    e.add_argument("--device", default="cpu", help="cpu or cuda")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    e.add_argument("--triton-url", help="gRPC address of a tritonserver serving the model (triton-* paths)")
    e.add_argument("--openai-url", help="base URL of an OpenAI-compatible gateway serving the model, e.g. "
                   "http://localhost:9000/v1 (the openai path; its key from $M3SERVE_OPENAI_API_KEY)")
    e.add_argument("--seed", type=int, default=0, help="eval set seed")
    e.add_argument("--out", help="write the JSON report here")
    e.add_argument("--replies", action="store_true", help="keep every reply in the JSON report")
    e.set_defaults(fn=cmd_eval_tasks)


def _command_line(a) -> str:
    """The command as parsed (every option spelled out, defaults included)."""
    parts = ["m3serve eval-tasks", f"--model {a.model}", f"--n {a.n}", "--paths " + " ".join(a.paths),
             "--tasks " + " ".join(a.tasks), f"--device {a.device}", f"--dtype {a.dtype}", f"--seed {a.seed}"]
    if a.triton_url:
        parts.append(f"--triton-url {a.triton_url}")
    if a.openai_url:
        parts.append(f"--openai-url {a.openai_url}")
    return " ".join(parts)


def cmd_eval_tasks(a) -> int:
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    meta = dict(date=started, device_name=_device_name(a.device), command=_command_line(a), commit=_commit())

    def write(report: dict) -> None:
        if a.out:
            with open(a.out, "w") as f:
                json.dump({**{k: v for k, v in report.items() if a.replies or k != "replies"}, **meta}, f, indent=1)

    report = evaluate(a.model, a.n, a.paths, a.device, a.dtype, a.triton_url, a.seed, tuple(a.tasks),
                      log=lambda s: print(s, file=sys.stderr, flush=True), on_path=write, openai_url=a.openai_url)
    write(report)
    print(format_table(report))
    return 0
