"""Proxy daemon: the harness's model endpoint, with token-in/token-out capture. This module
holds its configuration (`Config`) and its wiring (`run`, `main`).

Contract (DESIGN.md "Processes", "Token-in, token-out"):
- Routes: OpenAI Chat Completions and Responses, Anthropic Messages and count_tokens,
  models, health (`handlers.proxy.app`). Any model name is accepted; unknown fields and
  `anthropic-beta` flags are ignored.
- Auth and errors: a per-execution key names the execution a call is recorded in; a
  refused call gets its API's own error shape (`handlers.proxy.call`), a 429 beyond the
  bounds on calls in flight (`handlers.proxy.state`).
- Routing: sticky per execution, to the rollout cells and routes replayed from the bus,
  else `Config.engine_url`; an engine that is unavailable, hung, failing or leaves
  rollout is replaced by another rollout cell, or waited for, within `retry_timeout_s`
  while the harness gets keep-alives (`handlers.proxy.routing.Dispatcher`).
- Recording: a call's `call.completed` is published in the background once its answer
  was delivered or it definitively failed; spilled to `Config.spill_file` when the bus
  does not take it, and published again later (`handlers.proxy.outbox`).
- Restarts: one proxy per run; a starting proxy publishes its predecessor's spilled calls,
  continues the run's seqs, and serves once its replay of the run's events has caught up
  (`handlers.proxy.restart`).
  After a kill -9 it recovers the same (nothing else lives only in its memory but the call
  stores: each execution's next call is a new root), and the calls it had answered whose
  `call.completed` JetStream had not acknowledged: each is written to the journal
  (`Config.journal`, `handlers.proxy.journal`) before its answer goes out, and the next
  proxy publishes the journal's unstored calls before it serves. Calls in flight at the
  kill are lost to their harness (its connection drops; the toy harness then fails, an
  SDK retries) and never recorded, but for one killed while its answer was going out,
  which is recorded `ok`. `tests/test_crash_proxy.py` kills it so; `gyre bench chaos`
  kills it among the other daemons.
- Stop: within `Config.shutdown_grace_s` the listener closes, calls in flight finish or
  are cancelled (recorded `aborted`), and publishes are acknowledged or spilled.

Known limits: Anthropic `thinking: disabled` does not switch the template's thinking off;
`tool_choice` and `parallel_tool_calls` are not acted on (the policy decides); a final
assistant message (a prefill) is rendered as a finished turn; a stop string completed by
the last token allowed is reported by SGLang as `length` (it checks the length first), so
the answer then keeps it.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import orjson
import structlog

from gyre.config import ProxySection
from gyre.serving.roles import PROFILES
from gyre.serving.tokenizer import fast_encoder
from handlers.engines.client import make_session
from handlers.proxy import restart
from handlers.proxy.app import start
from handlers.proxy.http import serving_proxy, url_in
from handlers.proxy.state import REPLAYED, ProxyState
from schemas.call import SamplingParams

__all__ = ["Config", "config_from_context", "run", "main"]

log = structlog.get_logger()

GC_THRESHOLDS = (50_000, 20, 100)
"""Cyclic-GC thresholds while serving (CPython's default is (700, 10, 10)): every request
allocates hundreds of containers that reference counting frees, and frequent young
collections would promote in-flight requests into the old generations and run full
collections (tens of ms with a few hundred executions' stores) every few seconds. With
the startup objects frozen (`gc.freeze`) and these values, young collections rarely
re-examine the calls in flight. Cyclic garbage (rare: exceptions on failure paths) waits
longer for its collection (a full collection after 100 middle ones)."""

CLOSE_RESERVE_S = 1.5
"""The end of `Config.shutdown_grace_s` kept, in seconds (at most a tenth of it), for
closing the replay, the HTTP session and the bus once the drain is over (a frozen
nats-server holds each close to its bound), and for the process's exit after `run`
returns (`main` skips the interpreter's teardown: milliseconds)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Config(ProxySection):
    """Proxy configuration: the recipe's `[proxy]` settings (limits and timeouts, defined,
    documented and validated in `gyre.config.ProxySection`) and the run's wiring below.
    Durations in seconds, sizes in bytes."""

    run: str
    """Run id (bus subjects, event ids)."""
    key_secret: bytes
    """HMAC secret of the per-execution keys (gyre.env.harness)."""
    host: str = "127.0.0.1"
    port: int = 0
    """Listening port; 0 = a free port (written to `url_file`)."""
    model_dir: str = ""
    """HF checkpoint whose tokenizer and chat template to use; '' = gyre's built-in Qwen3 tokenizer."""
    nats_url: str = ""
    """NATS server; '' = no bus (calls are not published; only for tests and single-process use)."""
    nats_token: str | None = None
    engine_url: str = ""
    """Engine used while no rollout cell is known ('' = none: wait for `cell.switched`)."""
    engine_token: str = dataclasses.field(default="", repr=False)
    """Bearer token sent to every engine (the run's engine token, SGLang's `--api-key`;
    `handlers.engines.embedded` demands it); '' = none."""
    static_cell: str = "static"
    """Cell name recorded for calls served by `engine_url`."""
    model_name: str = "gyre"
    """Model id listed by /v1/models (and echoed when a request names none)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """Default sampling when the request has none; top_k -1 = off."""
    seed: int | None = None
    """The run's seed: each call is sampled with `gyre.serving.seeds.call_seed(seed, execution,
    seq)`, so its tokens do not depend on arrival order; None = the engine draws seeds."""
    max_completion_tokens: int = 4096
    """Cap on a call's completion tokens, and the value when the request sets none."""
    max_calls: int = 0
    """Model calls one execution may start (count_tokens not counted); 0 = no cap."""
    context_tokens: int = 0
    """The policy's context window in tokens (prompt + completion). A prompt that leaves no
    room in it (`handlers.proxy.api.completion_room`, SGLang's count) is refused before it reaches
    an engine, with the API's own prompt-too-long error (`handlers.proxy.api.context_exceeded`:
    harnesses compact on it); otherwise the completion cap is at most the room left (SGLang
    refuses prompt + max_new_tokens beyond its context), and the call records that cap.
    0 = not known yet: the first engine refusal that names the context teaches it
    (`ProxyState.context_tokens`), and the refused call is retried with the cap when its
    prompt fits."""
    concurrency: int = 256
    """Engine requests in flight at once per engine; further calls to it queue."""
    harness: str = ""
    """Roles profile (gyre.serving.roles.PROFILES) for executions whose harness is not known from
    `execution.started`; '' = detect it from each call's headers."""
    retry_backoff_s: float = 0.25
    retry_backoff_max_s: float = 5.0
    object_threshold_bytes: int = 256 * 1024
    """Encoded call.completed above this moves its token arrays to the object store."""
    max_publishes_in_flight: int = 512
    """`call.completed` publishes awaiting their PubAck at once; later ones wait their turn
    in the background (never dropped; each is still acknowledged)."""
    check_drift: bool = True
    """Count drift on extensions (`gyre.serving.tito.CallStore`: one turn re-tokenised with gyre's
    template, the whole rendered request with another); False reports drift 0."""
    url_file: str = ""
    """If set, `{"url": ...}` is written there once the listener is bound."""
    spill_file: str = ""
    """Where a `call.completed` goes when it cannot be published: no PubAck within
    `retry_timeout_s` (the bus is down), or still unacknowledged once `shutdown_grace_s` is
    over (JSON lines: the event, its token arrays' JSON). The next proxy started with the
    same file publishes what it holds before it serves, then removes it (`handlers.proxy.outbox.Outbox.republish`).
    '' = such a call is lost (logged as an error). A run's proxy uses
    `<run_dir>/proxy-unpublished.jsonl`."""
    journal: str = ""
    """Prefix of the call journal's segment files (`handlers.proxy.journal`): each call's
    `call.completed` is written there before its answer goes out and leaves once
    JetStream acknowledged it (or it was spilled); the next proxy started with the same
    prefix publishes what is left before it serves (a proxy killed with unacknowledged
    calls). '' = no journal: a kill loses the calls not yet acknowledged. A run's proxy
    uses `<run_dir>/proxy-journal`."""
    shutdown_grace_s: float = 20.0
    """The whole stop, in seconds: calls in flight get until `stop_reserve_s()` before its
    end, then are cancelled (each published as `aborted`, its engine request aborted);
    publishes get the rest but `close_reserve_s()`; what is then still unacknowledged is
    spilled. Keep it below what a supervisor waits before SIGKILL (`gyre run`: 30 s;
    Kubernetes: 30 s by default): a call killed unspilled is lost."""
    tune_gc: bool = True
    """While serving: freeze the objects alive at startup (tokenizer, modules) out of the
    cyclic GC and collect less often (`GC_THRESHOLDS`); restored when `run` returns."""

    def __post_init__(self) -> None:
        ProxySection.__post_init__(self)  # (no zero-argument super() in a slotted dataclass before Python 3.14)
        if not self.run:
            raise ValueError("Config.run must be non-empty")
        if not self.key_secret:
            raise ValueError("Config.key_secret must be non-empty (execution keys are HMACs of it)")
        if self.host not in ("127.0.0.1", "::1", "localhost"):
            raise ValueError(f"Config.host must be a loopback address, got {self.host!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"Config.port must be in [0, 65535], got {self.port}")
        if self.temperature < 0:
            raise ValueError(f"Config.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Config.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"Config.top_k must be -1 (off) or > 0, got {self.top_k}")
        for name in ("max_completion_tokens", "concurrency", "object_threshold_bytes", "max_publishes_in_flight"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Config.{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_calls", "context_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"Config.{name} must be >= 0 (0 = no cap), got {getattr(self, name)}")
        if self.harness and self.harness not in PROFILES:
            raise ValueError(f"Config.harness must be '' or one of {PROFILES}, got {self.harness!r}")
        for name in ("retry_backoff_s", "retry_backoff_max_s", "shutdown_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Config.{name} must be > 0 seconds, got {getattr(self, name)}")

    def close_reserve_s(self) -> float:
        """The end of `shutdown_grace_s` kept for closing once publishes are over (`CLOSE_RESERVE_S`)."""
        return min(CLOSE_RESERVE_S, self.shutdown_grace_s / 10)

    def stop_reserve_s(self) -> float:
        """The end of `shutdown_grace_s` kept for publishes and closing once calls are
        cancelled: min(5 s, a quarter) for publishes, then `close_reserve_s`."""
        return min(5.0, self.shutdown_grace_s / 4) + self.close_reserve_s()

    def sampling_defaults(self) -> SamplingParams:
        """Sampling when a request sets none; max_tokens is the completion cap."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=self.max_completion_tokens)


def load_tokenizer(model_dir: str) -> Any:
    """The tokenizer and chat template of the checkpoint in `model_dir`; gyre's built-in
    Qwen3 tokenizer when it is ''."""
    if model_dir:
        from gyre.serving.model import load_tokenizer as from_checkpoint

        return from_checkpoint(model_dir)
    from gyre.serving.tokenizer import build_tokenizer

    return build_tokenizer()


async def run(cfg: Config, stop: asyncio.Event,
              on_started: Callable[[ProxyState, str], None] | None = None) -> None:
    """Serve until `stop`; then finish in-flight calls and publishes within shutdown_grace_s.

    Start: bus (none without `nats_url`), the one-proxy-per-run checks and run lock, the
    predecessor's spilled calls and the run's seqs, the replay caught up, then the
    listener. Stop, under one budget: listener, calls, publishes and spill, replay, HTTP
    session, bus, run lock. The daemon template (`handlers.daemon.connected`, `run_loops`)
    does not fit: the bus is optional here, its close must fit in what the drain leaves of
    `shutdown_grace_s` (the template's close has its own, longer bound), and the stop goes
    in that order rather than by cancelling loops.

    on_started(state, url) is called once the listener is bound (embedding and tests)."""
    from bus import Bus

    tokenizer = load_tokenizer(cfg.model_dir)
    fast_encoder(tokenizer)  # build tiktoken's tables now, not on the first call
    bus = None
    if cfg.nats_url:
        bus = await Bus.connect(cfg.nats_url, token=cfg.nats_token, run=cfg.run, name="proxy", stop=stop)
    session = runner = replay = state = resend = lock = None
    thresholds = gc.get_threshold()
    tuned = False
    try:
        if bus is not None:
            await bus.ensure_streams()
        session = make_session()
        earlier_url = url_in(Path(cfg.url_file)) if cfg.url_file else ""
        if earlier_url and (other := await serving_proxy(session, earlier_url, cfg.run)):
            from handlers.daemon import FatalError

            raise FatalError(f"a proxy of run {cfg.run} already serves at {other} ({cfg.url_file}); one proxy "
                             "per run: start this one once that one has exited")
        if cfg.url_file:
            Path(cfg.url_file).parent.mkdir(parents=True, exist_ok=True)  # a proxy may start before the runner
            lock = restart.run_lock(Path(cfg.url_file).with_suffix(".lock"), cfg.run)
        state = ProxyState(cfg, tokenizer, session, bus)
        # Before serving: what an earlier proxy could not publish goes out, and a restarted
        # proxy goes on after its predecessor's seqs (those included).
        if bus is not None and not await restart.resume(state, bus, stop):
            return
        if bus is not None:
            # The run's routes, cells and finished executions are known before the first call:
            # a finished execution's key must not be served while the replay catches up.
            caught_up = asyncio.Event()
            replay = asyncio.create_task(bus.replay(REPLAYED, state.handle_event, stop=stop, caught_up=caught_up))
            if not await restart.wait_for_replay(caught_up, replay, stop):
                return
            resend = asyncio.create_task(restart.resend_spilled(state, stop))
        runner, url = await start(state, reuse_port_of=earlier_url)
        if cfg.tune_gc:
            gc.collect()
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLDS)
            tuned = True
        if cfg.url_file:
            path = Path(cfg.url_file)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(orjson.dumps({"url": url, "v1": url + "/v1"}))
            tmp.replace(path)
        log.info("proxy.started", url=url, engine_url=cfg.engine_url or None, bus=bool(bus))
        if on_started is not None:
            on_started(state, url)
        await stop.wait()
    finally:
        # One budget for the whole stop (Config.shutdown_grace_s): calls, then publishes and spills.
        end = time.monotonic() + cfg.shutdown_grace_s
        if resend is not None:
            resend.cancel()
        if state is not None:
            state.engines.stop()
        if runner is not None:
            for site in list(runner.sites):
                await site.stop()  # no new connections
            if runner.server is not None:
                runner.server.pre_shutdown()  # nor requests: idle keep-alive connections close
            if state is not None:
                await state.finish_calls(end - cfg.stop_reserve_s() - time.monotonic())
            await runner.shutdown()
            await runner.cleanup()
        if state is not None:
            await state.drain(end - cfg.close_reserve_s() - time.monotonic())
            state.close()
        if replay is not None:
            if not stop.is_set():
                replay.cancel()  # a start that failed: nothing else ends it
            await asyncio.wait({replay}, timeout=max(end - time.monotonic(), 0.05))
            if replay.done() and not replay.cancelled() and replay.exception() is not None:
                log.info("proxy.replay.stopped", error=repr(replay.exception()))
        if session is not None:
            await session.close()
        if bus is not None:
            await bus.close(timeout_s=max(end - time.monotonic(), 0.2))
        if tuned:
            gc.set_threshold(*thresholds)
            gc.unfreeze()
        if lock is not None:
            lock.close()  # after the drain and its spill: the next proxy republishes them
        log.info("proxy.stopped")


def config_from_context(ctx: Any, args: Any) -> Config:
    """The proxy of a run: the recipe's sampling, `harness.max_calls` and `[proxy]` table
    (limits and timeouts, `gyre.config.ProxySection`). Its context window is the recipe's `engine.max_context_tokens`
    when the run's cells serve it; an engine given by `--engine-url` says its own."""
    r = ctx.recipe
    return Config(run=ctx.run, key_secret=ctx.key_secret, port=args.port, model_dir=str(ctx.checkpoint()),
                  nats_url=ctx.nats_url, nats_token=ctx.nats_token, engine_url=args.engine_url or "",
                  engine_token=ctx.engine_token,
                  temperature=r.sampling.temperature, top_p=r.sampling.top_p, top_k=r.sampling.top_k,
                  seed=r.run.seed, max_completion_tokens=r.sampling.max_tokens, max_calls=r.harness.max_calls,
                  context_tokens=0 if args.engine_url else r.engine.max_context_tokens,
                  url_file=str(ctx.run_dir / "proxy.json"), spill_file=str(ctx.run_dir / "proxy-unpublished.jsonl"),
                  journal=str(ctx.run_dir / "proxy-journal"),
                  **dataclasses.asdict(r.proxy))


def main(argv: list[str] | None = None) -> NoReturn:
    """The proxy process's entry point (`gyre proxy`): serves until stopped, then ends the
    process with the daemon's exit status, without the interpreter's teardown. That
    teardown frees every execution's call store object by object (seconds with many),
    time `shutdown_grace_s` has no room for, and nothing is
    left to do by then: the spill file is synced, the bus and the listener are closed."""
    from handlers.daemon import daemon_main

    def extra(p: Any) -> None:
        p.add_argument("--port", type=int, default=0, help="listening port on 127.0.0.1 (0 = free port)")
        p.add_argument("--engine-url", default="", help="engine used while no rollout cell is known")

    status = daemon_main("proxy", "model endpoint for agent harnesses (OpenAI Chat and Responses, Anthropic "
                                  "Messages) with token-in/token-out capture", config_from_context, run, argv,
                         extra_args=extra)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # (a closed pipe: nothing more can be said)
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
