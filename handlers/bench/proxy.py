"""`gyre bench proxy`: what the proxy adds to a call, and how many calls one proxy process
carries, with every `call.completed` stored (BENCHMARKS.md "gyre bench proxy").

Processes: a private nats-server (JetStream), an instant engine (`_engine`: SGLang's
`/generate` answered at once with a fixed 20-token completion — a bash tool call in
Qwen3's format ending with `<|im_end|>` — and its log-probs), one proxy process (`_proxy`:
`handlers.proxy.daemon.run` with its production defaults: publishing with PubAck awaited, drift
check on, JSON logs to a file), a bare aiohttp pass-through (`_passthrough`: the floor
below), all three in handlers/bench/proxy_servers.py, and this process as the load
generator (handlers/bench/proxy_load.py).

Workload: realistic agent turns (handlers/bench/proxy_load.py): a ~1,000-token system
prompt, one bash tool and a task, a ~200-token tool result per call, 50 calls per
execution, executions starting at random ages so histories are in their steady state.
Variants: `chat` / `chat_stream` (OpenAI Chat Completions) and `messages` /
`messages_stream` (Anthropic Messages; skipped with a reason while the proxy has no
`/v1/messages`) by default; `responses` (OpenAI Responses as Codex CLI sends it:
`instructions`, input items with `function_call` / `function_call_output`, always
streamed) when named in `--variants` (not a BENCHMARKS.md key).

Per variant:
- latency: `executions` (256) simulated executions each send a call, wait for the whole
  answer, think for an exponential time (mean `think_s`, 1 s), for `duration_s` (10 s);
  the same load once through the proxy and once straight to the engine as the equivalent
  pre-tokenised `/generate` call (the prompt ids of the same history). Added latency =
  proxy-path percentile − direct percentile (p50, p99), in ms.
- throughput: closed loop, `concurrency` (64) executions, no think time, `duration_s`;
  calls answered per second through the one proxy process.
- CPU: the proxy process's user + system CPU time in each measured window divided by the
  calls answered in it (`/proc/<pid>/stat`, clock-tick resolution; it includes the
  window's background work: publishes, failed calls): `proxy_cpu_ms_per_call` in the
  latency run (≈ 250 calls/s with the defaults, the process sleeping between events) and
  `proxy_cpu_ms_per_call_saturated` in the throughput run. Less noisy than latency on a
  shared machine, and what the latency depends on: the one event loop queues calls
  behind each other's work.
- stored: after each run the CALLS stream must hold one `call.completed` per answered
  call (the proxy publishes each with its PubAck awaited); `unstored` counts the missing
  ones after a bounded drain, `drain_s` how long the stream took to catch up.

Floor (`floor`): the same latency pair with a bare aiohttp pass-through in the proxy's
place (an aiohttp server that forwards the pre-tokenised `/generate` body to the engine
with an aiohttp client session (`make_session`, unchanged so floors stay comparable across
versions), and returns the engine's bytes): what one more HTTP hop and a third Python
process cost on this machine before gyre does any work. Measured `reps` times, pass-through and direct alternating;
`added_latency_ms_*` as for a variant, and `calls_per_s` from a closed loop of
`concurrency` through the pass-through: the most a process that does no work carries
with this load generator here (BENCHMARKS.md expects ~4,000 of a bare pass-through).

Repetitions: `reps` (3) per variant, each a latency pair (proxy and direct, alternating
which runs first) and a throughput run; the keys hold medians over repetitions with
`_min`/`_max` beside (BENCHMARKS.md preamble).

Output (`--json PATH`, also printed): {"chat": {...}, "chat_stream": {...}, "messages":
{...}, "messages_stream": {...}, "floor": {...}, "machine": {...}, "config": {...}}; each
variant holds `added_latency_ms_p50`, `added_latency_ms_p90`, `added_latency_ms_p99`,
`calls_per_s`, `proxy_cpu_ms_per_call`, `proxy_cpu_ms_per_call_saturated` (medians, with
`_min`/`_max`; null without /proc or under `--profile`; `floor` holds the latency keys
and `calls_per_s`), `errors` (non-2xx answers or broken connections, on either path), `unstored`, `settle` (per measured
proxy run: seconds until every call answered so far was stored — after the warm-up for a
variant's first run, after the previous run otherwise — and whether that wait timed out),
and `reps`: per repetition the raw percentiles (`proxy_latency_ms`, `direct_latency_ms`:
p50/p90/p99) and call counts; a skipped variant holds `skipped` and null figures.
Targets: added p50 ≤ 1 ms, p99 ≤ 5 ms; ≥ 1,000 calls/s.

`--smoke` runs the same code paths for about a second each (CI). `--profile PATH` runs
the proxy under cProfile and writes its stats there.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.metadata
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import structlog

from gyre.progress import bar
from handlers.bench.proxy_load import (
    CALLS_PER_EXECUTION, MODEL, SECRET, Load, RunStats, Workload, _stored_calls, _wait_stored, direct_prompts,
)
from handlers.bench.proxy_servers import _wait_url

log = structlog.get_logger()

VARIANTS = ("chat", "chat_stream", "messages", "messages_stream")
EXTRA_VARIANTS = ("responses",)
"""Run only when named (`--variants`): not among BENCHMARKS.md's keys."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """Bench settings (BENCHMARKS.md defaults). Durations in seconds."""

    executions: int = 256
    think_s: float = 1.0
    duration_s: float = 10.0
    concurrency: int = 64
    variants: tuple[str, ...] = VARIANTS
    seed: int = 0
    profile: str = ""
    check_drift: bool = True
    reps: int = 3

    def __post_init__(self) -> None:
        if self.executions < 1 or self.concurrency < 1 or self.reps < 1:
            raise ValueError("executions, concurrency and reps must be >= 1")
        if self.duration_s <= 0 or self.think_s <= 0:
            raise ValueError("duration_s and think_s must be > 0")
        unknown = set(self.variants) - set(VARIANTS) - set(EXTRA_VARIANTS)
        if unknown:
            raise ValueError(f"unknown variants {sorted(unknown)}; known: {VARIANTS + EXTRA_VARIANTS}")


# --------------------------------------------------------------------------- figures


def _calls_per_s(stats: RunStats) -> float | None:
    return round(stats.calls / stats.window_s, 1) if stats.window_s else None


def _cpu_ms_per_call(stats: RunStats) -> float | None:
    return round(1000.0 * stats.proxy_cpu_s / stats.calls, 3) if stats.proxy_cpu_s is not None and stats.calls else None


def _rep_figures(lat: RunStats, direct: RunStats, thr: RunStats) -> dict:
    """One repetition: proxy and direct latency percentiles, added latency, calls/s, the
    proxy's CPU per answered call in the latency and the throughput run."""
    p, d = percentiles_ms(lat.latencies), percentiles_ms(direct.latencies)
    return {"added_latency_ms": _added(p, d), "proxy_latency_ms": p, "direct_latency_ms": d,
            "calls_per_s": _calls_per_s(thr),
            "proxy_cpu_ms_per_call": _cpu_ms_per_call(lat), "proxy_cpu_ms_per_call_saturated": _cpu_ms_per_call(thr),
            "latency_calls": lat.calls, "direct_calls": direct.calls, "throughput_calls": thr.calls,
            "throughput_window_s": round(thr.window_s, 3), "errors": lat.errors + thr.errors,
            "error_samples": lat.error_samples + thr.error_samples}


def _added(path: dict[str, float | None], direct: dict[str, float | None]) -> dict[str, float | None]:
    """Added latency per percentile (ms): `path` minus `direct`, None where either is."""
    return {q: (round(path[q] - direct[q], 3) if path[q] is not None and direct[q] is not None else None)
            for q in path}


CPU_KEYS = ("proxy_cpu_ms_per_call", "proxy_cpu_ms_per_call_saturated")
FIGURE_KEYS = ("added_latency_ms_p50", "added_latency_ms_p90", "added_latency_ms_p99", "calls_per_s", *CPU_KEYS)
"""A variant's figures (medians); a skipped variant holds each as None."""


def _variant_figures(reps: list[dict]) -> dict:
    """A variant's keys: the median over repetitions of added p50/p90/p99, calls/s and the
    proxy's CPU per call (`CPU_KEYS`; repetitions without a figure are left out, None
    when none has one), with `_min`/`_max` beside (BENCHMARKS.md preamble), and every
    repetition under `reps`."""
    import statistics

    out: dict[str, Any] = {}
    series = {f"added_latency_ms_{q}": [r["added_latency_ms"][q] for r in reps] for q in ("p50", "p90", "p99")}
    series["calls_per_s"] = [r["calls_per_s"] for r in reps]
    for key in CPU_KEYS:
        series[key] = [r.get(key) for r in reps]
    for key, values in series.items():
        values = [v for v in values if v is not None]
        out[key] = round(statistics.median(values), 3) if values else None
        if len(values) > 1:
            out[f"{key}_min"], out[f"{key}_max"] = min(values), max(values)
    out["errors"] = sum(r["errors"] for r in reps)
    out["error_samples"] = [e for r in reps for e in r["error_samples"]][:3]
    out["reps"] = reps
    return out


def percentiles_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    arr = np.asarray(values) * 1000.0
    return {f"p{q}": round(float(np.percentile(arr, q)), 3) for q in (50, 90, 99)}


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    return {"cpu": cpu, "cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "torch": torch_version, "platform": platform.platform(),
            "loadavg_1m_at_start": load}


# --------------------------------------------------------------------------- orchestration


async def _probe_messages(session: Any, proxy_url: str) -> str:
    """'' when the proxy serves /v1/messages, else why not."""
    from gyre.env.harness import execution_key

    body = orjson.dumps({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    headers = {"x-api-key": execution_key(SECRET, "probe-messages"), "anthropic-version": "2023-06-01",
               "Content-Type": "application/json"}
    async with session.post(proxy_url + "/v1/messages", data=body, headers=headers) as resp:
        raw = await resp.read()
        if resp.status == 200:
            return ""
        return f"the proxy answered /v1/messages with {resp.status}: {raw[:200].decode(errors='replace')}"


async def bench(cfg: BenchConfig, workdir: Path) -> dict:
    from bus import Bus
    from bus.server import NatsServer
    from gyre.serving.tokenizer import build_tokenizer

    tok = build_tokenizer()
    w = Workload.build(tok, cfg.seed)
    prompts = direct_prompts(tok, w)
    run = "bench" + uuid.uuid4().hex[:8]
    nats = NatsServer.start(workdir / "nats")
    procs: list[subprocess.Popen] = []
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for stale in ("engine.url", "proxy.json", "passthrough.url"):
        (workdir / stale).unlink(missing_ok=True)
    result: dict = {}
    try:
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        ids_arg = ",".join(map(str, w.completion_ids))
        eng = subprocess.Popen([sys.executable, "-m", "handlers.bench.proxy_servers", "_engine", "--url-file",
                                str(workdir / "engine.url"), "--ids", ids_arg],
                               stdout=open(logs / "engine.log", "wb"), stderr=subprocess.STDOUT, env=env)
        procs.append(eng)
        engine_url = _wait_url(workdir / "engine.url", eng, "engine")
        proxy_argv = [sys.executable]
        if cfg.profile:
            proxy_argv += ["-m", "cProfile", "-o", cfg.profile]
        proxy_argv += ["-m", "handlers.bench.proxy_servers", "_proxy", "--url-file", str(workdir / "proxy.json"),
                       "--engine-url", engine_url, "--nats-url", nats.url, "--run", run]
        if not cfg.check_drift:
            proxy_argv.append("--no-drift-check")
        passthrough = subprocess.Popen([sys.executable, "-m", "handlers.bench.proxy_servers", "_passthrough",
                                        "--url-file", str(workdir / "passthrough.url"), "--engine-url", engine_url],
                                       stdout=open(logs / "passthrough.log", "wb"), stderr=subprocess.STDOUT, env=env)
        procs.append(passthrough)
        passthrough_url = _wait_url(workdir / "passthrough.url", passthrough, "pass-through")
        penv = dict(env, GYRE_BENCH_NATS_TOKEN=nats.token or "")
        prox = subprocess.Popen(proxy_argv, stdout=open(logs / "proxy.log", "wb"), stderr=subprocess.STDOUT, env=penv)
        procs.append(prox)
        proxy_pid = None if cfg.profile else prox.pid  # under cProfile the figure would be the profiler's
        proxy_url = _wait_url(workdir / "proxy.json", prox, "proxy")
        bus = await Bus.connect(nats.url, token=nats.token, run=run, name="bench")
        await bus.ensure_streams()
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=120)
        rng = random.Random(cfg.seed)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            load = Load(session, proxy_url, engine_url, w, prompts, bus, run)
            load.proxy_pid = proxy_pid
            skip_messages = await _probe_messages(session, proxy_url)
            # the probe's own call (if answered) is stored before any variant starts counting
            await _wait_stored(bus, run, 0 if skip_messages else 1, 10.0)
            load.stored_offset = await _stored_calls(bus, run)
            result["machine"] = machine()
            for variant in cfg.variants:
                if variant.startswith("messages") and skip_messages:
                    result[variant] = {**{k: None for k in FIGURE_KEYS}, "skipped": skip_messages}
                    continue
                vlog = log.bind(variant=variant)
                before = load.answered
                load.settles.clear()
                stored_before = await _stored_calls(bus, run)
                reps = []
                for rep in bar(range(cfg.reps), total=cfg.reps, desc=f"{variant} reps"):
                    # proxy and direct paths alternate which goes first, so a slow spell of
                    # this shared machine does not always fall on the same one
                    if rep % 2 == 0:
                        lat = await load.run_proxy(variant, cfg.executions, cfg.think_s, cfg.duration_s, rng)
                        direct = await load.run_direct(cfg.executions, cfg.think_s, cfg.duration_s, rng)
                    else:
                        direct = await load.run_direct(cfg.executions, cfg.think_s, cfg.duration_s, rng)
                        lat = await load.run_proxy(variant, cfg.executions, cfg.think_s, cfg.duration_s, rng)
                    thr = await load.run_throughput(variant, cfg.concurrency, cfg.duration_s, rng)
                    reps.append(_rep_figures(lat, direct, thr))
                load.finish_pool()
                expected = load.answered - before
                stored, drain_s = await _wait_stored(bus, run, stored_before + expected, 60.0)
                result[variant] = _variant_figures(reps)
                result[variant].update(answered=expected, unstored=max(stored_before + expected - stored, 0),
                                       drain_s=round(drain_s, 3), settle=list(load.settles))
                vlog.info("bench.proxy.variant", **{k: v for k, v in result[variant].items()
                                                    if k in ("added_latency_ms_p50", "added_latency_ms_p99",
                                                             "calls_per_s", "errors", "unstored")})
            result["floor"] = await _floor(load, passthrough_url, cfg, rng)
            log.info("bench.proxy.floor", added_latency_ms_p50=result["floor"]["added_latency_ms_p50"],
                     added_latency_ms_p99=result["floor"]["added_latency_ms_p99"])
        await bus.close()
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        nats.stop()
    result["config"] = {"reps": cfg.reps, "executions": cfg.executions, "think_s": cfg.think_s, "duration_s": cfg.duration_s,
                        "concurrency": cfg.concurrency, "calls_per_execution": CALLS_PER_EXECUTION,
                        "completion_tokens": len(w.completion_ids), "system_tokens": len(prompts[0]),
                        "last_prompt_tokens": len(prompts[-1]),
                        "proxy": "handlers.proxy.daemon defaults (PubAck awaited)", "check_drift": cfg.check_drift}
    return result


async def _floor(load: Load, passthrough_url: str, cfg: BenchConfig, rng: random.Random) -> dict:
    """`reps` repetitions, each a latency pair (the bare pass-through against the engine
    straight, alternating which runs first) and a closed loop of `concurrency` through the
    pass-through (`calls_per_s`: what a process doing no work at all carries with this
    load generator on this machine, the ceiling beside BENCHMARKS.md's "~4,000 here"). The
    variant keys without the CPU ones."""
    reps = []
    for rep in bar(range(cfg.reps), total=cfg.reps, desc="direct reps"):
        runs = {}
        for path in (("passthrough", "direct") if rep % 2 == 0 else ("direct", "passthrough")):
            runs[path] = await load.run_direct(cfg.executions, cfg.think_s, cfg.duration_s, rng,
                                               passthrough_url if path == "passthrough" else "")
        thr = await load.run_direct(cfg.concurrency, 0.0, cfg.duration_s, rng, passthrough_url)
        p, d = percentiles_ms(runs["passthrough"].latencies), percentiles_ms(runs["direct"].latencies)
        reps.append({"added_latency_ms": _added(p, d), "passthrough_latency_ms": p, "direct_latency_ms": d,
                     "calls_per_s": _calls_per_s(thr),
                     "latency_calls": runs["passthrough"].calls, "direct_calls": runs["direct"].calls,
                     "throughput_calls": thr.calls,
                     "errors": runs["passthrough"].errors + runs["direct"].errors + thr.errors,
                     "error_samples": runs["passthrough"].error_samples + runs["direct"].error_samples
                     + thr.error_samples})
    out = _variant_figures(reps)
    for key in CPU_KEYS:
        out.pop(key, None)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="gyre bench proxy", description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--json", help="write the results here")
    p.add_argument("--smoke", action="store_true", help="the machinery only (CI; 10–30 s, mostly starting processes): 8 executions, 0.5 s runs")
    p.add_argument("--duration-s", type=float, default=None, help="seconds of load per run (default 10)")
    p.add_argument("--executions", type=int, default=None,
                   help="simulated executions in the latency runs (default 256)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="executions in the closed-loop throughput runs (default 64)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS + EXTRA_VARIANTS)} (default: {', '.join(VARIANTS)})")
    p.add_argument("--no-drift-check", action="store_true",
                   help="run the proxy with check_drift=False (diagnosis; not the benchmark's setting)")
    p.add_argument("--profile", default="", help="run the proxy under cProfile, stats to this path")
    p.add_argument("--workdir", default="", help="keep logs here (default: a temporary directory)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per variant, median reported (default 3)")
    a = p.parse_args(argv)
    base = BenchConfig(executions=8, duration_s=0.5, concurrency=4, think_s=0.2, reps=1) if a.smoke else BenchConfig()
    given = {name: getattr(a, name) for name in ("duration_s", "executions", "concurrency", "reps")
             if getattr(a, name) is not None}
    variants = tuple(dict.fromkeys(v.strip() for v in a.variants.split(",") if v.strip()))
    if not variants:
        p.error(f"--variants names none of {', '.join(VARIANTS + EXTRA_VARIANTS)}")
    profile = os.path.abspath(a.profile) if a.profile else ""
    if profile and not Path(profile).parent.is_dir():
        p.error(f"--profile: no directory {Path(profile).parent}")
    try:
        cfg = dataclasses.replace(base, **given, variants=variants, profile=profile, check_drift=not a.no_drift_check)
    except ValueError as exc:
        p.error(str(exc))
    from handlers.daemon import configure_logging

    configure_logging("bench-proxy")  # after the argument checks: a usage error configures nothing
    t0 = time.perf_counter()
    if a.workdir:
        Path(a.workdir).mkdir(parents=True, exist_ok=True)
        result = asyncio.run(bench(cfg, Path(a.workdir)))
    else:
        with tempfile.TemporaryDirectory(prefix="gyre-bench-proxy-") as d:
            result = asyncio.run(bench(cfg, Path(d)))
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(format_table(result))
    if a.json:
        Path(a.json).write_text(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")
        print(f"wrote {a.json}")
    return 0


def format_table(result: dict) -> str:
    """The figures as a table (BENCHMARKS.md: each bench prints one; `--json` has them all):
    per variant the added latency p50 / p99 (ms) and calls/s, medians with [min–max] over
    the repetitions, the proxy's CPU ms per call (latency run, saturated), failed calls and
    answered calls the bus does not hold (a skipped variant: why); then the targets and
    the machine."""
    def cell(fig: dict, key: str, fmt: str, spread: bool = True) -> str:
        value = fig.get(key)
        if value is None:
            return "—"
        lo, hi = fig.get(f"{key}_min"), fig.get(f"{key}_max")
        shown = spread and lo is not None and hi is not None and lo != hi
        return f"{value:{fmt}}" + (f" [{lo:{fmt}}–{hi:{fmt}}]" if shown else "")

    head = (f"{'variant':<17}{'added p50 ms':>22}{'added p99 ms':>22}{'calls/s':>26}{'CPU ms/call':>14}"
            f"{'saturated':>11}{'errors':>8}{'unstored':>10}")
    lines = [head, "-" * len(head)]
    for name in (*VARIANTS, *EXTRA_VARIANTS, "floor"):
        fig = result.get(name)
        if not isinstance(fig, dict):
            continue
        if fig.get("skipped"):
            lines.append(f"{name:<17}skipped: {fig['skipped']}")
            continue
        lines.append(f"{name:<17}{cell(fig, 'added_latency_ms_p50', '.2f'):>22}"
                     f"{cell(fig, 'added_latency_ms_p99', '.1f'):>22}{cell(fig, 'calls_per_s', ',.0f'):>26}"
                     f"{cell(fig, 'proxy_cpu_ms_per_call', '.2f', False):>14}"
                     f"{cell(fig, 'proxy_cpu_ms_per_call_saturated', '.2f', False):>11}"
                     f"{fig.get('errors', 0):>8}{fig.get('unstored', '—') if name != 'floor' else '—':>10}")
    lines.append("targets: added p50 ≤ 1 ms, p99 ≤ 5 ms; ≥ 1,000 calls/s (floor: a bare aiohttp pass-through)")
    m = result.get("machine") or {}
    lines.append(f"machine: {m.get('cpus')} cores ({m.get('cpu')}), Python {m.get('python')}, torch {m.get('torch')}; "
                 f"wall {result.get('wall_s', 0):.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
