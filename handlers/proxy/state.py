"""The state every handler of the proxy shares (`ProxyState`): executions and their keys,
admission, the run's state replayed from the bus, and the classification of calls.

Contract:
- Keys: `execution_of(key)` → the execution a per-execution key was issued for
  (`gyre.env.harness.verify_key`), None for a forged one; valid answers are cached
  (`KEY_CACHE`), rejected ones never.
- Executions: `execution(name)` → its `_Execution` (call store, request memos, seqs, the
  calls it has started and has in flight), made on its first call. Raises
  ApiError(403, code `execution_finished`) once its `execution.finished` was seen.
- Admission: `admit(ex)` counts a model call in; ApiError(429, `Retry-After`) beyond
  `Config.max_active_calls`, or `max_active_calls_per_execution` for one execution.
  `release(ex)` counts it out. `finish_calls(timeout_s)` waits for the calls being served
  at a stop, then cancels them.
- Replayed state (`handle_event`, for the events in `REPLAYED`): rollout cells from
  `cell.switched` (`to_role` rollout with an `engine_url`; any other role removes the
  cell) and assignments from `route.updated` (`handlers.proxy.router.Router`); an
  execution's harness profile from `execution.started`; `execution.finished` frees the
  execution's store and memos (its seq counter is kept, so event ids never repeat).
- Restarts: `resume_seqs(stored)` continues each execution's seq after the run's stored
  `call.completed` ids, and counts their model calls against `Config.max_calls`.
- Classification (`classify`, gyre.serving.roles): a call's role and metadata with the
  execution's harness profile (learnt from `execution.started`'s harness, else
  `Config.harness`, else detected from the headers).
A `ProxyState` is an `handlers.proxy.outbox.Outbox`: it also publishes the calls' records.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import structlog

from gyre.env.harness import verify_key as harness_verify_key
from gyre.serving.roles import CallFacts, Classification, classify, profile_for_harness
from gyre.serving.tito import CallStore, Match
from gyre.serving.tokenizer import fast_decoder, token_bytes
from handlers.engines.client import ids_json
from handlers.proxy.api import ApiError, MessageMemo, ModelRequest
from handlers.proxy.body import BodyMemo
from handlers.proxy.outbox import REQUEST_KIND_HEADER, Outbox
from handlers.proxy.router import Router
from handlers.proxy.routing import Dispatcher
from schemas.cell import CellSwitched, RouteUpdated
from schemas.execution import ExecutionFinished, ExecutionStarted

if TYPE_CHECKING:
    from handlers.proxy.daemon import Config

log = structlog.get_logger()

WIRE_CACHE = 4
"""Recorded calls per execution whose ids are kept as JSON text (`_Execution.wire`): a call
leaves when a recorded call extends it, so these are the tips of up to 4 lines (main,
sub-agents, summaries) and a line's history is kept once, a few bytes a token beside the
store's ids."""

KEY_CACHE = 65_536
"""Valid API keys whose execution `ProxyState.execution_of` keeps (least recently used
dropped); rejected keys are never kept, so unauthenticated requests cannot fill it."""


REPLAYED = (CellSwitched.NAME, RouteUpdated.NAME, ExecutionStarted.NAME, ExecutionFinished.NAME)
"""Events the proxy's state is rebuilt from (`ProxyState.handle_event`)."""


@dataclasses.dataclass(slots=True)
class _Execution:
    """Per-execution proxy state: the TITO store, the request-conversion memo and the prompt
    JSON of the latest calls (`wire`; None, None and empty once the execution finished), the
    next call's seq (kept for the proxy's lifetime so event ids never repeat), model calls
    started (for `max_calls`), calls in flight, the roles profile (None = detect), and whether
    its `execution.finished` has been seen (its key then takes no more calls)."""

    store: CallStore | None
    memo: MessageMemo | None = None
    bodies: BodyMemo | None = None
    """The latest request bodies, so a resent history is not parsed again (`handlers.proxy.body`)."""
    finished: bool = False
    next_seq: int = 0
    model_calls: int = 0
    active: int = 0
    harness: str | None = None
    wire: dict[str, bytes] = dataclasses.field(default_factory=dict)
    """call → the JSON text of its full ids (prompt + completion), for its latest
    WIRE_CACHE recorded calls (`prompt_json`)."""

    def prompt_json(self, match: Match) -> bytes:
        """The JSON array of `match.prompt_ids` as sent to the engine. An extension of a call
        in `wire` is that call's text + its new ids, so a long history is not serialised
        again on every call."""
        parent = match.parent
        head = self.wire.get(parent.call) if parent is not None and match.extended else None
        if head is None or match.prefix_len != parent.full_len:
            return ids_json(match.prompt_ids)
        return _joined(head, ids_json(match.new_prompt_ids))

    def remember(self, match: Match, call: str, prompt_json: bytes, completion_ids: list[int]) -> None:
        """Keep the JSON of a recorded call's full ids for its extensions, in place of its
        parent's when it extends it (the line's tip moves; a retry of the parent's
        extension then serialises its prompt in full)."""
        if match.extended and match.parent is not None:
            self.wire.pop(match.parent.call, None)
        self.wire[call] = _joined(prompt_json, ids_json(completion_ids))
        while len(self.wire) > WIRE_CACHE:
            del self.wire[next(iter(self.wire))]


def _joined(head: bytes, tail: bytes) -> bytes:
    """The JSON arrays `head` and `tail` as one array."""
    if tail == b"[]":
        return head
    if head == b"[]":
        return tail
    return b"".join((memoryview(head)[:-1], b",", memoryview(tail)[1:]))  # one copy


class _InvalidKey(Exception):
    pass


def _valid_key(verify_key: Callable[[bytes, str], str | None], secret: bytes, key: str) -> str:
    execution = verify_key(secret, key)
    if not execution:
        raise _InvalidKey
    return execution


class ProxyState(Outbox):
    """Everything the proxy's handlers share: config, tokenizer, engine clients, executions,
    calls, and (as an `Outbox`) the publishing of their records.

    bus: a connected `bus.Bus` or None (no events published). session: the process's one
    aiohttp ClientSession (`handlers.engines.client.make_session()`). verify_key: (secret,
    key) → execution or None; `execution_of(key)` caches its valid answers (an HMAC per
    call otherwise; `KEY_CACHE`).
    """

    def __init__(self, cfg: Config, tokenizer: Any, session: Any, bus: Any = None,
                 verify_key: Callable[[bytes, str], str | None] = harness_verify_key):
        Outbox.__init__(self, cfg, bus)
        self.tokenizer = tokenizer
        self.decode = fast_decoder(tokenizer)
        self.token_bytes = token_bytes(tokenizer)
        self.session = session
        self._valid_key = functools.lru_cache(maxsize=KEY_CACHE)(functools.partial(_valid_key, verify_key, cfg.key_secret))
        self.router = Router(cfg.engine_url, cfg.static_cell)
        self.executions: dict[str, _Execution] = {}
        self.active = 0
        self.defaults = cfg.sampling_defaults()
        self.context_tokens = cfg.context_tokens
        """The context window in force (`Config.context_tokens`, or learnt from an engine)."""
        self.engines = Dispatcher(self.router, session, concurrency=cfg.concurrency,
                                  retry_timeout_s=cfg.retry_timeout_s, retry_backoff_s=cfg.retry_backoff_s,
                                  retry_backoff_max_s=cfg.retry_backoff_max_s, spawn=self.spawn,
                                  vocab_size=vocab_size(cfg.model_dir), engine_token=cfg.engine_token,
                                  seed=cfg.seed)
        self._branch_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self.calls: set[asyncio.Task] = set()
        """The handler tasks of the model calls being served (`finish_calls`)."""
        self.calls_cancelled = False
        """`finish_calls` has cancelled the calls still served: a cancelled handler is the
        stop's doing, not its client's."""

    def branch_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """The one worker thread that renders and encodes heavy requests
        (`handlers.proxy.call.match`), made on first use. One: they queue behind each other
        instead of contending for the GIL with the event loop."""
        if self._branch_thread is None:
            self._branch_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gyre-branch")
        return self._branch_thread

    def close(self) -> None:
        """Stop the branch thread (work it has not started is dropped) and drop the engines'
        idle connections; after `drain`."""
        self.engines.close()
        self.close_journal()
        if self._branch_thread is not None:
            self._branch_thread.shutdown(wait=False, cancel_futures=True)

    def execution_of(self, key: str) -> str | None:
        """The execution `key` was issued for, or None for a forged or malformed key."""
        try:
            return self._valid_key(key)
        except _InvalidKey:  # lru_cache keeps no exception: rejected keys take no room
            return None

    # -- bus-fed state
    async def handle_event(self, event: Any) -> None:
        """Replay handler for `cell.switched`, `route.updated`, `execution.started` (the
        execution's harness profile) and `execution.finished` (frees the execution's call
        store, memo and prompt JSON; its seq counter is kept)."""
        if isinstance(event, CellSwitched):
            self.router.handle_cell_switched(event)
            log.info("proxy.cell.updated", cell=event.cell, role=event.to_role, engine_url=event.engine_url)
        elif isinstance(event, RouteUpdated):
            self.router.handle_route_updated(event)
        elif isinstance(event, ExecutionStarted):
            ex = self.executions.setdefault(event.info.execution, _Execution(store=None))
            ex.harness = profile_for_harness(event.info.harness)
        elif isinstance(event, ExecutionFinished):
            ex = self.executions.setdefault(event.info.execution, _Execution(store=None))
            ex.store = ex.memo = ex.bodies = None
            ex.wire = {}
            ex.finished = True
            self.router.forget(event.info.execution)

    def resume_seqs(self, stored: Mapping[str, Mapping[str, str]]) -> int:
        """Continue each execution's seq after the highest of its `call.completed` event ids
        (`<run>:<execution>:call:<seq>`) stored by an earlier proxy of this run, so a
        restarted proxy's events never reuse an id (JetStream would drop them as duplicates
        within its window; after it, two calls would share a call id). stored: event id →
        its headers (`Bus.stored_ids`). Returns the number of executions resumed. Ids of
        other runs or shapes are ignored. Each resumed execution's started model calls
        (`max_calls`) count as next_seq less its count_tokens calls (`call_headers`), so a
        runaway harness does not start over and a counting one loses no call."""
        head = f"{self.cfg.run}:"
        resumed: dict[str, int] = {}  # execution -> its count_tokens calls
        for event_id, headers in stored.items():
            execution, sep, seq = event_id.removeprefix(head).rpartition(":call:")
            if not event_id.startswith(head) or not sep or not (seq.isascii() and seq.isdigit()):
                continue
            ex = self.executions.setdefault(execution, _Execution(store=None))
            ex.next_seq = max(ex.next_seq, int(seq) + 1)
            counted = headers.get(REQUEST_KIND_HEADER) == "count_tokens"
            resumed[execution] = resumed.get(execution, 0) + counted
        for execution, counted in resumed.items():
            ex = self.executions[execution]
            ex.model_calls = max(ex.model_calls, ex.next_seq - counted)
        return len(resumed)

    def learn_context(self, err: ApiError) -> None:
        """Take the context length an engine's prompt-too-long refusal names, when it is news
        (none known, or a smaller one)."""
        context = err.context if err.code == "context_length_exceeded" else None
        if context is None or context < 2 or (self.context_tokens and context >= self.context_tokens):
            return
        log.warning("proxy.context.learnt", context_tokens=context, was=self.context_tokens)
        self.context_tokens = context

    def execution(self, execution: str) -> _Execution:
        """The state of a live execution, its call store made on its first call. Raises
        ApiError(403, `execution_finished`) once its `execution.finished` was seen: a call
        then (a harness's leftover process, a key reused after the run) would be recorded
        after the execution was scored, as a new root of its tree."""
        ex = self.executions.get(execution)
        if ex is None:
            ex = self.executions[execution] = _Execution(store=None)
        if ex.finished:
            raise finished_error(execution)
        if ex.store is None:
            ex.store = CallStore(self.tokenizer, check_drift=self.cfg.check_drift)
            ex.memo = MessageMemo()
            ex.bodies = BodyMemo()
        return ex

    def classify(self, ex: _Execution, headers: Any, req: ModelRequest, api: str) -> Classification:
        """Role and metadata of a call (gyre.serving.roles), with the execution's profile."""
        facts = CallFacts(api=api, headers={k.lower(): v for k, v in headers.items()}, model=req.model,
                          messages=req.messages, tools=len(req.tools or ()), json_output=req.json_output,
                          body_meta=req.body_meta)
        return classify(facts, ex.harness or self.cfg.harness or None)

    def admit(self, ex: _Execution) -> None:
        """Count a model call in; raises ApiError(429) over the concurrency bounds."""
        cfg = self.cfg
        if (cfg.max_active_calls and self.active >= cfg.max_active_calls) or (
                cfg.max_active_calls_per_execution and ex.active >= cfg.max_active_calls_per_execution):
            raise ApiError(429, "too many calls in flight; retry shortly", "rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(cfg.retry_after_s)})
        self.active += 1
        ex.active += 1

    def release(self, ex: _Execution) -> None:
        self.active -= 1
        ex.active -= 1

    async def finish_calls(self, timeout_s: float) -> None:
        """Wait (≤ timeout_s) for the model calls being served (no new ones come: the
        listener is closed), then cancel the rest: each is published as `aborted` and its
        engine request aborted (`_abandon`), in the background `drain` waits for."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while self.calls and time.monotonic() < deadline:
            await asyncio.wait(set(self.calls), timeout=deadline - time.monotonic())
        if self.calls:
            log.warning("proxy.stop.calls_cancelled", calls=len(self.calls))
            self.calls_cancelled = True
            cancelled = set(self.calls)
            for task in cancelled:
                task.cancel()
            await asyncio.wait(cancelled, timeout=1.0)


def finished_error(execution: str) -> ApiError:
    """The 403 for a call of an execution whose `execution.finished` was seen."""
    return ApiError(403, f"execution {execution!r} has finished; its key takes no more calls", "permission_error",
                    code="execution_finished")


def vocab_size(model_dir: str) -> int:
    """Rows of the policy's embedding table, the bound on the token ids an engine may
    answer: the checkpoint's `config.json` `vocab_size` (or its `text_config`'s), gyre's
    padded Qwen3 vocabulary (151,936) for the built-in tokenizer; 2**31 (int32, no other
    bound) when the checkpoint's config does not say."""
    if not model_dir:
        from gyre.serving.tokenizer import VOCAB_SIZE

        return VOCAB_SIZE
    try:
        config = orjson.loads((Path(model_dir) / "config.json").read_bytes())
    except (OSError, ValueError):
        return 2**31
    for c in (config, config.get("text_config") if isinstance(config, dict) else None):
        if isinstance(c, dict) and type(c.get("vocab_size")) is int and c["vocab_size"] > 0:
            return c["vocab_size"]
    return 2**31
