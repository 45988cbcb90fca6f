"""`gyre bench hostile`: does bad input get a clear answer and leave the rest untouched?
(BENCHMARKS.md "gyre bench hostile").

System: a real run of the toy recipe on this machine — a private nats-server, the proxy,
runner, evaluator, builder, scheduler and one cell (its embedded engine, the run's engine
token), each its own process as `gyre run` starts them (`handlers.run.Supervisor`) — doing
its own steps (`--steps`, 2) meanwhile, with the harnesses it dispatches.

Inputs (handlers/bench/hostile_inputs.py, Hypothesis, seeded by `--seed`):
- `--requests` (1,000) malformed or hostile requests over OpenAI Chat, Responses and
  Anthropic Messages, sent `--concurrency` (4) at a time under keys of 16 executions of
  their own;
- `--events` (200) malformed events on every subject a daemon consumes through a durable
  consumer (`consumed`: the run's `bus.subjects.CONSUMERS` and each cell's), published raw
  while the requests go out (those of `microstep.ready`, which a cell reads only while it
  trains, before the daemons start, so the run's first training reads them);
- meanwhile a steady client: one agent per API (Chat, Messages, Responses), each
  conversation growing by its answers for 2 calls before the next one starts, until the
  hostile requests are all answered (2 calls: the toy recipe's `harness.max_calls`).

Audit: every answer's status (`answered_2xx` — a generated body that happens to be valid —,
`answered_4xx`, `answered_5xx`, `unanswered`: no HTTP answer), per kind too; the dead-letter
stream: a bad event counts as `dead_lettered` once a copy of it (its stream and sequence)
is there, and the audit waits (`--audit-timeout`) until every consumer of its subject has
settled everything (`Bus.consumer_backlog`); `crashes`: daemons that exited before the end;
`handler_errors`: `bus.handler.failed` lines in the daemons' logs (an event that decoded and
then failed, never expected here); a good call is lost when it was not answered 200 with
an answer, or its `call.completed` is not stored within 60 s (`good_calls_lost`).

Keys (`--json PATH`, also printed as a table): `requests`, `answered_2xx`, `answered_4xx`,
`answered_5xx`, `unanswered`, `by_kind`, `events`, `dead_lettered`, `by_subject`, `crashes`,
`crashed`, `handler_errors`, `good_calls`, `good_calls_lost`, `steps_completed`, `wall_s`,
`seed`, `machine`. Targets: `answered_5xx` 0, `crashes` 0, `good_calls_lost` 0, every bad
event dead-lettered. `--smoke`: 60 requests and 10 events a subject (CI).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

import schemas
from bus import Bus, subjects
from bus.consumer import DLQ_SEQ, DLQ_SUBJECT
from bus.server import NatsServer
from gyre.config import load_recipe
from gyre.env.harness import execution_key
from handlers.bench import hostile_inputs as inputs
from handlers.bench.proxy import machine
from schemas import ids

HOSTILE_EXECUTIONS = 16
GOOD_APIS = ("chat", "messages", "responses")
GOOD_TURNS = 2
"""Calls per good conversation: the toy recipe's `harness.max_calls`, which the proxy enforces."""


@dataclasses.dataclass(frozen=True, slots=True)
class BenchConfig:
    """requests: hostile requests; events: malformed events per consumed subject;
    concurrency: hostile requests in flight; steps: the run's own steps; seed: the inputs'
    Hypothesis seed; audit_timeout_s: seconds the audit waits for consumers to settle."""

    requests: int = 1000
    events: int = 200
    concurrency: int = 4
    steps: int = 2
    seed: int = 0
    audit_timeout_s: float = 240.0


def consumed(cells: int) -> dict[str, list[str]]:
    """Subject name → the durable consumers reading it, for a run with `cells` cells."""
    out: dict[str, list[str]] = collections.defaultdict(list)
    specs = list(subjects.CONSUMERS) + [subjects.cell_consumer(f"cell{i}") for i in range(cells)]
    for spec in specs:
        for name in spec.names:
            out[name].append(spec.durable)
    return dict(out)


class System:
    """A toy run's daemons on a private nats-server, started as `gyre run` starts them."""

    def __init__(self, workdir: Path, steps: int) -> None:
        from handlers.daemon import process_identity
        from handlers.run import Supervisor

        self.recipe = load_recipe("toy", {"run.steps": steps, "run.name": "hostile", "sampling.max_tokens": 8})
        self.run = f"hostile-{secrets.token_hex(3)}"
        self.run_dir = workdir / self.run
        (self.run_dir / "logs").mkdir(parents=True)
        for d in (workdir, self.run_dir):
            os.chmod(d, 0o711)  # the setuid fallback's uid traverses to its workspace
        self.secret = secrets.token_bytes(32)
        self.server = NatsServer.start(self.run_dir / "nats")
        private = {"key_secret": self.secret.hex(), "engine_token": secrets.token_hex(32),
                   "nats.json": orjson.dumps({"run": self.run, "url": self.server.url, "token": self.server.token,
                                              **process_identity()}).decode()}
        for name, text in private.items():
            path = self.run_dir / name
            path.write_text(text)
            os.chmod(path, 0o600)
        (self.run_dir / "config.json").write_bytes(orjson.dumps(self.recipe.to_dict()))
        self.env = dict(os.environ, GYRE_KEY_SECRET=private["key_secret"], GYRE_ENGINE_TOKEN=private["engine_token"],
                        GYRE_NATS_TOKEN=self.server.token, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                        HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONUNBUFFERED="1")
        self.supervisor = Supervisor(self.run_dir, self.env)

    def write_model(self) -> None:
        from gyre.serving.model import ModelSpec, init_model

        m = self.recipe.model
        init_model(self.run_dir / "model", ModelSpec(layers=m.layers, hidden=m.hidden, heads=m.heads,
                                                     kv_heads=m.kv_heads, head_dim=m.hidden // m.heads,
                                                     intermediate=3 * m.hidden, seed=m.seed))

    def start(self) -> None:
        from handlers.run import DAEMONS

        for name in DAEMONS:
            self.supervisor.start(name, f"handlers.{name}")
        for i in range(self.recipe.cells.count):
            self.supervisor.start(f"cell{i}", "handlers.cell", "--cell", f"cell{i}")
        self.supervisor.start("scheduler", "handlers.scheduler")

    async def proxy_url(self, timeout_s: float = 120.0) -> str:
        from handlers.proxy.http import url_in

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            url = url_in(self.run_dir / "proxy.json")
            if url:
                return url
            if self.supervisor.dead():
                raise RuntimeError(f"a daemon died at start: {self.supervisor.dead()}")
            await asyncio.sleep(0.2)
        raise RuntimeError("the proxy did not start")

    def handler_errors(self) -> int:
        n = 0
        for log_file in (self.run_dir / "logs").glob("*.log"):
            n += log_file.read_text(errors="replace").count('"bus.handler.failed"')
        return n

    def stop(self) -> None:
        self.supervisor.stop()
        self.server.stop()


@dataclasses.dataclass
class Tally:
    """What the bench saw; `figures` turns it into the keys."""

    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    by_kind: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(collections.Counter))
    good_answered: dict[str, int] = dataclasses.field(default_factory=dict)
    good_sent: int = 0
    good_failed: list[str] = dataclasses.field(default_factory=list)
    published: dict[str, dict[int, str]] = dataclasses.field(default_factory=lambda: collections.defaultdict(dict))
    crashed: dict[str, int] = dataclasses.field(default_factory=dict)


def _headers(h: inputs.Hostile, execution: str, secret: bytes) -> dict[str, str]:
    key = {"valid": execution_key(secret, execution), "none": "",
           "forged": f"gyre-{execution}-{'0' * 32}", "other": execution_key(b"another run's secret", execution)}[h.key]
    out = {"Content-Type": h.content_type}
    if key:
        out["x-api-key" if h.api == "messages" else "Authorization"] = key if h.api == "messages" else f"Bearer {key}"
    if h.encoding:
        out["Content-Encoding"] = h.encoding
    return out


async def _hostile(http: aiohttp.ClientSession, url: str, requests: list[inputs.Hostile], cfg: BenchConfig,
                   secret: bytes, tally: Tally) -> None:
    queue: asyncio.Queue = asyncio.Queue()
    for i, h in enumerate(requests):
        queue.put_nowait((i, h))

    async def worker() -> None:
        while not queue.empty():
            i, h = queue.get_nowait()
            execution = f"hostile-{i % HOSTILE_EXECUTIONS}"
            try:
                async with http.request(h.method, url + h.path, data=h.payload(),
                                        headers=_headers(h, execution, secret)) as resp:
                    await resp.read()
                    bucket = f"{resp.status // 100}xx"
            except (aiohttp.ClientError, asyncio.TimeoutError):
                bucket = "unanswered"
            tally.statuses[bucket] += 1
            tally.by_kind[h.kind][bucket] += 1

    await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))


async def _good_lane(http: aiohttp.ClientSession, url: str, api: str, secret: bytes, tally: Tally,
                     done: asyncio.Event) -> None:
    k = 0
    while not done.is_set():
        execution, history = f"good-{api}-{k}", inputs.first_turn(api, "List the files, then say done.")
        k += 1
        for turn in range(GOOD_TURNS):
            tally.good_sent += 1
            headers = _headers(inputs.Hostile("good", api, "POST", "", b""), execution, secret)
            try:
                async with http.post(url + inputs.API_PATHS[api], data=orjson.dumps(inputs.good_body(api, history)),
                                     headers=headers) as resp:
                    body = await resp.read()
                    answer = orjson.loads(body) if resp.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError) as exc:
                resp, answer, body = None, None, repr(exc).encode()
            if not isinstance(answer, dict) or answer.get("error") or answer.get("type") == "error":
                tally.good_failed.append(f"{execution}#{turn}: {getattr(resp, 'status', None)} {body[:200]!r}")
                break
            tally.good_answered[execution] = tally.good_answered.get(execution, 0) + 1
            history = [*history, *inputs.answer_turn(api, answer, "Go on.")]


async def _publish_events(bus: Bus, events: dict[str, list[bytes]], tally: Tally, spread_s: float) -> None:
    """Publish every payload raw on its subject, spread over about `spread_s` seconds."""
    flat = [(name, data) for name, payloads in events.items() for data in payloads]
    pause = spread_s / max(len(flat), 1)
    for i, (name, data) in enumerate(flat):
        ack = await bus.publish_raw(subjects.subject(bus.run, name), data)
        tally.published[name][ack.seq] = ack.stream
        if pause:
            await asyncio.sleep(pause)


async def _dead_letters(bus: Bus, names: list[str]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for name in names:
        stored = await bus.stored_ids(f"dlq.{name}") or {}
        out[name] = {int(h[DLQ_SEQ]) for h in stored.values()
                     if h.get(DLQ_SUBJECT) == subjects.subject(bus.run, name) and DLQ_SEQ in h}
    return out


async def _settled(bus: Bus, tally: Tally, readers: dict[str, list[str]], timeout_s: float) -> dict[str, set[int]]:
    """Wait until every bad event is dead-lettered and every consumer has settled all it
    holds (or `timeout_s`); returns the dead-lettered sequences per subject."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await _dead_letters(bus, list(tally.published))
        missing = sum(len(set(seqs) - found[name]) for name, seqs in tally.published.items())
        backlog = 0
        for durables in readers.values():
            for durable in durables:
                try:
                    backlog += await bus.consumer_backlog(durable)
                except KeyError:  # not made yet (a daemon that never started): nothing settled
                    backlog += 1
        if (missing == 0 and backlog == 0) or time.monotonic() > deadline:
            return found
        await asyncio.sleep(1.0)


async def _stored_good(bus: Bus, tally: Tally, timeout_s: float = 60.0) -> int:
    """Good calls answered whose `call.completed` is not stored within `timeout_s`."""
    want = {ids.call(bus.run, e, s) for e, n in tally.good_answered.items() for s in range(n)}
    deadline = time.monotonic() + timeout_s
    while True:
        stored = set(await bus.stored_ids(schemas.CallCompleted.NAME) or {})
        if want <= stored or time.monotonic() > deadline:
            return len(want - stored)
        await asyncio.sleep(1.0)


async def _watch(system: System, tally: Tally, stop: asyncio.Event) -> None:
    while not stop.is_set():
        for name, code in system.supervisor.dead():
            tally.crashed.setdefault(name, code)
        await asyncio.sleep(0.5)


async def _steps_completed(bus: Bus) -> int:
    return len(await bus.stored_ids(schemas.StepCompleted.NAME) or {})


async def bench(cfg: BenchConfig, workdir: Path, say=print) -> dict:
    t0 = time.monotonic()
    say(f"generating {cfg.requests} requests and {cfg.events} events per consumed subject (seed {cfg.seed})")
    requests = inputs.bad_requests(cfg.seed, cfg.requests)
    system = System(workdir, cfg.steps)
    readers = consumed(system.recipe.cells.count)
    events = {name: inputs.bad_events(name, cfg.seed + 1 + i, cfg.events) for i, name in enumerate(sorted(readers))}
    tally = Tally()
    stop = asyncio.Event()
    bus = await Bus.connect(system.server.url, token=system.server.token, run=system.run, name="bench-hostile")
    try:
        await bus.ensure_streams()
        early = {n: p for n, p in events.items() if n == schemas.MicrostepReady.NAME}
        await _publish_events(bus, early, tally, 0.0)  # read only while a cell trains: there before the first step
        await asyncio.to_thread(system.write_model)
        system.start()
        watcher = asyncio.create_task(_watch(system, tally, stop))
        url = await system.proxy_url()
        say(f"run {system.run} up (proxy {url}); sending")
        timeout = aiohttp.ClientTimeout(total=600, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as http:
            done = asyncio.Event()
            lanes = [asyncio.create_task(_good_lane(http, url, api, system.secret, tally, done)) for api in GOOD_APIS]
            later = {n: p for n, p in events.items() if n not in early}
            publisher = asyncio.create_task(_publish_events(bus, later, tally, 30.0))
            await _hostile(http, url, requests, cfg, system.secret, tally)
            await publisher
            done.set()
            await asyncio.gather(*lanes)
        say("audit: waiting for the consumers to settle and the good calls to be stored")
        found = await _settled(bus, tally, readers, cfg.audit_timeout_s)
        unstored = await _stored_good(bus, tally)
        steps = await _steps_completed(bus)
        stop.set()
        await watcher
        handler_errors = system.handler_errors()
    finally:
        stop.set()
        await bus.close()
        system.stop()
    return figures(cfg, tally, found, readers, unstored, steps, handler_errors, time.monotonic() - t0)


def figures(cfg: BenchConfig, tally: Tally, found: dict[str, set[int]], readers: dict[str, list[str]],
            unstored: int, steps: int, handler_errors: int, wall_s: float) -> dict:
    by_subject = {name: {"sent": len(seqs), "dead_lettered": len(set(seqs) & found.get(name, set())),
                         "consumers": readers[name]} for name, seqs in sorted(tally.published.items())}
    good_calls = tally.good_sent
    return {
        "requests": sum(tally.statuses.values()),
        "answered_2xx": tally.statuses["2xx"], "answered_4xx": tally.statuses["4xx"],
        "answered_5xx": tally.statuses["5xx"], "unanswered": tally.statuses["unanswered"],
        "by_kind": {k: dict(v) for k, v in sorted(tally.by_kind.items())},
        "events": sum(s["sent"] for s in by_subject.values()),
        "dead_lettered": sum(s["dead_lettered"] for s in by_subject.values()),
        "by_subject": by_subject,
        "crashes": len(tally.crashed), "crashed": tally.crashed, "handler_errors": handler_errors,
        "good_calls": good_calls, "good_calls_lost": len(tally.good_failed) + unstored,
        "good_calls_failed": tally.good_failed[:20], "good_calls_unstored": unstored,
        "steps_completed": steps, "steps": cfg.steps,
        "wall_s": round(wall_s, 1), "seed": cfg.seed, "config": dataclasses.asdict(cfg), "machine": machine(),
    }


def format_table(result: dict) -> str:
    ok = (result["answered_5xx"] == 0 and result["crashes"] == 0 and result["good_calls_lost"] == 0
          and result["dead_lettered"] == result["events"])
    lines = [f"{'requests':<18}{result['requests']:>8}   2xx {result['answered_2xx']}  4xx {result['answered_4xx']}  "
             f"5xx {result['answered_5xx']}  unanswered {result['unanswered']}",
             f"{'events':<18}{result['events']:>8}   dead-lettered {result['dead_lettered']}",
             f"{'good calls':<18}{result['good_calls']:>8}   lost {result['good_calls_lost']}",
             f"{'crashes':<18}{result['crashes']:>8}   handler errors {result['handler_errors']}; "
             f"run steps completed {result['steps_completed']}/{result['steps']}", ""]
    lines.append(f"{'kind':<24}{'2xx':>6}{'4xx':>6}{'5xx':>6}{'none':>6}")
    for kind, counts in result["by_kind"].items():
        lines.append(f"{kind:<24}" + "".join(f"{counts.get(b, 0):>6}" for b in ("2xx", "4xx", "5xx", "unanswered")))
    lines.append("")
    lines.append(f"{'subject':<24}{'sent':>6}{'dead-lettered':>15}  consumers")
    for name, s in result["by_subject"].items():
        lines.append(f"{name:<24}{s['sent']:>6}{s['dead_lettered']:>15}  {', '.join(s['consumers'])}")
    lines.append("")
    lines.append(f"targets (5xx 0, crashes 0, good calls lost 0, every bad event dead-lettered): "
                 f"{'met' if ok else 'MISSED'}; {result['wall_s']} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    d = BenchConfig()
    p = argparse.ArgumentParser(prog="gyre bench hostile", description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--events", type=int, default=d.events, help="malformed events per consumed subject")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--steps", type=int, default=d.steps, help="the toy run's own steps meanwhile")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--audit-timeout", type=float, default=d.audit_timeout_s)
    p.add_argument("--smoke", action="store_true", help="60 requests, 10 events a subject, 1 step (CI)")
    p.add_argument("--keep", action="store_true", help="keep the run directory (logs) afterwards")
    a = p.parse_args(argv)
    if min(a.requests, a.events, a.concurrency, a.steps) < 1:
        p.error("--requests, --events, --concurrency and --steps must be >= 1")
    try:
        import hypothesis  # noqa: F401 - the inputs' generator
    except ImportError:
        p.error("this bench generates its inputs with Hypothesis: pip install 'gyre[test]' (make install does)")
    import logging

    from handlers.daemon import configure_logging
    from transformers.utils import logging as hf_logging

    configure_logging("bench-hostile", level=logging.WARNING)
    hf_logging.disable_progress_bar()
    cfg = BenchConfig(requests=60 if a.smoke else a.requests, events=10 if a.smoke else a.events,
                      concurrency=a.concurrency, steps=1 if a.smoke else a.steps, seed=a.seed,
                      audit_timeout_s=a.audit_timeout)
    workdir = Path(tempfile.mkdtemp(prefix="gyre-bench-hostile-"))
    try:
        result = asyncio.run(bench(cfg, workdir, say=lambda m: print(f"bench hostile: {m}", file=sys.stderr)))
    finally:
        if a.keep:
            print(f"bench hostile: run directory kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(format_table(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
