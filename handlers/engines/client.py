"""HTTP client of an engine speaking SGLang's native API (the embedded engine or SGLang).

One method per endpoint. Errors:
- `EngineUnavailable` (retryable): 503 (engine not serving, e.g. its cell left
  rollout), 429 and 408 (overloaded: SGLang's model gateway answers 429 when its queue is
  full and 408 when a request waited in it too long), connection refused or reset, read
  timeout (on `/generate`, the caller's `timeout_s`). The caller retries, possibly on
  another cell.
- `EngineRequestError`: any other error status; `.status` and `.body` (the upstream
  error body, parsed JSON when possible) are attached. Not retryable as such.

The session is the caller's: one per process, from `make_session()` (no total timeout,
bounded connect and socket read; `/generate` takes its own bound, since a generation may
run for a long time). `/generate`, sent once per model call, goes over the client's own
keep-alive connections instead (`handlers.engines.connections.EngineConnections`: a fraction of aiohttp's
cost per request); `close()` drops them.

Authentication: `api_key`, the run's engine token, is sent on every request as
`Authorization: Bearer <token>` (SGLang's `--api-key` convention; the embedded engine
demands it). A 401 or 403 is an `EngineRequestError`, like any refusal.
"""
from __future__ import annotations

import asyncio

from collections.abc import Sequence

import aiohttp
import numpy as np
import orjson

from handlers.engines.connections import EngineConnections, Unreachable


class EngineClientError(Exception):
    """Base of the errors `EngineClient` raises."""


class EngineUnavailable(EngineClientError):
    """The engine cannot take the request now (`OVERLOADED`, connection error, timeout): retry.
    `status`: the HTTP status it answered (`OVERLOADED`; a 408 says the request only
    waited in a queue), None when it gave no answer. `sent`: False when no connection
    could be made, so the engine never saw the request."""

    def __init__(self, message: str, status: int | None = None, sent: bool = True) -> None:
        super().__init__(message)
        self.status = status
        self.sent = sent


class EngineRequestError(EngineClientError):
    """The engine refused the request; `status` (HTTP) and `body` (upstream error) attached."""

    def __init__(self, message: str, status: int, body: object) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


def make_session(connect_s: float = 10.0, sock_read_s: float = 600.0, limit: int = 0) -> aiohttp.ClientSession:
    """A client session for engine calls: no total timeout, `connect_s` seconds to
    connect, `sock_read_s` seconds of socket silence before giving up, up to `limit`
    concurrent connections (0 = no bound: the proxy bounds requests per engine, and a
    shared pool would let a few busy or hung engines starve the rest). Create one per
    process, inside the running event loop."""
    timeout = aiohttp.ClientTimeout(total=None, connect=connect_s, sock_connect=connect_s, sock_read=sock_read_s)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=limit),
                                 cookie_jar=aiohttp.DummyCookieJar())  # engines set no cookies


def _parse(raw: bytes) -> object:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace")


OVERLOADED = frozenset((408, 429, 503))
"""Statuses that say the engine cannot take the request now, not that the request is wrong."""


def _answer(method: str, url: str, status: int, raw: bytes) -> object:
    """The parsed body of an answer with HTTP `status`; raises EngineUnavailable
    (`OVERLOADED`) or EngineRequestError (any other status ≥ 400, its body attached)."""
    parsed = _parse(raw)
    if status in OVERLOADED:
        raise EngineUnavailable(f"{method} {url}: {status} {parsed}", status)
    if status >= 400:
        raise EngineRequestError(f"{method} {url}: {status} {parsed}", status, parsed)
    return parsed


def _ids(input_ids: Sequence[int] | np.ndarray | orjson.Fragment) -> list[int] | np.ndarray | orjson.Fragment:
    """Prompt ids as orjson writes them: a list, a 1-D integer array (C order), or their
    JSON array already written (`orjson.Fragment`, passed as it is). Raises TypeError for
    an array of another dtype or rank."""
    if isinstance(input_ids, orjson.Fragment):
        return input_ids
    if not isinstance(input_ids, np.ndarray):
        return list(input_ids)
    if input_ids.ndim != 1 or input_ids.dtype.kind not in "iu":
        raise TypeError(f"input_ids must be a 1-D integer array, got {input_ids.ndim}-D {input_ids.dtype}")
    return np.ascontiguousarray(input_ids, dtype=input_ids.dtype.newbyteorder("="))


def ids_json(input_ids: Sequence[int] | np.ndarray) -> bytes:
    """The JSON array `/generate` carries as `input_ids` (for `orjson.Fragment`). Raises
    TypeError as `_ids`."""
    return orjson.dumps(_ids(input_ids), option=orjson.OPT_SERIALIZE_NUMPY)


class EngineClient:
    """Client of one engine at `base_url` (e.g. "http://127.0.0.1:30000")."""

    def __init__(self, base_url: str, session: aiohttp.ClientSession, api_key: str = "") -> None:
        """api_key: the engine's bearer token ('' = send none: an engine that demands none)."""
        self.base_url = base_url.rstrip("/")
        self.session = session
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.connections = EngineConnections(self.base_url, connect_s=session.timeout.connect or 10.0,
                                             bearer=api_key)

    def close(self) -> None:
        """Drop the idle `/generate` connections (the session is the caller's to close)."""
        self.connections.close()

    async def _request(self, method: str, path: str, body: dict | None = None,
                       timeout: aiohttp.ClientTimeout | None = None) -> object:
        url = self.base_url + path
        data = None if body is None else orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        headers = dict(self._auth)
        if body is not None:
            headers["Content-Type"] = "application/json"
        extra = {} if timeout is None else {"timeout": timeout}
        try:
            async with self.session.request(method, url, data=data, headers=headers, **extra) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise EngineUnavailable(f"{method} {url}: {type(e).__name__}: {e}") from e
        return _answer(method, url, status, raw)

    async def generate(
        self,
        input_ids: Sequence[int] | np.ndarray | orjson.Fragment,
        sampling: dict,
        rid: str,
        execution: str | None = None,
        return_logprob: bool = True,
        timeout_s: float | None = None,
        kv_from: dict | None = None,
    ) -> dict:
        """POST /generate. input_ids: (P,) prompt ids, a list or a 1-D integer array
        (serialised as a JSON list either way, without a copy into Python ints), or that JSON
        list already written, as an `orjson.Fragment`. sampling:
        SGLang sampling_params (temperature, top_p, top_k, max_new_tokens, stop_token_ids,
        seed). execution: sticky key of the engine's per-execution prefix KV cache
        (`gyre_execution`; ignored by SGLang). Returns the response body: {"output_ids",
        "meta_info": {"finish_reason", "output_token_logprobs", "weight_version",
        "gyre_versions", ...}}. Cancelling the await closes the connection, and the engine
        aborts the request. timeout_s: seconds the whole request may take (a non-streamed
        /generate is silent until it ends, so the session's socket-read bound does not
        apply); None = unbounded. kv_from: `{"cell", "route"}` where the moved execution's KV
        comes from (`gyre_kv_from`, handlers.proxy.router; ignored by SGLang). Sent over
        `self.connections` (module docstring), connecting within the session's connect bound."""
        body: dict = {
            "input_ids": _ids(input_ids),
            "sampling_params": sampling,
            "return_logprob": return_logprob,
            "rid": rid,
            "stream": False,
        }
        if execution is not None:
            body["gyre_execution"] = execution
        if kv_from is not None:
            body["gyre_kv_from"] = kv_from
        try:
            status, raw = await self.connections.post(
                "/generate", orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), timeout_s)
        except OSError as e:  # refused, reset, malformed answer; TimeoutError: the bound ran out
            raise EngineUnavailable(f"POST {self.base_url}/generate: {type(e).__name__}: {e}",
                                    sent=not isinstance(e, Unreachable)) from e
        return _answer("POST", self.base_url + "/generate", status, raw)

    async def abort(self, rid: str) -> bool:
        """POST /abort_request; True when the engine had `rid` in flight."""
        res = await self._request("POST", "/abort_request", {"rid": rid})
        return bool(isinstance(res, dict) and res.get("aborted"))

    async def health(self) -> bool:
        """GET /health: True when the engine serves; False on 503 or no connection."""
        try:
            await self._request("GET", "/health")
        except EngineClientError:
            return False
        return True

    async def update_weights_from_disk(self, path: str, version: int) -> dict:
        """POST /update_weights_from_disk; returns {"success": True, "message"}. A checkpoint
        that does not fit raises EngineRequestError (body has success false and the reason)."""
        return await self._request("POST", "/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version)})

    async def flush_cache(self) -> dict:
        """POST /flush_cache: drops the engine's prefix caches."""
        return await self._request("POST", "/flush_cache")

    async def model_info(self) -> dict:
        """GET /get_model_info."""
        return await self._request("GET", "/get_model_info")

    async def weight_version(self) -> int:
        """GET /get_weight_version as an int policy version."""
        res = await self._request("GET", "/get_weight_version")
        return int(res["weight_version"])
