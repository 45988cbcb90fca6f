"""What choosing a branch's parent costs on the proxy's event loop (`CallStore.complete`).

One execution of N calls (`handlers/bench/probes/branch_loop_lag.py`'s conversation: N=300 is ~600k tokens),
then 30 leaves: the last turn forked 30 times (retries, each an extension of the tip that
nothing extends). A branch must compare its ids with every leaf. Timed twice: a branch
diverging early (an edited task) and one diverging late (5 ids before the leaves' prompts
end).

    .venv/bin/python -m handlers.bench.probes.branch_parent_cost [N]      (from the repository root)
"""
import argparse
import random
import time

import numpy as np

from gyre.serving.tito import CallStore, Prepared
from gyre.serving.tokenizer import build_tokenizer
from handlers.bench.probes.branch_loop_lag import conversation


def main(calls: int) -> None:
    store = CallStore(build_tokenizer())
    msgs = conversation(store, calls, random.Random(0))
    for k in range(30):
        m = store.match([*msgs, {"role": "user", "content": f"variant {k}"}])
        store.record(m, call=f"f:{k}", seq=calls + k, answer={"role": "assistant", "content": "ok"},
                     completion_ids=[1, 2])
    branch = [msgs[0], {"role": "user", "content": msgs[1]["content"] + " "}, *msgs[2:]]
    pending = store.attach(branch)
    early = store.prepare(pending).prompt_ids
    tip = store.get("f:0")
    late = np.concatenate([tip.full_ids()[: tip.prefix_len - 5], np.arange(50, dtype=np.int32)])
    for name, ids in (("early", early), ("late", late)):
        for _ in range(3):
            t0 = time.perf_counter()
            m = store.complete(pending, Prepared(prompt_ids=ids))
            print(f"{name}-diverging branch, 30 leaves: complete {1e3 * (time.perf_counter() - t0):.1f} ms, "
                  f"parent {m.parent.call}, prefix {m.prefix_len:,} of {len(ids):,}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m handlers.bench.probes.branch_parent_cost",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("calls", nargs="?", type=int, default=300, help="calls in the execution (default 300: ~600k tokens)")
    main(p.parse_args().calls)
