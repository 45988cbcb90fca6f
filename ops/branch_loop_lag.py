"""How long a long branch holds the proxy's event loop (handlers.proxy._match, gyre.tito).

Builds one execution's call store of N calls (a ~8k-token system prompt, +1 tool call and a
~2k-token tool result per call: N=300 gives ~600k tokens), then attaches a branch of it (the
task message edited, so no call extends it) twice each way: `CallStore.match` on the loop
(how the proxy did it before 3913311) and the proxy's `_match` (a heavy branch is rendered and
encoded in the proxy's branch thread). A task ticking every 1 ms measures the loop's lag meanwhile.

    .venv/bin/python ops/branch_loop_lag.py [N [omega]]      (from the repository root)
"""
import asyncio
import concurrent.futures
import random
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's gyre, not an installed one
from gyre.tito import CallStore  # noqa: E402
from gyre.tokenizer import build_tokenizer  # noqa: E402
from handlers.proxy import _match  # noqa: E402

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
    print(f"{label}: {len(match.prompt_ids):,} ids in {wall * 1e3:.0f} ms; loop lag max {ms.max():.1f} ms, "
          f"p99 {np.percentile(ms, 99):.1f} ms")
    return match


async def main(calls: int, system_tail: str) -> None:
    store = CallStore(build_tokenizer())
    msgs = conversation(store, calls, random.Random(0), system_tail)
    branch = [msgs[0], {"role": "user", "content": "an edited task"}, *msgs[2:]]
    request = types.SimpleNamespace(messages=branch, tools=None)
    thread = concurrent.futures.ThreadPoolExecutor(1)  # as ProxyState.branch_thread()

    async def inline():
        return store.match(branch)

    for _ in range(2):
        a = await lag_during("on the loop (CallStore.match)  ", inline)
        b = await lag_during("proxy (_match, worker thread)  ", lambda: _match(store, request, False, "e", thread))
        assert np.array_equal(a.prompt_ids, b.prompt_ids) and a.prefix_len == b.prefix_len


if __name__ == "__main__":
    # `omega`: the system prompt ends with an ohm sign (U+2126, not NFC): one piece of the
    # text goes to the HF encoder (gyre.tokenizer.FastEncoder)
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 300,
                     "\nR1 = 10 \u2126" if sys.argv[2:] == ["omega"] else ""))
