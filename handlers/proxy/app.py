"""The proxy's HTTP application: its routes, the endpoints that are not model calls, and
its server.

Contract:
- Routes (`make_app`), each also without `/v1`: `POST /v1/chat/completions`, `POST
  /v1/responses` and `POST /v1/responses/input_tokens` (OpenAI shapes,
  handlers/proxy/openai.py and handlers/proxy/responses.py), `POST /v1/messages` and
  `POST /v1/messages/count_tokens` (Anthropic shapes, handlers/proxy/anthropic.py; a `?beta=true` query is ignored), all
  served by `handlers.proxy.call`; `GET /v1/models` and `/v1/models/{id}` (any id; the
  key is checked); `/v1/responses/{id}` is a 404 (no response is stored); `GET /health`
  (`{"status": "ok", "run"}`), `GET|HEAD /`. Any other path: 404 `unknown_url`, a model
  path with another method than POST: 405 — in the caller's API's error shape.
- Every response carries the request id as `request-id` and `x-request-id`.
- `start(state, reuse_port_of)` serves the app on `Config.host`:`Config.port` and returns
  (runner, base URL); with port 0 it takes the port of the proxy's predecessor when free.
"""
from __future__ import annotations

import urllib.parse

import structlog
from aiohttp import web

from handlers.proxy.api import Api, ApiError
from handlers.proxy.call import (
    CHAT, MESSAGES, RAW_BODIES, REQUEST_ID, RESPONSES, STATE, authenticate, chat_completions, count_tokens,
    messages, new_request_id, responses, responses_input_tokens,
)
from handlers.proxy.http import error_response
from handlers.proxy.state import ProxyState

log = structlog.get_logger()


async def response_not_stored(request: web.Request) -> web.Response:
    """`/v1/responses/{id}` (retrieve, delete, cancel, input items): 404, the proxy stores
    no responses (Codex CLI sends `store: false` and the whole conversation each call).
    `/v1/responses/compact` is an endpoint, not an id: answered as one not served."""
    if request.path in MODEL_PATHS or request.match_info["rid"] == "compact":  # input_tokens: not a POST
        return await not_found(request)
    rid = request.match_info["rid"].split("/", 1)[0]
    return error_response(RESPONSES, ApiError(404, f"Response with id {rid[:200]!r} not found: this proxy stores no "
                                                   "responses", code="response_not_found"))


def _model_entry(name: str) -> dict:
    """A model object both OpenAI's (`id`, `object`, `created`, `owned_by`) and Anthropic's
    (`id`, `type`, `display_name`, `created_at`) SDKs read."""
    return {"id": name, "object": "model", "type": "model", "display_name": name, "created": 0,
            "created_at": "1970-01-01T00:00:00Z", "owned_by": "gyre"}


async def models(request: web.Request) -> web.Response:
    """The one model (`GET /v1/models`)."""
    state: ProxyState = request.app[STATE]
    try:
        authenticate(state, request)
    except ApiError as err:
        return error_response(_api_of(request), err)
    name = state.cfg.model_name
    return web.json_response({"object": "list", "data": [_model_entry(name)], "has_more": False, "first_id": name,
                              "last_id": name})


async def model(request: web.Request) -> web.Response:
    """`GET /v1/models/{id}`: any name, as every call accepts any model name (it is served
    by the policy)."""
    try:
        authenticate(request.app[STATE], request)
    except ApiError as err:
        return error_response(_api_of(request), err)
    return web.json_response(_model_entry(request.match_info["model"]))


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "run": request.app[STATE].cfg.run})


async def root(request: web.Request) -> web.Response:
    return web.Response(text="gyre proxy\n")


def _api_of(request: web.Request) -> Api:
    """Whose error shape a request outside the model routes gets: Anthropic's for its paths
    and for its SDK's headers (`anthropic-version`, `x-api-key`), else OpenAI's."""
    anthropic = request.path.startswith(("/v1/messages", "/messages")) or "anthropic-version" in request.headers \
        or "x-api-key" in request.headers
    return MESSAGES if anthropic else CHAT


MODEL_PATHS = frozenset(prefix + path for prefix in ("/v1", "") for path in (
    "/chat/completions", "/responses", "/messages", "/messages/count_tokens", "/responses/input_tokens"))


async def not_found(request: web.Request) -> web.Response:
    """404 `unknown_url` in the caller's shape; a model path asked with another method than
    POST is 405 with `Allow: POST` (RFC 9110 §15.5.6)."""
    if request.path in MODEL_PATHS:
        return error_response(_api_of(request), ApiError(
            405, f"{request.method} is not allowed on {request.path}; use POST", code="method_not_allowed",
            headers={"Allow": "POST"}))
    return error_response(_api_of(request), ApiError(404, f"unknown endpoint {request.method} {request.path}",
                                                     "not_found_error", code="unknown_url"))


async def _name_response(request: web.Request, response: web.StreamResponse) -> None:
    """Every response carries a request id, as the hosted APIs send one: `request-id`
    (Anthropic; its SDK's `_request_id` and errors' `request_id`) and `x-request-id`
    (OpenAI), the same `req_<24 hex>`. A model call's id is also in its `call.completed`
    `meta.request_id` and its log lines, so an id a harness prints leads to the call."""
    rid = request.get(REQUEST_ID) or new_request_id()
    response.headers["request-id"] = response.headers["x-request-id"] = rid


def make_app(state: ProxyState) -> web.Application:
    """The proxy's aiohttp application. Serve it as `start` does: `handler_cancellation=True`
    (a harness that goes away aborts its call upstream) and `auto_decompress=False` with
    `app[RAW_BODIES] = True` (bodies decoded here, bounded, unsupported codings → 415)."""
    app = web.Application(client_max_size=state.cfg.body_limit_bytes)
    app[STATE] = state
    app.on_response_prepare.append(_name_response)
    for prefix in ("/v1", ""):
        app.router.add_post(prefix + "/chat/completions", chat_completions)
        app.router.add_post(prefix + "/responses", responses)
        app.router.add_post(prefix + "/messages", messages)
        app.router.add_post(prefix + "/messages/count_tokens", count_tokens)
        app.router.add_post(prefix + "/responses/input_tokens", responses_input_tokens)
        app.router.add_route("*", prefix + "/responses/{rid:.+}", response_not_stored)
        app.router.add_get(prefix + "/models", models)
        app.router.add_get(prefix + "/models/{model:.+}", model)  # a raw "Qwen/Qwen3-8B" too
    app.router.add_get("/health", health)
    app.router.add_get("/", root)
    app.router.add_route("*", "/{tail:.*}", not_found)
    return app


IDLE_CLOSE_S = 75.0
"""Seconds a connection may wait without a whole request head (idle between calls, or a
client that sent nothing or part of its headers) before the proxy closes it: aiohttp's
keep-alive timeout, as `web.run_app` sets it (its `AppRunner` default, an hour, would let
a local process hold connections until the proxy runs out of file descriptors). The
SDKs' own idle timeouts are shorter (httpx 5 s, undici 4 s). A body that stalls once its
head has come: `handlers.proxy.http.BODY_READ_S`."""


async def start(state: ProxyState, reuse_port_of: str = "") -> tuple[web.AppRunner, str]:
    """Serve `make_app(state)` on cfg.host:cfg.port; returns the runner and the base URL.
    With cfg.port 0 and `reuse_port_of` (the URL a predecessor of the run served at, from
    its url file), that port is taken when it is free, so that harnesses started before a
    proxy restart reach the new proxy when they retry; a free port otherwise."""
    app = make_app(state)
    app[RAW_BODIES] = True
    # Model calls are finished or cancelled before the runner's cleanup (`handlers.proxy.daemon.run`); what else
    # is still being answered then (a count_tokens) gets this long, twice (aiohttp's two waits).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0,
                           auto_decompress=False, keepalive_timeout=IDLE_CLOSE_S)
    await runner.setup()
    host = state.cfg.host
    if not state.cfg.port and (earlier := _port_of(reuse_port_of, host)):
        site = web.TCPSite(runner, host, earlier)
        try:
            await site.start()
            return runner, f"http://{host}:{earlier}"
        except OSError as exc:  # something else listens there now
            await site.stop()
            log.warning("proxy.port.not_reused", port=earlier, error=str(exc))
    await web.TCPSite(runner, host, state.cfg.port).start()
    return runner, f"http://{host}:{runner.addresses[0][1]}"


def _port_of(url: str, host: str) -> int:
    """The port of `url` when it is an http URL on `host`, else 0."""
    try:
        parsed = urllib.parse.urlsplit(url)
        port = parsed.port or 0
    except ValueError:
        return 0
    return port if parsed.scheme == "http" and parsed.hostname == host.strip("[]") else 0
