"""How long a request whose prompt needs whole conversations rendered holds the proxy's
event loop (handlers.proxy.call.match, gyre.serving.tito).

Builds one execution's call store of N calls (a ~8k-token system prompt, +1 tool call and a
~2k-token tool result per call: N=300 gives ~600k tokens), then attaches a request to it
twice each way: `CallStore.match` on the loop (how the proxy did it before 3913311) and the
proxy's `match` (a heavy request is rendered and encoded in the proxy's branch thread). A
task ticking every 1 ms measures the loop's lag meanwhile. The request is a branch (the task
message edited, so no call extends it); with `--other-template` the tokenizer carries a
template other than gyre's (gyre's text plus a comment: the same rendering), which renders
every extension whole, and the request is an extension (one more user message).
`--omega` ends the system prompt with an ohm sign (U+2126, not NFC), a text piece that goes
to the HF encoder (gyre.serving.tokenizer.FastEncoder).

    .venv/bin/python -m handlers.bench.probes.branch_loop_lag [--calls N] [--omega] [--other-template]
    (from the repository root)
"""
import argparse
import asyncio
import concurrent.futures
import copy
import random
import time
import types

import numpy as np

from gyre.serving.tito import CallStore
from gyre.serving.tokenizer import build_tokenizer
from handlers.proxy.call import match

WORDS = ["def", "return", "self", "import", "numpy", "value", "the", "file", "error", "test", "x", "=", "(", ")",
         ":", "\n", "    "]


def conversation(store: CallStore, calls: int, rng: random.Random, system_tail: str = "") -> list[dict]:
    def blob(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    msgs = [{"role": "system", "content": blob(8000) + system_tail}, {"role": "user", "content": "task " + blob(200)}]
    for i in range(calls):
        match = store.match(msgs)
        answer = {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": f'{{"cmd": "ls {i}"}}'}}]}
        store.record(match, call=f"e:{i}", seq=i, answer=answer, completion_ids=[1, 2, 3])
        msgs = [*msgs, answer, {"role": "tool", "tool_call_id": f"c{i}", "content": blob(2000)}]
    return msgs


async def lag_during(label: str, work) -> object:
    lags, done = [], asyncio.Event()

    async def ticker():
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            lags.append(now - last - 0.001)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    match = await work()
    wall = time.perf_counter() - t0
    done.set()
    await tick
    ms = np.asarray(lags) * 1e3
    print(f"{label}: {'extension' if match.extended else 'branch'} of {len(match.prompt_ids):,} ids in "
          f"{wall * 1e3:.0f} ms; loop lag max {ms.max():.1f} ms, p99 {np.percentile(ms, 99):.1f} ms")
    return match


async def main(a: argparse.Namespace) -> None:
    tok = build_tokenizer()
    if a.other_template:
        tok = copy.copy(tok)
        tok.chat_template += "{#- another template #}"
    msgs = conversation(CallStore(tok), 0, random.Random(0))  # warm the caches
    thread = concurrent.futures.ThreadPoolExecutor(1)  # as ProxyState.branch_thread()
    for _ in range(2):
        stores = []
        for _ in range(2):  # one store per way: an extension consumes its parent's cached ids
            store = CallStore(tok)
            msgs = conversation(store, a.calls, random.Random(0), "\nR1 = 10 \u2126" if a.omega else "")
            stores.append(store)
        if a.other_template:
            request = [*msgs, {"role": "user", "content": "go on"}]
        else:
            request = [msgs[0], {"role": "user", "content": "an edited task"}, *msgs[2:]]

        async def inline():
            return stores[0].match(request)

        ns = types.SimpleNamespace(messages=request, tools=None)
        pending = stores[1].attach(request)
        where = "branch thread" if getattr(pending, "heavy", False) else "on the loop: not heavy"
        x = await lag_during("on the loop (CallStore.match)", inline)
        y = await lag_during(f"proxy (match, {where})", lambda: match(stores[1], ns, False, "e", thread))
        assert np.array_equal(x.prompt_ids, y.prompt_ids) and x.prefix_len == y.prefix_len


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m handlers.bench.probes.branch_loop_lag",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=300, help="calls in the execution (default 300: ~600k tokens)")
    p.add_argument("--omega", action="store_true", help="end the system prompt with an ohm sign (not NFC)")
    p.add_argument("--other-template", action="store_true",
                   help="a template other than gyre's (the request is then an extension)")
    asyncio.run(main(p.parse_args()))
