"""The proxy's per-call path: one model call (or token count) from its request to its
answer and its record.

Contract (DESIGN.md "Token-in, token-out"):
- Auth: `Authorization: Bearer <key>` or `x-api-key: <key>`, a per-execution key
  (`authenticate`); the key alone names the execution a call is recorded in.
- Errors, in the API's own shape: 401 (missing/invalid key), 403 code
  `execution_finished` (the key's execution has finished), 400 (malformed JSON or
  request, or a conversation the template cannot render), 413 (body over
  `Config.body_limit_bytes`, also once decoded), 415 (a `Content-Encoding` this process
  cannot decode: gzip and deflate always, zstd when its module is installed, never br),
  429 with `Retry-After` (over `max_active_calls` or `max_active_calls_per_execution`),
  400 code `max_calls_exceeded` once an execution has started `Config.max_calls` model
  calls (non-retryable, so the harness stops), 502/503 only when the engine refused the
  request, none was reachable within `retry_timeout_s` (`handlers.proxy.routing.Dispatcher`;
  once the proxy is stopping, 503 code `proxy_stopping`: `STOPPED`) or its reply is not a
  sample of the policy (502, `handlers.proxy.routing.engine_reply`); 500 for a defect of
  the proxy's own.
- A call (`serve_call`): authenticate, parse (the body's resent history parsed only where
  it is new, `handlers.proxy.body.BodyMemo`; the conversion memo of the execution's
  earlier requests), classify (`ProxyState.classify`), admit, `match` (TITO attachment,
  `gyre.serving.tito.CallStore`: prompt ids reused or a branch; a heavy rendering in the
  proxy's one branch thread, off the event loop), `/generate` with `gyre_execution` set
  and a fresh rid (retried on other rollout cells, `Dispatcher`), decode (special tokens
  kept) and `gyre.serving.chat.parse_completion`, answer in the API's shape
  (`handlers.proxy.http.Reply`: keep-alives while waiting, the stream opened with its
  answer or after min(`http.STREAM_OPEN_S`, keepalive_s)), then record: the store learns
  the call only after its answer was delivered, with no await between, and its
  `call.completed` is published in the background (`handlers.proxy.outbox`), status `ok`,
  `aborted` (the client went away: the upstream request is aborted; or it took none of
  its answer for `deliver_timeout_s` and its connection was cut) or `error`. An answer
  that cannot be recorded is never sent.
- Sampling: `temperature`/`top_p`/`top_k` honoured and recorded (Config defaults when
  absent); the completion cap (`max_tokens`, `max_completion_tokens`,
  `max_output_tokens`) clamped to `Config.max_completion_tokens` and to the room
  the context window leaves (`_fit`); a prompt that leaves none is refused with the API's
  prompt-too-long error.
- `call.completed.finish_reason` is the engine's (`stop` | `length`), never inferred from
  the last token; the stop token stays in `completion_ids`. A stop string the engine
  reports as what ended the completion stays in `completion_ids` too, while the answer
  ends before it (Anthropic: `stop_reason` `stop_sequence` unless there are tool calls);
  the next call extends that completion like one cut by `length` (`<|im_end|>` appended,
  never sampled).
- Roles: `auxiliary` calls (count_tokens, titles, small side models) are answered and
  published but never enter the call store: rendered alone (parent None), they never
  shape the tree. A token count (`count_tokens`, Responses' `input_tokens`) is attached as
  a model call with its body would be, so it equals that call's input tokens, and
  published as an `auxiliary` root with the counted prompt, no completion, finish `stop`.
- Cost per extended call: Python work in proportion to the new messages only; what grows
  with the history are C-speed passes (comparing the body's bytes with the earlier body's,
  copying the prompt's ids and their JSON text, `_Execution.prompt_json`). The answer's
  turn is rendered and tokenised for the next call's drift after delivery.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import orjson
import structlog
from aiohttp import web

from gyre.serving.chat import parse_completion
from gyre.serving.roles import Classification
from gyre.serving.tito import CallStore, Match, Pending, Prepared
from gyre.serving.tokenizer import THINK_END
from handlers.proxy.anthropic import MessagesApi, parse_messages_request
from handlers.proxy.api import (
    Answer, Api, ApiError, MessageMemo, ModelRequest, StreamStart, completion_room, context_exceeded,
    internal_message, unique_hex,
)
from handlers.proxy.http import Reply, error_response, key_of, read_json
from handlers.proxy.openai import ChatApi, parse_chat_request
from handlers.proxy.responses import ResponsesApi, parse_responses_request
from handlers.proxy.router import Attempt
from handlers.proxy.routing import EngineResult
from handlers.proxy.state import ProxyState, _Execution, finished_error
from schemas.call import SamplingParams

log = structlog.get_logger()

CHAT, RESPONSES, MESSAGES = ChatApi(), ResponsesApi(), MessagesApi()

STATE = web.AppKey("state", ProxyState)
RAW_BODIES = web.AppKey("raw_bodies", bool)
REQUEST_ID = web.RequestKey("request_id", str)
"""Key of a model call's request id on its `web.Request` (`handlers.proxy.app._name_response`)."""


def authenticate(state: ProxyState, request: web.Request) -> str:
    """The execution a request's key belongs to. Raises ApiError(401)."""
    key = key_of(request)
    if key is None:
        raise ApiError(401, "no API key: send 'Authorization: Bearer <key>' or 'x-api-key'",
                       "authentication_error", code="missing_api_key")
    execution = state.execution_of(key)
    if not execution:
        raise ApiError(401, "invalid API key", "authentication_error", code="invalid_api_key")
    return execution


def _render_error(exc: Exception, execution: str) -> ApiError:
    """The 400 for a request the template cannot render (`CallStore.attach` / `complete` /
    `prepare` raised)."""
    if isinstance(exc, ValueError):
        return ApiError(400, f"cannot render the conversation: {exc}", param="messages")
    # e.g. a template error on odd input: the request's fault
    log.warning("proxy.render.failed", execution=execution, error=repr(exc), exc_info=exc)
    return ApiError(400, f"cannot render the conversation: {exc!r}", param="messages")


def new_request_id() -> str:
    """A request id in the hosted APIs' shape: `req_<24 hex>` (`handlers.proxy.app._name_response`)."""
    return "req_" + unique_hex()


def _refused(api: Api, err: ApiError, request_id: str) -> web.Response:
    """The error response for a request refused before it reached an engine (logged with
    its request id)."""
    log.info("proxy.request.refused", api=api.name, status=err.status, code=err.code, error=err.message[:200],
             request_id=request_id)
    return error_response(api, err)


def _internal_error(exc: Exception, execution: str, api: str, request_id: str) -> ApiError:
    """The 500 for a call that failed in the proxy before it reached an engine (logged)."""
    log.error("proxy.call.internal_error", execution=execution, api=api, request_id=request_id, error=repr(exc),
              exc_info=exc)
    return ApiError(500, f"internal error in the proxy: {type(exc).__name__}", "server_error", code="internal_error")


def _prepared_or_error(store: CallStore, pending: Pending) -> Prepared | Exception:
    """`store.prepare(pending)`, or what it raised (not MemoryError): run in the branch
    thread, so that only the request's own errors become a 400."""
    try:
        return store.prepare(pending)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - handed to _render_error on the loop
        return exc


async def match(store: CallStore, req: ModelRequest, auxiliary: bool, execution: str,
                thread: concurrent.futures.Executor, remember: bool = True) -> Match:
    """TITO attachment of a request (a fresh root for auxiliary calls). A heavy one whose
    prompt needs whole conversations rendered (`gyre.serving.tito.Pending.heavy`: a branch of a long
    conversation; with a template other than gyre's, any long
    request) is rendered and encoded in `thread` (the proxy's `ProxyState.branch_thread()`),
    so the event loop goes on serving other calls. Raises ApiError(400) for a request the
    template cannot render. remember=False: a token count, which leaves the store's
    normalisation memo as it was (`gyre.serving.tito.CallStore.attach`)."""
    try:
        found = store.attach(req.messages, req.tools, fresh=auxiliary, remember=remember)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - _render_error
        raise _render_error(exc, execution) from None
    if isinstance(found, Match):
        return found
    prepared = None
    if found.heavy:
        prepared = await asyncio.get_running_loop().run_in_executor(thread, _prepared_or_error, store, found)
    try:
        if isinstance(prepared, Exception):
            raise prepared
        return store.complete(found, prepared)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - _render_error
        raise _render_error(exc, execution) from None


async def _parsed(request: web.Request, state: ProxyState,
                  parse: Callable[[Any, SamplingParams, MessageMemo | None], ModelRequest], history: str,
                  remember: bool = True) -> tuple[str, _Execution, ModelRequest]:
    """Authenticate, read the body within the size limit (its `history` array parsed where
    it is new: `_Execution.bodies`), parse it with the execution's memo; remember=False (a
    token count) reuses both memos and adds nothing to them. Raises ApiError (401, 403,
    400, 413, 415) for the caller to answer in its API's shape."""
    execution = authenticate(state, request)
    ex = state.execution(execution)  # a live execution: its store, memo and bodies exist
    body = await read_json(request, state.cfg.body_limit_bytes, request.app.get(RAW_BODIES, False),
                           functools.partial(ex.bodies.loads, field=history, remember=remember))
    try:
        return execution, ex, parse(body, state.defaults, ex.memo if remember else ex.memo.reader())
    except RecursionError:  # orjson reads ~1,000 levels; converting them in Python may not
        raise ApiError(400, "the request body nests too deeply") from None


async def serve_call(request: web.Request, api: Api,
                     parse: Callable[[Any, SamplingParams, MessageMemo | None], ModelRequest]) -> web.StreamResponse:
    """One model call through `api`: authenticate, parse, classify, admit, match, generate,
    answer, record, publish (module docstring)."""
    state: ProxyState = request.app[STATE]
    cfg = state.cfg
    t0 = time.monotonic()
    request[REQUEST_ID] = request_id = new_request_id()
    try:
        execution, ex, req = await _parsed(request, state, parse, api.history)
        if not req.model:
            req = dataclasses.replace(req, model=cfg.model_name)
        roles = state.classify(ex, request.headers, req, api.name)
        if cfg.max_calls and ex.model_calls >= cfg.max_calls:
            raise ApiError(400, f"this execution has reached its limit of {cfg.max_calls} model calls; stop here",
                           code="max_calls_exceeded")
        state.admit(ex)
    except ApiError as err:
        return _refused(api, err, request_id)
    task = asyncio.current_task()
    state.calls.add(task)
    try:
        return await _serve_admitted(request, state, api, req, execution, ex, roles, t0, request_id)
    finally:
        state.release(ex)
        state.calls.discard(task)


async def _serve_admitted(request: web.Request, state: ProxyState, api: Api, req: ModelRequest, execution: str,
                          ex: _Execution, roles: Classification, t0: float, request_id: str) -> web.StreamResponse:
    cfg = state.cfg
    auxiliary = roles.role == "auxiliary"
    store = ex.store
    ex.model_calls += 1  # before any await: concurrent calls see it (max_calls)
    try:
        matched = await match(store, req, auxiliary, execution, state.branch_thread())
    except ApiError as err:
        ex.model_calls -= 1
        return _refused(api, err, request_id)
    except Exception as exc:  # noqa: BLE001 - ours or the machine's (MemoryError): a 500 in the API's shape
        ex.model_calls -= 1
        return error_response(api, _internal_error(exc, execution, api.name, request_id))
    except BaseException:
        ex.model_calls -= 1
        raise
    req = _fit(req, len(matched.prompt_ids), state.context_tokens)
    seq = ex.next_seq
    ex.next_seq += 1
    call_id = f"{execution}:{seq}"
    ctx = {"execution": execution, "call": call_id, "api": api.name, "role": roles.role,  # log context
           "request_id": request_id}
    common = dict(execution=execution, seq=seq, match=matched, sampling=req.sampling, api=api.name, role=roles.role,
                  meta={**roles.meta, "request_id": request_id})
    reply = Reply(request, api, req.stream, cfg.keepalive_s, cfg.deliver_timeout_s)
    attempt = Attempt()
    result: EngineResult | None = None
    delivered = False
    prompt = matched.prompt_ids  # (P,) int32, never mutated: the store keeps this array
    prompt_json = ex.prompt_json(matched)
    start = StreamStart(rid=api.new_id(), created=int(time.time()), model=req.model, prompt_tokens=len(prompt))
    try:
        await reply.start(start, api.preamble(start, req) if req.stream else [])
        try:
            while True:
                if state.context_tokens and completion_room(state.context_tokens, len(prompt)) < 1:
                    raise context_exceeded(len(prompt), state.context_tokens)
                try:
                    result = await state.engines.generate(execution, orjson.Fragment(prompt_json), req.sampling,
                                                          call_id, attempt, len(prompt))
                    if ex.finished:  # while it generated: its answer would land after the score
                        raise finished_error(execution)
                    break
                except ApiError as err:
                    # An engine's prompt-too-long names its context: learn it, and when the prompt
                    # fits with a lower cap (sent before the context was known), go again capped.
                    state.learn_context(err)
                    fitted = _fit(req, len(prompt), state.context_tokens) if err.context else req
                    if fitted is req:
                        raise
                    req = fitted
                    common["sampling"] = req.sampling
        except ApiError as err:
            log.warning("proxy.call.failed", **ctx, status=err.status, error=err.message[:300])
            resp = await reply.fail(err)
            state.publish_later(state.call_event(**common, result=None, status="error",
                                                 total_s=time.monotonic() - t0, cell=attempt.cell))
            return resp
        text, hit = state.decode(result.output_ids), result.stop_string
        if hit is not None and hit in req.sampling.stop and hit in text:
            text = text.partition(hit)[0]  # the answer ends before the string, as hosted APIs do
        else:
            hit = None
        parsed = parse_completion(text, id_prefix=api.tool_id_prefix(f"{cfg.run}:{call_id}"),
                                  cut=(result.finish == "length" or hit is not None) and bool(req.tools))
        answer = Answer(content=parsed.content, reasoning=parsed.reasoning, tool_calls=parsed.tool_calls,
                        finish=result.finish, prompt_tokens=len(prompt), completion_tokens=len(result.output_ids),
                        rid=start.rid, created=start.created, stop_sequence=hit,
                        reasoning_tokens=_reasoning_tokens(result.output_ids, cut="</think>" not in text)
                        if parsed.reasoning else 0,
                        token_logprobs=tuple(zip(state.token_bytes(result.output_ids), result.logprobs))
                        if req.options.get("logprobs") else None)
        # Built before the answer goes out: an answer that cannot be recorded is never sent;
        # journaled before it: a proxy killed once the harness has it leaves the record behind.
        event = state.journaled(state.call_event(**common, result=result, status="ok",
                                                 total_s=time.monotonic() - t0, cell=result.cell))
        resp = await reply.send(api.render(answer, req))
        delivered = True
        state.publish_later(event)
        # No await between delivery and recording: the harness's next call sees this one.
        if not auxiliary:
            store.record(matched, call=call_id, seq=seq, answer=internal_message(answer),
                         completion_ids=result.output_ids)
            if ex.store is store:  # not when the execution finished meanwhile (nothing would free it)
                ex.remember(matched, call_id, prompt_json, result.output_ids)
        # Debug: `call.completed` is the call's record, and a line per call at info costs a saturated proxy CPU.
        log.debug("proxy.call.recorded", **ctx, seq=seq, parent=matched.parent.call if matched.parent else None,
                  prefix_len=matched.prefix_len, extended=matched.extended, prompt_tokens=len(prompt),
                  new_prompt_tokens=len(prompt) - matched.prefix_len, completion_tokens=len(result.output_ids),
                  finish=result.finish, drift=matched.drift, cell=result.cell, stream=req.stream,
                  queue_s=round(result.queue_s, 4), engine_s=round(result.engine_s, 4),
                  total_s=round(time.monotonic() - t0, 4))
        return resp
    except (asyncio.CancelledError, ConnectionResetError) as exc:
        if not delivered:
            stopped = isinstance(exc, asyncio.CancelledError) and state.calls_cancelled
            reply.cut()
            log.info("proxy.call.stopped" if stopped else "proxy.call.client_gone", **ctx, seq=seq)
            _abandon(state, attempt, common, result, t0)
            if stopped and not reply.handed_over:  # the harness hears why: a 503, or an error event
                asyncio.current_task().uncancel()
                with contextlib.suppress(ConnectionResetError):  # (gone meanwhile: nothing to tell)
                    return await reply.fail(STOPPED)
        raise
    except Exception as exc:  # noqa: BLE001 - a defect of ours: answer in the API's shape, record the call
        log.exception("proxy.call.internal_error", **ctx, error=repr(exc), delivered=delivered)
        if delivered:  # published already (only recording failed): the next call attaches as a branch
            return resp
        state.publish_later(state.call_event(**common, result=None, status="error",
                                             total_s=time.monotonic() - t0, cell=attempt.cell))
        return await reply.fail(ApiError(500, f"internal error in the proxy: {type(exc).__name__}", "server_error",
                                         code="internal_error"))
    finally:
        if ex.finished:  # picked after `execution.finished` forgot it: its sticky cell would count for good
            state.router.forget(execution)
        await reply.stop_keepalive()


def _reasoning_tokens(output_ids: list[int], cut: bool) -> int:
    """Completion tokens up to and including the first `</think>` id. cut: the completion's
    text has no `</think>` (its reasoning was cut short while thinking:
    `gyre.serving.chat.parse_completion`), so all of them; 0 when the text has one but not as that
    id (sampled in pieces: where the reasoning ends in tokens is not known)."""
    if cut:
        return len(output_ids)
    try:
        return output_ids.index(THINK_END) + 1
    except ValueError:
        return 0


def _fit(req: ModelRequest, prompt_tokens: int, context: int) -> ModelRequest:
    """`req` with its completion cap at most the room a `context`-token window leaves
    (`completion_room`; unchanged when the context is 0, not known, or the prompt does not
    fit: that is refused before any engine)."""
    room = completion_room(context, prompt_tokens) if context else 0
    if 0 < room < req.sampling.max_tokens:
        return dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, max_tokens=room))
    return req


STOPPED = ApiError(503, "the proxy stopped before this call was answered", "server_error", code="proxy_stopping")
"""What a call the stop cancelled (`ProxyState.finish_calls`) answers: a 503 in the API's
shape, or its error event where the stream had opened; a non-streamed answer whose 200
went out with keep-alive newlines is cut (`Reply.fail`)."""


def _abandon(state: ProxyState, attempt: Attempt, common: dict, result: EngineResult | None, t0: float) -> None:
    """The harness went away, or the stop cancelled the call: publish it as `aborted` (never
    trained; counted unsent at once: the abort may wait on a hung engine past a shutdown's
    drain), abort the engine request in the background."""
    state.publish_later(state.call_event(**common, result=result, status="aborted", total_s=time.monotonic() - t0,
                                         cell=attempt.cell))
    if attempt.client is not None and attempt.rid:
        state.spawn(state.engines.abort_upstream(attempt.client, attempt.rid))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve_call(request, CHAT, parse_chat_request)


async def responses(request: web.Request) -> web.StreamResponse:
    return await serve_call(request, RESPONSES, parse_responses_request)


async def messages(request: web.Request) -> web.StreamResponse:
    return await serve_call(request, MESSAGES, parse_messages_request)


def _parse_count_tokens(body: Any, defaults: SamplingParams, memo: MessageMemo | None) -> ModelRequest:
    """A count_tokens body as a Messages body, without `stop_sequences` (it generates nothing)."""
    if isinstance(body, dict) and "stop_sequences" in body:
        body = {k: v for k, v in body.items() if k != "stop_sequences"}
    return parse_messages_request(body, defaults, memo)


async def _count(request: web.Request, api: Api,
                 parse: Callable[[Any, SamplingParams, MessageMemo | None], ModelRequest]) -> int | web.Response:
    """The prompt length a model call with this body would have in its execution: attached
    as the call would be (an extension reuses the ids the policy sampled, so the count is
    its `usage` input tokens to the token), published as an `auxiliary` call holding the
    whole prompt (a root: it shapes no tree). Counted in the concurrency bounds like a
    model call (its rendering may take the branch thread for a while): over them, a 429.
    Returns the count, or the error response in `api`'s shape."""
    state: ProxyState = request.app[STATE]
    t0 = time.monotonic()
    execution = ""
    request[REQUEST_ID] = request_id = new_request_id()
    try:
        execution, ex, req = await _parsed(request, state, parse, api.history, remember=False)
        roles = state.classify(ex, request.headers, req, "count_tokens")
        state.admit(ex)
        try:
            matched = await match(ex.store, req, False, execution, state.branch_thread(), remember=False)
        finally:
            state.release(ex)
        if ex.finished:  # while it was rendered: its record would land after the score
            raise finished_error(execution)
    except ApiError as err:
        return _refused(api, err, request_id)
    except Exception as exc:  # noqa: BLE001 - ours or the machine's (MemoryError): a 500 in the API's shape
        return error_response(api, _internal_error(exc, execution, "count_tokens", request_id))
    seq = ex.next_seq
    ex.next_seq += 1
    root = dataclasses.replace(matched, parent=None, prefix_len=0, extended=False, drift=0)
    state.publish_later(state.call_event(
        execution=execution, seq=seq, match=root, sampling=req.sampling, result=None, status="ok",
        total_s=time.monotonic() - t0, cell="", api=api.name, role=roles.role,
        meta={**roles.meta, "request_id": request_id}))
    return len(matched.prompt_ids)


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic's `POST /v1/messages/count_tokens`: `{"input_tokens": n}` (`_count`)."""
    n = await _count(request, MESSAGES, _parse_count_tokens)
    return n if isinstance(n, web.Response) else web.json_response({"input_tokens": n})


async def responses_input_tokens(request: web.Request) -> web.Response:
    """OpenAI's `POST /v1/responses/input_tokens` (the SDK's `responses.input_tokens.count`):
    `{"object": "response.input_tokens", "input_tokens": n}` (`_count`)."""
    n = await _count(request, RESPONSES, parse_responses_request)
    return n if isinstance(n, web.Response) else web.json_response({"object": "response.input_tokens",
                                                                    "input_tokens": n})
