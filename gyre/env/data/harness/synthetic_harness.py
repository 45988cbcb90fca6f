"""gyre's synthetic harness: a real OpenAI Chat Completions client whose execution lasts as
long as a seeded workload says (stdlib only; `gyre bench modes`, BENCHMARKS.md).

It reads the workload from `workload.json` in its working directory (the task's starting
file), its execution id from $OPENAI_API_KEY (`gyre-<execution>-<mac>`, the id
`s<step>-g<group>-e<index>`), and draws its duration D from the workload, the seed and
(step, group, index) only, so every scheduling mode meets the same durations. It then makes
`calls` chat calls through $OPENAI_BASE_URL, each extending the previous one (one
trajectory), call i at i·T/calls seconds after its start with T = min(D, timeout), thinks
until D has passed, and exits 0. An execution drawn past the timeout (D = inf for the
`timeout_bound` ones that hit it) keeps thinking until the runner kills it.

`answer.txt` is written first: `pass` for an even index, `fail` for an odd one, so every
group's rewards differ (every execution has an advantage, a step's micro-step count does not
depend on sampling) and a killed execution is graded like a finished one.

    python synthetic_harness.py --model MODEL

workload.json: {"workload": "tail_heavy" | "timeout_bound", "seed": int, "scale": float
(multiplies every duration and the timeout), "timeout_s": float (before scaling),
"calls": int, "max_tokens": int}.
"""
import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import time
import urllib.error
import urllib.request

Z90 = statistics.NormalDist().inv_cdf(0.9)
WORKLOADS = {
    # name: (fraction of executions that run into the timeout, lognormal median s, p90 s)
    "tail_heavy": (0.0, 4.0, 15.0),       # TerminalBench-like; ≈ 2.5% pass 30 s
    "timeout_bound": (0.4, 10.0, 22.5),   # 2.4T-like: 40% hit the timeout
}
FOLLOW_UP = "Go on."


def parse_execution(execution):
    """(step, group, index) of `s<step>-g<group>-e<index>`; ValueError otherwise."""
    parts = execution.split("-")
    if len(parts) != 3 or [p[:1] for p in parts] != ["s", "g", "e"]:
        raise ValueError(f"not an execution id s<step>-g<group>-e<index>: {execution!r}")
    return tuple(int(p[1:]) for p in parts)


def execution_of_key(key):
    """The execution id inside an execution key `gyre-<execution>-<mac>`."""
    if not key.startswith("gyre-"):
        raise ValueError("not a gyre execution key")
    execution, sep, _mac = key[len("gyre-"):].rpartition("-")
    if not sep:
        raise ValueError("not a gyre execution key")
    return execution


def uniform(seed, workload, step, group, index, name):
    """A uniform number in (0, 1) from a hash: the same on every machine and Python."""
    digest = hashlib.sha256(f"{seed}:{workload}:{step}:{group}:{index}:{name}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") + 0.5) / 2.0 ** 64


def duration_s(workload, seed, step, group, index, scale=1.0):
    """Seconds execution (step, group, index) runs; math.inf when it runs into the timeout
    by construction (the timeout itself is the runner's). KeyError for an unknown workload."""
    timeouts, median, p90 = WORKLOADS[workload]
    if timeouts and uniform(seed, workload, step, group, index, "timeout") < timeouts:
        return math.inf
    sigma = math.log(p90 / median) / Z90
    z = statistics.NormalDist().inv_cdf(uniform(seed, workload, step, group, index, "duration"))
    return scale * median * math.exp(sigma * z)


def chat(base_url, key, body, timeout_s=600.0):
    req = urllib.request.Request(
        base_url.rstrip("/") + "/chat/completions", data=json.dumps(body).encode("utf-8"), method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read().decode("utf-8"))


def sleep_until(t):
    while True:
        left = t - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 60.0))


def main(argv=None):
    started = time.monotonic()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--workload-file", default="workload.json")
    a = p.parse_args(argv)
    base_url, key = os.environ.get("OPENAI_BASE_URL", ""), os.environ.get("OPENAI_API_KEY", "")
    if not base_url or not key:
        print("synthetic_harness: OPENAI_BASE_URL and OPENAI_API_KEY must be set", file=sys.stderr)
        return 1
    with open(a.workload_file, encoding="utf-8") as fh:
        spec = json.load(fh)
    execution = execution_of_key(key)
    step, group, index = parse_execution(execution)
    scale = float(spec.get("scale", 1.0))
    d = duration_s(spec["workload"], int(spec.get("seed", 0)), step, group, index, scale)
    span = min(d, scale * float(spec["timeout_s"]))
    calls = int(spec.get("calls", 2))
    print(f"synthetic_harness: {execution} runs {d:.3f} s ({spec['workload']}, seed {spec.get('seed', 0)})", flush=True)
    with open("answer.txt", "w", encoding="utf-8") as fh:
        fh.write("pass" if index % 2 == 0 else "fail")
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": f"Execution {execution}: say something."}]
    for i in range(calls):
        sleep_until(started + i * span / calls)
        body = {"model": a.model, "messages": messages, "max_tokens": int(spec.get("max_tokens", 4))}
        try:
            reply = chat(base_url, key, body)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            detail = exc.read().decode("utf-8", "replace")[:500] if isinstance(exc, urllib.error.HTTPError) else ""
            print(f"synthetic_harness: call {i} failed: {exc} {detail}", file=sys.stderr)
            return 1
        answer = (reply.get("choices") or [{}])[0].get("message", {}).get("content") or ""
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
    sleep_until(started + d if math.isfinite(d) else math.inf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
