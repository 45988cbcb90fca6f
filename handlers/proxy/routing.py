"""Routing of the proxy's calls to engines: rollout cells, scheduler routes, stickiness,
eviction of in-flight requests whose cell leaves rollout, and the dispatch of a call's
generation with its retries (`Dispatcher`).

Contract: `Router.pick(execution, avoid)` → (cell, engine URL) or None; the scheduler's
route wins, then the sticky cell, then the least-loaded rollout cell (cells in `avoid`
only when nothing else is left), then the static engine. `handle_cell_switched` removes a
cell that leaves rollout (or changes URL) and sets `evicted` on every `Attempt` tracked
there, so the caller cancels it, aborts it upstream and retries elsewhere.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import operator
import re
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import orjson
import structlog

from gyre.serving.seeds import call_seed
from handlers.engines.client import EngineClient, EngineRequestError, EngineUnavailable
from handlers.proxy.api import ApiError, context_exceeded, unique_hex
from schemas.call import SamplingParams
from schemas.cell import CellSwitched, RouteUpdated

log = structlog.get_logger()

MAX_ENGINE_ABORTS = 16
"""Engine-side aborts of one call retried before the call fails (a cell switch aborts once)."""
MAX_ENGINE_TIMEOUTS = 2
"""Attempts of one call past `generate_bound_s` retried (each with a fresh `retry_timeout_s`
to find an engine) before the call fails."""
MAX_ENGINE_ERRORS = 2
"""Server errors (HTTP 5xx other than 503) of one call retried, on another rollout cell
when there is one, before the call fails with 502: a crashed scheduler or a gateway in
front of a dead worker (SGLang's router answers 502/504) heals elsewhere, and a request
that fails every engine the same way is not sent a dozen times."""


@dataclasses.dataclass(slots=True, eq=False)
class Attempt:
    """The engine request in flight for a call (for aborting it upstream). `evicted` turns
    True, and `task` (the call's task, while `race` awaits the request) is cancelled, when
    its cell leaves rollout while the request runs."""

    client: EngineClient | None = None
    rid: str = ""
    cell: str = ""
    evicted: bool = False
    task: asyncio.Task | None = None
    cancel_owed: bool = False
    """The router cancelled `task` for this eviction and `race` has not taken it back yet."""


class Router:
    """Which engine serves an execution: rollout cells, scheduler routes, stickiness.

    cells: rollout cell → engine URL. routes: execution → cell from `route.updated`.
    sticky: execution → cell it was last sent to. inflight: cell → engine requests running
    there (evicted when the cell leaves rollout or moves). Waiters are woken on every change.
    """

    def __init__(self, static_url: str = "", static_cell: str = "static"):
        self.static_url = static_url
        self.static_cell = static_cell
        self.cells: dict[str, str] = {}
        self.routes: dict[str, str] = {}
        self.sticky: dict[str, str] = {}
        self._load: collections.Counter[str] = collections.Counter()
        """cell → executions sticky to it (`load`), kept with `sticky`: counting them on
        every pick took 6 ms of the event loop at 20,000 live executions on 16 cells."""
        self.inflight: dict[str, set[Attempt]] = {}
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def wake(self) -> None:
        """Wake every call waiting for a change (`wait_changed`) without one."""
        self._notify()

    def _evict(self, cell: str) -> None:
        for attempt in self.inflight.pop(cell, ()):
            attempt.evicted = True
            if attempt.task is not None and not attempt.cancel_owed:
                attempt.cancel_owed = True
                attempt.task.cancel()

    def handle_cell_switched(self, event: CellSwitched) -> None:
        old = self.cells.get(event.cell)
        if event.to_role == "rollout" and event.engine_url:
            self.cells[event.cell] = event.engine_url
            if old is not None and old != event.engine_url:
                self._evict(event.cell)
        else:
            self.cells.pop(event.cell, None)
            self._evict(event.cell)
        self._notify()

    def handle_route_updated(self, event: RouteUpdated) -> None:
        for route in event.routes:
            self.routes[route.execution] = route.cell
        self._notify()

    def track(self, attempt: Attempt) -> None:
        self.inflight.setdefault(attempt.cell, set()).add(attempt)

    def untrack(self, attempt: Attempt) -> None:
        running = self.inflight.get(attempt.cell)
        if running is not None:
            running.discard(attempt)
            if not running:
                del self.inflight[attempt.cell]

    def load(self, cell: str) -> int:
        """Executions sticky to `cell`."""
        return self._load[cell]

    def _stick(self, execution: str, cell: str) -> None:
        old = self.sticky.get(execution)
        if old == cell:
            return
        if old is not None:
            self._load[old] -= 1
        self.sticky[execution] = cell
        self._load[cell] += 1

    def forget(self, execution: str) -> None:
        """Drop a finished execution's sticky cell and route."""
        old = self.sticky.pop(execution, None)
        if old is not None:
            self._load[old] -= 1
            if not self._load[old]:
                del self._load[old]
        self.routes.pop(execution, None)

    def pick(self, execution: str, avoid: frozenset[str] = frozenset()) -> tuple[str, str] | None:
        """(cell, engine URL) for `execution`, or None when no engine is known.

        Order: the scheduler's route, the sticky cell, the least-loaded rollout cell (cells
        in `avoid` only when nothing else is left), then the static engine.
        """
        if self.cells:
            usable = [c for c in self.cells if c not in avoid] or list(self.cells)
            choice = None
            for preferred in (self.routes.get(execution), self.sticky.get(execution)):
                if preferred in usable:
                    choice = preferred
                    break
            if choice is None:
                choice = min(usable, key=lambda c: (self.load(c), c))
            self._stick(execution, choice)
            return choice, self.cells[choice]
        if self.static_url:
            return self.static_cell, self.static_url
        return None

    async def wait_changed(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass


async def race(coro: Coroutine[Any, Any, Any], attempt: Attempt) -> Any:
    """The result of `coro`, awaited in the calling task, or None when the router evicts
    `attempt` first: the router cancels the calling task (`Attempt.cancel_owed`) and `race`
    takes that one cancellation back (`Task.uncancel`, as `asyncio.timeout` does) on every
    way out, so `coro` is cancelled and the caller goes on. Any other cancellation (the
    harness went away) propagates, also when it coincides with an eviction. No task of its
    own: a call's engine request costs no extra task and event-loop round."""
    if attempt.evicted:
        coro.close()
        return None
    task = attempt.task = asyncio.current_task()
    base = task.cancelling()
    try:
        return await coro
    except asyncio.CancelledError:
        if _take_back(task, attempt) and task.cancelling() == base:
            return None  # only the router's cancellation
        raise
    finally:
        attempt.task = None
        _take_back(task, attempt)  # `coro` absorbed it, or turned it into another error


def _take_back(task: asyncio.Task, attempt: Attempt) -> bool:
    if not attempt.cancel_owed:
        return False
    attempt.cancel_owed = False
    task.uncancel()
    return True


_CONTEXT_NAMED = (  # (pattern, what to add to its number to get the context length)
    (re.compile(r"max_context_tokens is (\d+)"), 0),  # gyre's engine
    (re.compile(r"context length \((\d+) tokens\)"), 0),  # SGLang's tokenizer manager: the input alone
    (re.compile(r"maximum context length of (\d+) tokens"), 0),  # SGLang: input + max_new_tokens
    (re.compile(r"maximum allowed length \((\d+) tokens\)"), 6),  # SGLang's scheduler: max_req_input_len
)
_TOO_LONG = ("longer than the model's context length", "exceeds the model's maximum context length",
             "exceeds the maximum allowed length")


def prompt_too_long(exc: EngineRequestError) -> tuple[int | None, str] | None:
    """(the engine's context length if it says, its message) when `exc` refuses a prompt
    its context cannot hold (`too_long_text`); None for other refusals and server errors."""
    if not 400 <= exc.status < 500:
        return None
    body = exc.body
    error = body.get("error", body) if isinstance(body, dict) else body
    kind = error.get("type") if isinstance(error, dict) else None
    text = str(error.get("message", "")) if isinstance(error, dict) else str(error)
    return too_long_text(text, kind == "PromptTooLong")


def too_long_text(text: str, known: bool = False) -> tuple[int | None, str] | None:
    """(the context length `text` names, `text`) when it says a prompt does not fit (or
    `known`): gyre's engine ("prompt has N tokens, max_context_tokens is C"), SGLang's
    tokenizer manager ("The input (N tokens) is longer than the model's context length (C
    tokens).", "Requested token count exceeds the model's maximum context length of C tokens.
    …") and scheduler ("Input length (N tokens) exceeds the maximum allowed length (C − 6
    tokens). …", a 400 or an `abort` finish depending on the version); else None."""
    if not known and not any(phrase in text for phrase in _TOO_LONG):
        return None
    for pattern, add in _CONTEXT_NAMED:
        found = pattern.search(text)
        if found:
            return int(found.group(1)) + add, text
    return None, text


def _aborted_too_long(body: Any) -> tuple[int | None, str] | None:
    """`too_long_text` of an `abort` finish's message in a `/generate` reply, else None."""
    meta = body.get("meta_info") if isinstance(body, dict) else None
    reason = meta.get("finish_reason") if isinstance(meta, dict) else None
    if not isinstance(reason, dict) or reason.get("type") != "abort":
        return None
    return too_long_text(str(reason.get("message") or ""))


GENERATE_GRACE_S = 600.0
MIN_DECODE_TOKENS_PER_S = 5.0


def generate_bound_s(sp: SamplingParams) -> float:
    """Seconds one `/generate` attempt may take before its engine counts as hung and the
    call is retried elsewhere: GENERATE_GRACE_S (queueing, prefill) + max_tokens at
    MIN_DECODE_TOKENS_PER_S (1,024 tokens: ≈ 14 min; 32,768: ≈ 2 h)."""
    return GENERATE_GRACE_S + min(sp.max_tokens, 2**31) / MIN_DECODE_TOKENS_PER_S


def engine_sampling(sp: SamplingParams, seed: int | None = None) -> dict:
    """SGLang `sampling_params` for recorded SamplingParams; seed: the call's sampling seed
    (`gyre.serving.seeds.call_seed`), None = the engine draws one."""
    out = {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "max_new_tokens": sp.max_tokens}
    if sp.stop:
        out["stop"] = list(sp.stop)
    if seed is not None:
        out["seed"] = seed
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class EngineResult:
    """One answered generation. output_ids/logprobs: (C,) sampled ids (stop token
    included) and their behaviour log-probs. finish: `stop` | `length`. versions: policy
    version spans over the completion. queue_s: seconds from the call's start to the
    successful attempt's request (waiting, retries, the concurrency limit); engine_s:
    seconds of that attempt. stop_string: the stop string the engine says ended the
    completion (SGLang's `finish_reason.matched` when it is a string), else None."""

    output_ids: list[int]
    logprobs: list[float]
    finish: str
    versions: tuple[tuple[int, int, int], ...]
    cell: str
    queue_s: float
    engine_s: float
    stop_string: str | None = None


FINISH_TYPES = ("stop", "length", "abort")
"""SGLang's finish_reason types."""

_LIST, _INT, _NUMBER = {list}, {int}, {int, float}
_first = operator.itemgetter(0)


def _bad_reply(what: str) -> ApiError:
    return ApiError(502, f"the engine's /generate reply is malformed: {what}", "server_error", code="engine_bad_reply")


def _version(value: Any) -> int:
    """A policy version from `meta_info.weight_version`: an int, a decimal string (what
    gyre sets on SGLang), or SGLang's initial "default" (the starting policy, version 0).
    Raises ApiError(502) otherwise."""
    if value is None or value == "default":
        return 0
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if type(value) is int and 0 <= value < 2**31:
        return value
    raise _bad_reply(f"weight_version {str(value)[:40]!r} is not a policy version")


def engine_reply(body: Any, vocab_size: int = 2**31) -> EngineResult:
    """The generation in an engine's `/generate` reply (SGLang's native format; `cell` and
    the timings left empty for the caller): `output_ids` (C,) token ids (when absent, as
    from SGLang versions that send them only with `--return-token-ids`, the ids in the
    log-prob entries), `meta_info` with `output_token_logprobs` (C entries
    [log-prob (nats), token id, ...]),
    `finish_reason` ({"type": "stop"|"length"|"abort", "matched": ...} or null = stop) and
    the policy version (`gyre_versions` spans, else `weight_version`).

    An `abort` reply is returned without ids (it is no sample; the caller retries).
    Otherwise raises ApiError(502, code "engine_bad_reply") when any of these is missing
    or of the wrong type or out of range (ids lie in [0, vocab_size), the policy's
    vocabulary: an id beyond it would be sent back in the next prompt, which the engine
    refuses; versions are int32 downstream; a log-prob must be finite and ≤ 0: SGLang
    writes NaN and ±inf as null), or the counts differ: such a reply is not a sample of
    the policy."""
    if not isinstance(body, dict):
        raise _bad_reply(f"a JSON object was expected, got {str(body)[:80]!r}")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise _bad_reply("no meta_info object")
    reason = meta.get("finish_reason")
    if reason is None:
        reason = {}
    finish = (reason.get("type") or "stop") if isinstance(reason, dict) else None
    if finish not in FINISH_TYPES:
        raise _bad_reply(f"finish_reason {str(reason)[:80]!r}")
    if finish == "abort":  # no sample: the caller retries (SGLang may send no ids or log-probs)
        return EngineResult(output_ids=[], logprobs=[], finish=finish, versions=(), cell="", queue_s=0.0,
                            engine_s=0.0)
    # The checks below loop in C (set(map(type, ...)), min, max, sum): they run on every call.
    lps = meta.get("output_token_logprobs")
    if type(lps) is not list or (lps and (set(map(type, lps)) != _LIST or not all(lps))):
        raise _bad_reply("output_token_logprobs is not a list of [log-prob, token id, ...]")
    logprobs = list(map(_first, lps))
    # Numbers, none above 0 (1e-3 of rounding allowed), none null (SGLang's NaN / ±inf) or
    # non-finite: a non-finite one makes the sum non-finite.
    if logprobs and not (set(map(type, logprobs)) <= _NUMBER and max(logprobs) <= 1e-3
                         and math.isfinite(sum(logprobs))):
        raise _bad_reply("output_token_logprobs holds a log-prob that is null, not finite or above 0")
    ids = body.get("output_ids")
    if ids is None:  # SGLang versions that return token ids only with --return-token-ids
        ids = [x[1] if len(x) > 1 else None for x in lps]
    if type(ids) is not list or (ids and (set(map(type, ids)) != _INT or min(ids) < 0 or max(ids) >= vocab_size)):
        raise _bad_reply(f"output_ids is not a list of token ids in [0, {vocab_size})")
    if len(lps) != len(ids):
        raise _bad_reply(f"{len(ids)} ids but {len(lps)} log-probs")
    spans = meta.get("gyre_versions")
    if spans:
        if not isinstance(spans, list) or not all(
                isinstance(sp, list) and len(sp) == 3 and all(type(v) is int for v in sp) for sp in spans):
            raise _bad_reply("gyre_versions is not a list of [start, end, version]")
        versions = tuple((s, e, v) for s, e, v in spans)
        ends = [0] + [e for _, e, _ in versions]
        if any(s != ends[k] or e <= s or not 0 <= v < 2**31 for k, (s, e, v) in enumerate(versions)) \
                or ends[-1] != len(ids):
            raise _bad_reply(f"gyre_versions {str(spans)[:80]} do not cover the {len(ids)} ids in order")
    else:
        versions = ((0, len(ids), _version(meta.get("weight_version"))),) if ids else ()
    matched = reason.get("matched")
    return EngineResult(output_ids=ids, logprobs=list(map(float, logprobs)), finish=finish, versions=versions,
                        cell="", queue_s=0.0, engine_s=0.0,
                        stop_string=matched if finish == "stop" and isinstance(matched, str) else None)


class Dispatcher:
    """Runs calls' generations on the engines the router picks.

    At most `concurrency` requests in flight per engine (the rest wait their turn; a hung
    engine does not hold up the others). When the engine answers 503, 429 or 408 /
    refuses the connection / drops it (`EngineUnavailable`), answers another 5xx (up to
    MAX_ENGINE_ERRORS times), ends a generation with `abort` (up to MAX_ENGINE_ABORTS
    times), or its cell leaves rollout while the request runs (the request is then aborted
    upstream with `/abort_request`),
    the call goes to another rollout cell at once, or to the same engine after a backoff
    (`retry_backoff_s` doubling to `retry_backoff_max_s`), or waits for a cell, for up to
    `retry_timeout_s` seconds. session: the process's engine `aiohttp.ClientSession`.
    engine_token: the bearer token sent to every engine ('' = none); an engine that
    refuses it (401, 403) fails the call with a 502 `engine_unauthorized`.
    seed: the run's seed; a call `<execution>:<seq>` is sampled with
    `gyre.serving.seeds.call_seed(seed, execution, seq)` on every attempt (None: no seed sent).
    spawn: runs a background coroutine (the upstream aborts) the caller drains at shutdown.
    """

    def __init__(self, router: Router, session: Any, *, concurrency: int, retry_timeout_s: float,
                 retry_backoff_s: float, retry_backoff_max_s: float, spawn: Callable[[Awaitable[Any]], None],
                 vocab_size: int = 2**31, engine_token: str = "", seed: int | None = None):
        self.router = router
        self.seed = seed
        """The run's seed: each call is sampled with `call_seed(seed, execution, seq)`; None =
        the engine draws the seeds (then samples depend on arrival order)."""
        self.engine_token = engine_token
        self.vocab_size = vocab_size
        self.session = session
        self.retry_timeout_s = retry_timeout_s
        self.retry_backoff_s = retry_backoff_s
        self.retry_backoff_max_s = retry_backoff_max_s
        self.spawn = spawn
        self.concurrency = concurrency
        self._clients: dict[str, tuple[EngineClient, asyncio.Semaphore]] = {}
        self.stopping = False
        """Set by `stop`: a call that would wait or retry fails instead."""

    def stop(self) -> None:
        """The proxy is stopping: calls waiting for a rollout cell, or about to retry after
        a failed attempt, fail now (503 `proxy_stopping`: when a run ends its cells go too,
        and such calls would hold the shutdown for its whole grace); requests already at an
        engine run on."""
        self.stopping = True
        self.router.wake()

    def close(self) -> None:
        """Drop the engines' idle `/generate` connections (after the calls ended)."""
        for client, _ in self._clients.values():
            client.close()

    def _engine(self, url: str) -> tuple[EngineClient, asyncio.Semaphore]:
        c = self._clients.get(url)
        if c is None:
            client = EngineClient(url, self.session, self.engine_token)
            c = self._clients[url] = (client, asyncio.Semaphore(self.concurrency))
        return c

    async def abort_upstream(self, client: EngineClient, rid: str) -> None:
        try:
            await client.abort(rid)
        except Exception as exc:  # noqa: BLE001 - the engine may be gone; nothing else to do
            log.info("proxy.engine.abort_failed", rid=rid, error=repr(exc))

    async def _avoid(self, avoid: set[str], cell: str, backoff: float, remaining: float) -> float:
        """Steer the retry away from `cell`: another rollout cell is tried at once, also one
        that enters rollout during the wait; the same engine only after `backoff` seconds
        (capped by `remaining`; a stop ends the wait). Returns the next backoff."""
        avoid.add(cell)
        end = time.monotonic() + min(backoff, max(remaining, 0.0))
        while not any(c not in avoid for c in self.router.cells):
            left = end - time.monotonic()
            if left <= 0 or self.stopping:
                return min(backoff * 2, self.retry_backoff_max_s)
            await self.router.wait_changed(left)
        return backoff

    async def generate(self, execution: str, prompt_ids: Any, sampling: SamplingParams, call_id: str,
                       attempt: Attempt, prompt_tokens: int | None = None) -> EngineResult:
        """Run the call on an engine, waiting and retrying transparently (class docstring).
        prompt_ids: (P,) int32, or their JSON array as an `orjson.Fragment` (then
        `prompt_tokens` = P, for error messages). attempt: filled with the request in flight
        (for an abort upstream if the caller is cancelled).

        Raises ApiError(503) when no engine answered within retry_timeout_s (time spent waiting
        for one: an attempt that generated and was lost adds its time back) or none is left
        once the proxy stops (`stop`), ApiError(400) when the engine refused the request (a
        4xx: `handlers.proxy.api.context_exceeded` when it refused a prompt its context cannot hold),
        ApiError(502) when it failed it MAX_ENGINE_ERRORS + 1 times (a 5xx other than 503).
        """
        if prompt_tokens is None and not isinstance(prompt_ids, orjson.Fragment):
            prompt_tokens = len(prompt_ids)
        t0 = time.monotonic()
        deadline = t0 + self.retry_timeout_s
        backoff = self.retry_backoff_s
        avoid: set[str] = set()
        tries = aborts = timeouts = errors = 0
        ctx = {"execution": execution, "call": call_id}  # log context
        params = engine_sampling(sampling, None if self.seed is None else
                                 call_seed(self.seed, execution, int(call_id.rpartition(":")[2])))
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ApiError(503, f"no engine served the call within {self.retry_timeout_s:.0f}s", "server_error",
                               code="engine_unavailable")
            target = None if self.stopping and tries else self.router.pick(execution, frozenset(avoid))
            if target is None:
                if self.stopping:
                    raise ApiError(503, "the proxy is stopping and no engine is left to serve this call",
                                   "server_error", code="proxy_stopping")
                await self.router.wait_changed(min(backoff, remaining))
                backoff = min(backoff * 2, self.retry_backoff_max_s)
                continue
            cell, url = target
            client, slots = self._engine(url)
            rid = f"{call_id}:{tries}:{unique_hex()}"
            tries += 1
            attempt.client, attempt.rid, attempt.cell, attempt.evicted = client, rid, cell, False
            self.router.track(attempt)
            bound = generate_bound_s(sampling)
            try:
                async with slots:  # a full engine queues the call (its requests end within `bound`)
                    t_engine = time.monotonic()
                    result = await race(client.generate(prompt_ids, params, rid,
                                                         execution=execution, timeout_s=bound), attempt)
            except EngineUnavailable as exc:
                attempt.client = None
                log.info("proxy.engine.unavailable", **ctx, cell=cell, error=str(exc)[:200], retry_in_s=backoff)
                # The attempt's bound ran out (not a connect timeout): it may still be generating.
                if isinstance(exc.__cause__, asyncio.TimeoutError) and time.monotonic() - t_engine >= 0.99 * bound:
                    self.spawn(self.abort_upstream(client, rid))
                    timeouts += 1
                    if timeouts > MAX_ENGINE_TIMEOUTS:
                        raise ApiError(503, "the engines timed out on this call repeatedly", "server_error",
                                       code="engine_unavailable") from exc
                    # The attempt ran out its bound, not the wait for an engine: wait afresh.
                    deadline = max(deadline, time.monotonic() + self.retry_timeout_s)
                elif exc.status != 408 and exc.sent:  # dropped, or a 503 mid-request: it may have generated
                    deadline += time.monotonic() - t_engine  # the window counts waiting, not generating
                # A 408 is a gateway's queue timeout, a failed connect never reached an engine:
                # that time was waiting for one, and counts.
                backoff = await self._avoid(avoid, cell, backoff, deadline - time.monotonic())
                continue
            except EngineRequestError as exc:
                attempt.client = None
                log.warning("proxy.engine.refused", **ctx, cell=cell, status=exc.status, body=str(exc.body)[:500])
                too_long = prompt_too_long(exc)
                if too_long is not None:
                    raise context_exceeded(prompt_tokens, too_long[0], too_long[1]) from exc
                if exc.status >= 500 and errors < MAX_ENGINE_ERRORS:  # the engine failed, not the request
                    errors += 1
                    self.spawn(self.abort_upstream(client, rid))  # a gateway's 504: the worker may generate on
                    deadline += time.monotonic() - t_engine  # the window counts waiting, not generating
                    backoff = await self._avoid(avoid, cell, backoff, deadline - time.monotonic())
                    continue
                if exc.status in (401, 403):  # gyre's own wiring, not the harness's request
                    log.error("proxy.engine.unauthorized", **ctx, cell=cell, status=exc.status)
                    raise ApiError(502, "the engine refused the proxy's credentials (its engine token)",
                                   "server_error", code="engine_unauthorized") from exc
                status = 400 if 400 <= exc.status < 500 else 502
                raise ApiError(status, f"the engine refused the request: {exc.body}",
                               "invalid_request_error" if status == 400 else "server_error",
                               code="engine_error") from exc
            finally:
                self.router.untrack(attempt)
            # On cancellation attempt.client stays set, so the caller can abort `rid` upstream.
            if result is None:  # the cell left rollout mid-request: abort there, go elsewhere
                log.info("proxy.engine.evicted", **ctx, cell=cell, rid=rid)
                attempt.client = None
                self.spawn(self.abort_upstream(client, rid))
                avoid.add(cell)
                deadline += time.monotonic() - t_engine  # the window counts waiting, not generating
                continue
            attempt.client = None
            engine_s = time.monotonic() - t_engine
            too_long = _aborted_too_long(result)
            if too_long is not None:  # SGLang's scheduler refusing the prompt (versions that abort it)
                log.warning("proxy.engine.refused", **ctx, cell=cell, status=200, body=too_long[1][:500])
                raise context_exceeded(prompt_tokens, too_long[0], too_long[1])
            reply = engine_reply(result, self.vocab_size)
            if reply.finish == "abort":
                aborts += 1
                log.info("proxy.engine.aborted", **ctx, cell=cell, aborts=aborts)
                if aborts > MAX_ENGINE_ABORTS:
                    raise ApiError(502, "the engine aborted the generation repeatedly", "server_error",
                                   code="engine_aborted")
                deadline += time.monotonic() - t_engine  # the window counts waiting, not generating
                backoff = await self._avoid(avoid, cell, backoff, deadline - time.monotonic())
                continue
            return dataclasses.replace(reply, cell=cell, queue_s=t_engine - t0, engine_s=engine_s)
