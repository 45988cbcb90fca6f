"""The dispatch of a call's generation to engines with its retries (`Dispatcher`), and
the engine's `/generate` reply read as a sample of the policy (`engine_reply`).

Which engine serves an execution, and when a request in flight is cut (its cell leaves
rollout, or the scheduler moved its execution), is `handlers.proxy.router.Router`'s.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import operator
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import structlog

from gyre.serving.seeds import call_seed
from handlers.engines.client import EngineClient, EngineRequestError, EngineUnavailable
from handlers.metrics import PROXY_RETRIES
from handlers.proxy.api import ApiError, context_exceeded, unique_hex
from handlers.proxy.router import Attempt, Router, race
from schemas.call import SamplingParams

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
    times), or the router cuts the request (its cell left rollout, or the scheduler moved its
    execution: the request is then aborted upstream with `/abort_request`),
    the call goes to the execution's new cell or another rollout cell at once, or to the same engine after a backoff
    (`retry_backoff_s` doubling to `retry_backoff_max_s`), or waits for a cell, for up to
    `retry_timeout_s` seconds. session: the process's engine `aiohttp.ClientSession`.
    engine_token: the bearer token sent to every engine ('' = none); an engine that
    refuses it (401, 403) fails the call with a 502 `engine_unauthorized`.
    seed: the run's seed; a call `<execution>:<seq>` is sampled with
    `gyre.serving.seeds.call_seed(seed, execution, seq)` on every attempt (None: no seed sent).
    spawn: runs a background coroutine (the upstream aborts) the caller drains at shutdown.
    Every attempt given up and sent again is counted by reason in `retries` and in
    `handlers.metrics.PROXY_RETRIES`: `unavailable` (503, 429, 408, no connection), `timeout`
    (past `generate_bound_s`), `error` (another 5xx), `aborted` (an `abort` finish),
    `evicted` (the cell left rollout), `rerouted` (`route.updated` moved the execution).
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
        self.retries: collections.Counter[str] = collections.Counter()
        """Attempts sent again, by reason (class docstring)."""

    def _retry(self, reason: str) -> None:
        self.retries[reason] += 1
        PROXY_RETRIES.labels(reason).inc()

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
            attempt.execution = execution
            self.router.track(attempt)
            bound = generate_bound_s(sampling)
            try:
                async with slots:  # a full engine queues the call (its requests end within `bound`)
                    t_engine = time.monotonic()
                    result = await race(client.generate(prompt_ids, params, rid, execution=execution, timeout_s=bound,
                                                        kv_from=self.router.kv_hint(execution, cell)), attempt)
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
                    self._retry("timeout")
                else:
                    self._retry("unavailable")
                    if exc.status != 408 and exc.sent:  # dropped, or a 503 mid-request: it may have generated
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
                    self._retry("error")
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
            if result is None:  # cut mid-request (its cell left rollout, or it moved): abort there, go on
                log.info("proxy.engine.evicted", **ctx, cell=cell, rid=rid, reason=attempt.reason)
                self._retry(attempt.reason or "evicted")
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
                self._retry("aborted")
                deadline += time.monotonic() - t_engine  # the window counts waiting, not generating
                backoff = await self._avoid(avoid, cell, backoff, deadline - time.monotonic())
                continue
            self.router.answered(execution)
            return dataclasses.replace(reply, cell=cell, queue_s=t_engine - t0, engine_s=engine_s)
