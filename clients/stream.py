#!/usr/bin/env python3
"""Stream one reply from the m3serve Triton server over gRPC and print it as it arrives.

  python clients/stream.py --prompt "The quick brown fox"                    # raw prompt, model m3
  python clients/stream.py --chat "What is the weather like in Paris?"       # chat template on the server
  python clients/stream.py --messages msgs.json --reasoning                  # messages file, show reasoning
  python clients/stream.py --chat "Weather in Oslo, 3 days?" --tools tools.json   # + tools; prints the parsed calls
  python clients/stream.py --model ensemble --prompt "Hello"                 # tokenize -> m3_ids -> detokenize

At the end: time to first token, output tokens, and tokens/s (decode rate after the first token).
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import time

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype


def tensor(name: str, value, dtype=None, batch: bool = False) -> grpcclient.InferInput:
    arr = np.array([value], dtype=dtype if dtype is not None else (object if isinstance(value, (str, bytes))
                                                                    else None))
    if arr.dtype == object:
        arr = np.array([v.encode("utf-8") if isinstance(v, str) else v for v in arr], dtype=object)
    if batch:
        arr = arr.reshape(1, 1)
    t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
    t.set_data_from_numpy(arr)
    return t


def build_inputs(a) -> list[grpcclient.InferInput]:
    if a.model_kind == "ensemble":
        if a.chat or a.messages:
            raise SystemExit("the ensemble takes a raw --prompt (no chat template)")
        ins = [tensor("text_input", a.prompt, batch=True), tensor("max_tokens", a.max_tokens, np.int32, True),
               tensor("stream", True, bool, True)]
        if a.temperature is not None:
            ins.append(tensor("temperature", a.temperature, np.float32, True))
        return ins
    ins = [tensor("stream", True, bool), tensor("return_num_output_tokens", True, bool),
           tensor("return_finish_reason", True, bool)]
    if a.prompt is not None:
        ins.append(tensor("text_input", a.prompt))
    else:
        if a.messages:
            with open(a.messages, encoding="utf-8") as f:
                messages = json.load(f)
        else:
            messages = ([{"role": "system", "content": a.system}] if a.system else []) + \
                       [{"role": "user", "content": a.chat}]
        ins.append(tensor("messages", json.dumps(messages)))
        if a.tools:
            ins.append(tensor("tools", json.dumps(a.tool_list)))
        if a.thinking:
            ins.append(tensor("chat_template_kwargs", json.dumps({"thinking_mode": a.thinking})))
    if a.reasoning:
        ins.append(tensor("return_reasoning", True, bool))
    sp = {"max_tokens": a.max_tokens}
    if a.temperature is not None:
        sp["temperature"] = a.temperature
    if a.seed is not None:
        sp["seed"] = a.seed
    if a.ignore_eos:
        sp["ignore_eos"] = True
    if a.tools:
        sp["skip_special_tokens"] = False  # the tool-call markup is made of special tokens
    ins.append(tensor("sampling_parameters", json.dumps(sp)))
    return ins


def wait_ready(client, model: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if client.is_server_ready() and client.is_model_ready(model):
                return
        except InferenceServerException:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"server or model {model!r} not ready after {timeout:.0f}s")
        time.sleep(0.5)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="localhost:8001", help="gRPC endpoint")
    p.add_argument("--model", default="m3", help="m3 (text contract) or ensemble")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw prompt text")
    src.add_argument("--chat", help="one user message (the server applies the chat template)")
    src.add_argument("--messages", help="JSON file with a list of chat messages")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--tools", help="JSON file with a list of tools (JSON schemas) for --chat / --messages; the "
                                   "reply's tool calls are parsed and printed at the end (needs m3serve)")
    p.add_argument("--thinking", choices=["enabled", "disabled", "adaptive"], help="chat template thinking_mode")
    p.add_argument("--reasoning", action="store_true", help="ask for reasoning_output (minimax_m3 parser)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens tokens whatever comes")
    p.add_argument("--wait-ready", type=float, default=0.0, metavar="S", help="wait up to S seconds for readiness")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    a = p.parse_args(argv)
    a.model_kind = "ensemble" if a.model == "ensemble" else "text"
    if a.tools:
        if a.prompt is not None or a.model_kind == "ensemble":
            raise SystemExit("--tools goes with --chat or --messages on the m3 model")
        with open(a.tools, encoding="utf-8") as f:
            a.tool_list = json.load(f)

    client = grpcclient.InferenceServerClient(a.url)
    if a.wait_ready:
        wait_ready(client, a.model, a.wait_ready)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    t0 = time.perf_counter()
    client.async_stream_infer(a.model, build_inputs(a), request_id="stream-1", enable_empty_final_response=True)
    ttft = t_last = None
    tokens = 0
    reply: list[str] = []
    finish = None
    in_reasoning = False
    tty = sys.stdout.isatty()
    try:
        while True:
            try:
                result, error = responses.get(timeout=a.timeout)
            except queue.Empty:
                print(f"\n[stream] no response for {a.timeout:.0f}s", file=sys.stderr)
                return 1
            if error is not None:
                print(f"\n[stream] error: {error}", file=sys.stderr)
                return 1
            now = time.perf_counter()
            reasoning = result.as_numpy("reasoning_output")
            text = result.as_numpy("text_output")
            r = b"".join(reasoning.reshape(-1)).decode("utf-8", "replace") if reasoning is not None else ""
            t = b"".join(text.reshape(-1)).decode("utf-8", "replace") if text is not None else ""
            if r:
                if not in_reasoning:
                    sys.stdout.write("\x1b[2m[reasoning] " if tty else "[reasoning] ")
                    in_reasoning = True
                sys.stdout.write(r)
            if t:
                if in_reasoning:
                    sys.stdout.write("\x1b[0m\n" if tty else "\n")
                    in_reasoning = False
                sys.stdout.write(t)
                reply.append(t)
            sys.stdout.flush()
            n = result.as_numpy("num_output_tokens")
            got = int(n.sum()) if n is not None else (1 if (t or r) else 0)
            if got and ttft is None:
                ttft = now - t0
            if got:
                t_last = now
            tokens += got
            fr = result.as_numpy("finish_reason")
            if fr is not None and fr.size:
                finish = fr.reshape(-1)[0].decode()
            params = result.get_response().parameters
            if "triton_final_response" in params and params["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    if in_reasoning and tty:
        sys.stdout.write("\x1b[0m")
    total = time.perf_counter() - t0
    rate = (tokens - 1) / (t_last - t0 - ttft) if ttft is not None and tokens > 1 and t_last > t0 + ttft else 0.0
    print()
    if a.tools:
        from m3serve.text.tool_parser import parse_tool_calls

        content, calls = parse_tool_calls("".join(reply), a.tool_list)
        print(json.dumps({"content": content, "tool_calls": calls}, ensure_ascii=False))
    print(f"[stream] TTFT {1000 * (ttft or 0):.1f} ms | {tokens} tokens in {total:.2f} s | "
          f"{rate:.1f} tokens/s after the first | finish_reason {finish}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
