"""What a long fresh or branch call's `call.completed` costs on the proxy's event loop:
`ProxyState.call_event` plus the encoding `ProxyState._publish` does before its first
await (the object-store payload included). A 680,000-token prompt (a root or branch of a
long rollout carries its whole prompt), 500 sampled tokens; three runs.

    .venv/bin/python -m handlers.bench.probes.call_event_cost [TOKENS]      (from the repository root)
"""
import argparse
import time

import numpy as np
import orjson

from gyre.serving.tito import Match
from gyre.serving.tokenizer import build_tokenizer
from handlers.proxy.daemon import Config
from handlers.proxy.state import ProxyState
from handlers.proxy.routing import EngineResult
from schemas import encode
from schemas.call import SamplingParams


def main(tokens: int) -> None:
    state = ProxyState(Config(run="r", key_secret=b"k" * 32), build_tokenizer(), session=None)
    ids = np.random.default_rng(0).integers(0, 150_000, tokens).astype(np.int32)
    match = Match(parent=None, prefix_len=0, prompt_ids=ids, extended=False, drift=0, messages=(), tools=(),
                  digest=b"")
    result = EngineResult(output_ids=list(range(500)), logprobs=[-0.123456] * 500, finish="stop",
                          versions=((0, 500, 1),), cell="c", queue_s=0.0, engine_s=0.0)
    for _ in range(3):
        t0 = time.perf_counter()
        event, tokens_json = state.call_event(execution="e", seq=1, match=match, sampling=SamplingParams(),
                                              result=result, status="ok", total_s=0.1, cell="c")
        data = encode(event)
        if tokens_json is None and len(data) > state.cfg.object_threshold_bytes:  # moved at publish
            t = event.tokens
            orjson.dumps({"prompt_ids": t.prompt_ids, "completion_ids": t.completion_ids, "logprobs": t.logprobs})
        print(f"{tokens:,} prompt tokens: {1e3 * (time.perf_counter() - t0):.1f} ms on the loop "
              f"(tokens {'in the object store' if event.tokens_ref else 'inline'}, event {len(data):,} bytes)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m handlers.bench.probes.call_event_cost",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("tokens", nargs="?", type=int, default=680_000, help="prompt tokens (default 680,000)")
    main(p.parse_args().tokens)
