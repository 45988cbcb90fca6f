"""What the proxy's event loop spends on a long history that every call resends: reading the
body and attaching the request to the call store (`handlers.proxy.call._parsed`'s parse, then
`gyre.serving.tito.CallStore.match`), per call, before the engine request.

One execution in Claude Code's shape (Anthropic Messages: a ~8k-token system prompt, a
`tool_use` and a ~2k-token `tool_result` per call, the `cache_control` marker on the newest
message, so the message that held it before changes), grown call by call to N calls
(N=300: ~600k tokens, a ~2.6 MB body); the last 10 calls are timed. Twice: the body parsed
with the execution's `handlers.proxy.body.BodyMemo` (the proxy's way) and parsed whole
with `orjson.loads` (before it).

    .venv/bin/python -m handlers.bench.probes.resent_history_cost [--calls N]      (from the repository root)
"""
import argparse
import random
import statistics
import time

import orjson

from gyre.serving.tito import CallStore
from gyre.serving.tokenizer import build_tokenizer
from handlers.proxy.anthropic import parse_messages_request
from handlers.proxy.api import MessageMemo
from handlers.proxy.body import BodyMemo
from schemas.call import SamplingParams

WORDS = ["def", "return", "self", "import", "numpy", "value", "the", "file", "error", "test", "x", "=", "(", ")",
         ":", "\n", "    "]
TIMED = 10
MARK = {"type": "ephemeral"}


def run(tok, calls: int, reuse: bool) -> dict[str, list[float]]:
    rng = random.Random(0)
    blob = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    tools = [{"name": "Bash", "description": "Run a command. " + blob(300),
              "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
    system = [{"type": "text", "text": blob(8000), "cache_control": MARK}]
    messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": "task " + blob(200)}]}]
    store, memo, bodies = CallStore(tok), MessageMemo(), BodyMemo()
    loads = (lambda raw: bodies.loads(raw, "messages")) if reuse else orjson.loads
    times: dict[str, list[float]] = {"read the body": [], "parse it": [], "attach (TITO)": [], "bytes": []}
    for i in range(calls):
        last = messages[-1]
        marked = [*messages[:-1], {**last, "content": [*last["content"][:-1],
                                                        {**last["content"][-1], "cache_control": MARK}]}]
        raw = orjson.dumps({"model": "claude", "messages": marked, "system": system, "tools": tools,
                            "max_tokens": 32000, "stream": True})
        t0 = time.perf_counter()
        body = loads(raw)
        t1 = time.perf_counter()
        req = parse_messages_request(body, SamplingParams(), memo)
        t2 = time.perf_counter()
        match = store.match(req.messages, req.tools)
        t3 = time.perf_counter()
        if i >= calls - TIMED:
            for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, len(raw))):
                times[k].append(v)
        answer = {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"toolu_{i}", "type": "function", "function": {"name": "Bash", "arguments": f'{{"command": "ls {i}"}}'}}]}
        store.record(match, call=f"e:{i}", seq=i, answer=answer, completion_ids=[1, 2, 3])
        messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "Bash",
                                                        "input": {"command": f"ls {i}"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                   "content": blob(2000)}]}]
    times["prompt tokens"] = [len(match.prompt_ids)]
    return times


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m handlers.bench.probes.resent_history_cost",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    a = ap.parse_args()
    tok = build_tokenizer()
    for reuse in (True, False, True, False):
        t = run(tok, a.calls, reuse)
        ms = {k: statistics.median(v) * 1e3 for k, v in t.items() if k not in ("bytes", "prompt tokens")}
        print(f"{'BodyMemo' if reuse else 'orjson.loads':>12}: {t['prompt tokens'][0]:,} prompt tokens, "
              f"{t['bytes'][-1] / 1e6:.1f} MB body; median of the last {TIMED} calls: "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()) + f"; in all {sum(ms.values()):.2f} ms")


if __name__ == "__main__":
    main()
