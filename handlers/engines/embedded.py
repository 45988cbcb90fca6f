"""The embedded engine behind SGLang's native HTTP API.

Routes (bodies are JSON; errors are `{"error": {"message", "type"}}`):
- `POST /generate` `{"input_ids": [int], "sampling_params": {"temperature", "top_p",
  "top_k", "max_new_tokens", "stop_token_ids", "stop", "seed", "ignore_eos"}, "return_logprob",
  "rid", "stream": false, "gyre_execution", "gyre_kv_from": {"cell", "route"}}` -> `{"text": "", "output_ids", "meta_info":
  {"id", "finish_reason": {"type": "stop", "matched": id or stop string} | {"type": "length", "length":
  n} | {"type": "abort"}, "prompt_tokens", "completion_tokens", "cached_tokens",
  "output_token_logprobs": [[logprob, id, null], ...] (when return_logprob),
  "weight_version": "<int>", "gyre_versions": [[start, end, version], ...],
  "e2e_latency": seconds, "queue_time": seconds}}`. 400 on a malformed request, 500 when
  the engine cannot serve it (stop strings and no tokenizer in its checkpoint), 503 while
  not serving. Generation runs in a thread pool; when the client goes away the request is
  aborted in the engine. `gyre_kv_from` (the proxy's, for the first request of an execution
  the scheduler moved here from `cell` by route.updated `route`): the request waits, before
  it reaches the engine, until the hook `set_kv_hold` installed says the execution's KV
  blocks from that cell are imported or will not come (a bound of its own); without a hook
  it is ignored.
- `GET /health` 200 while serving, 503 otherwise. `GET /get_model_info` (with the engine's
  `counters`: `prefill_tokens`, `kv_imported_tokens`, `kv_dropped`, `Engine.counters`),
  `GET /get_weight_version`, `POST /abort_request {"rid", "abort_all"}`,
  `POST /flush_cache`, `POST /update_weights_from_disk {"model_path", "weight_version"}`
  -> `{"success", "message"}` (400 with success false when the checkpoint does not fit).

`set_serving(app, False)` makes a cell leaving rollout answer 503 on /generate and
/health; requests already in flight finish (the cell aborts them if it must). A released
engine (`Engine.release`) answers /generate with 503 as well.

`EmbeddedHost` is the embedded engine behind this server as a cell holds it
(gyre.serving.host.EngineHost); `engine` is the `Engine` itself.

Authentication (SGLang's `--api-key` convention, so one client serves both): every route
but `/health*` demands `Authorization: Bearer <token>`, the run's engine token, and
answers 401 `{"error": {"message", "type": "unauthorized"}}` without it. The proxy and the
cells hold the token; harnesses never do (gyre.env.sandbox refuses it in their
environment, and their network namespace does not reach the engine at all).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import threading
import uuid

import orjson
import structlog
from aiohttp import web

from gyre.serving.engine import (
    Engine, EngineError, EngineReleased, GenerateRequest, InvalidRequest, SamplingParams, WeightLoadError,
)
from gyre.serving.tokenizer import parse_stop
from handlers.metrics import ENGINE_PREFILL

log = structlog.get_logger(__name__)

ENGINE = web.AppKey("engine", Engine)
SERVING = web.AppKey("serving", dict)
POOL = web.AppKey("pool", concurrent.futures.ThreadPoolExecutor)
API_KEY = web.AppKey("api_key", bytes)
KV_HOLD = web.AppKey("kv_hold", dict)
OPEN_PREFIX = "/health"
"""Routes answered without the token (liveness probes), as SGLang exempts them."""

DISCONNECT_POLL_S = 0.25  # how often a waiting /generate checks whether its client left


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(status: int, message: str, kind: str) -> web.Response:
    return _json({"error": {"message": message, "type": kind}}, status=status)


def set_serving(app: web.Application, serving: bool) -> None:
    """Turns /generate and /health on (True) or to 503 (False)."""
    app[SERVING]["on"] = bool(serving)
    log.info("engine.server.serving", serving=bool(serving))


def is_serving(app: web.Application) -> bool:
    return app[SERVING]["on"]


def set_kv_hold(app: web.Application, hold) -> None:
    """`await hold(execution, cell, route)` runs before a request that names the cell its
    execution's KV blocks come from (`gyre_kv_from`); it returns once they are imported or
    will not come."""
    app[KV_HOLD]["fn"] = hold


def parse_kv_from(body: dict) -> tuple[str, int] | None:
    """(cell, route seq) of a request's `gyre_kv_from`, None when absent. Raises InvalidRequest."""
    kv = body.get("gyre_kv_from")
    if kv is None:
        return None
    if not (isinstance(kv, dict) and isinstance(kv.get("cell"), str) and type(kv.get("route")) is int):
        raise InvalidRequest("gyre_kv_from must be {\"cell\": string, \"route\": integer}")
    return kv["cell"], kv["route"]


async def _body(request: web.Request) -> dict:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(f"body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object")
    return body


def _int_list(value: object, field: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise InvalidRequest(f"{field} must be a list of integers")
    return tuple(value)


def parse_generate(body: dict) -> tuple[GenerateRequest, bool]:
    """SGLang /generate body -> (GenerateRequest, return_logprob). Raises InvalidRequest."""
    if "input_ids" not in body:
        raise InvalidRequest("input_ids is required (this engine takes token ids, not text)")
    if body.get("stream"):
        raise InvalidRequest("stream=true is not supported by the embedded engine")
    ids = _int_list(body["input_ids"], "input_ids")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise InvalidRequest("sampling_params must be an object")
    try:
        sampling = SamplingParams(
            temperature=float(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)),
            top_k=int(sp.get("top_k", -1)),
            max_new_tokens=int(sp.get("max_new_tokens", 128)),
            stop_token_ids=_int_list(sp.get("stop_token_ids") or [], "sampling_params.stop_token_ids"),
            stop=parse_stop(sp.get("stop"), "sampling_params.stop"),
            seed=None if sp.get("seed") is None else int(sp["seed"]),
            ignore_eos=bool(sp.get("ignore_eos", False)),
        )
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"bad sampling_params: {e}") from None
    rid = body.get("rid") or uuid.uuid4().hex
    execution = body.get("gyre_execution")
    if not isinstance(rid, str) or (execution is not None and not isinstance(execution, str)):
        raise InvalidRequest("rid and gyre_execution must be strings")
    return GenerateRequest(rid=rid, input_ids=ids, sampling=sampling, execution=execution), bool(body.get("return_logprob"))


def _finish_reason(res) -> dict:
    if res.finish == "stop":
        return {"type": "stop", "matched": res.matched_stop}
    if res.finish == "length":
        return {"type": "length", "length": len(res.output_ids)}
    return {"type": "abort", "message": "aborted"}


def render_generate(res, return_logprob: bool) -> dict:
    """GenerateResult -> SGLang /generate response body."""
    meta = {
        "id": res.rid,
        "finish_reason": _finish_reason(res),
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": len(res.output_ids),
        "cached_tokens": res.cached_tokens,
        "weight_version": str(res.weight_version),
        "gyre_versions": [list(span) for span in res.versions],
        "e2e_latency": res.e2e_latency_s,
        "queue_time": res.queue_s,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(res.logprobs, res.output_ids)]
    return {"text": "", "output_ids": list(res.output_ids), "meta_info": meta}


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def generate(request: web.Request) -> web.Response:
    app = request.app
    if not is_serving(app):
        return _error(503, "engine is not serving (cell is not in rollout)", "unavailable")
    try:
        body = await _body(request)
        req, return_logprob = parse_generate(body)
        kv_from = parse_kv_from(body)
    except InvalidRequest as e:
        return _error(400, str(e), "invalid_request")
    hold = app[KV_HOLD].get("fn")
    if kv_from is not None and hold is not None and req.execution is not None:
        await hold(req.execution, *kv_from)
        if not is_serving(app):
            return _error(503, "engine is not serving (cell is not in rollout)", "unavailable")
    engine = app[ENGINE]
    cancel = threading.Event()
    fut = asyncio.get_running_loop().run_in_executor(app[POOL], engine.generate, req, cancel)
    try:
        # aiohttp does not cancel handlers on disconnect by default, so watch the socket
        while True:
            done, _ = await asyncio.wait({fut}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if _client_gone(request) and not cancel.is_set():
                log.info("engine.call.client_gone", rid=req.rid, execution=req.execution)
                cancel.set()
        res = fut.result()
    except asyncio.CancelledError:
        cancel.set()
        raise
    except InvalidRequest as e:
        return _error(400, str(e), type(e).__name__)
    except EngineReleased as e:
        return _error(503, str(e), "unavailable")
    except EngineError as e:
        return _error(500, str(e), type(e).__name__)
    ENGINE_PREFILL.inc(res.prefilled_tokens)
    return _json(render_generate(res, return_logprob))


async def health(request: web.Request) -> web.Response:
    if not is_serving(request.app):
        return _error(503, "engine is not serving", "unavailable")
    return _json({"status": "ok"})


async def model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    cfg = engine.cfg
    return _json({
        "model_path": cfg.model_dir,
        "tokenizer_path": None,
        "is_generation": True,
        "weight_version": str(engine.weight_version),
        "vocab_size": engine.vocab_size,
        "max_context_tokens": cfg.max_context_tokens,
        "max_completion_tokens": cfg.max_completion_tokens,
        "stop_token_ids": list(cfg.stop_ids),
        "serving": is_serving(request.app),
        "in_flight": len(engine.in_flight()),
        "counters": engine.counters(),
    })


async def weight_version(request: web.Request) -> web.Response:
    return _json({"weight_version": str(request.app[ENGINE].weight_version)})


async def abort_request(request: web.Request) -> web.Response:
    try:
        body = await _body(request)
    except InvalidRequest as e:
        return _error(400, str(e), "invalid_request")
    engine = request.app[ENGINE]
    if body.get("abort_all"):
        return _json({"success": True, "aborted": engine.abort_all()})
    rid = body.get("rid")
    if not isinstance(rid, str):
        return _error(400, "rid (string) or abort_all is required", "invalid_request")
    return _json({"success": True, "aborted": int(engine.abort(rid))})


async def flush_cache(request: web.Request) -> web.Response:
    n = request.app[ENGINE].flush_cache()
    return _json({"success": True, "message": f"dropped {n} prefix caches"})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    try:
        body = await _body(request)
        path, version = body.get("model_path"), body.get("weight_version")
        if not isinstance(path, str) or not path:
            raise InvalidRequest("model_path (string) is required")
        try:
            version = int(version)
        except (TypeError, ValueError):
            raise InvalidRequest(f"weight_version must be an integer policy version, got {version!r}") from None
    except InvalidRequest as e:
        return _json({"success": False, "message": str(e)}, status=400)
    engine = request.app[ENGINE]
    try:
        await asyncio.get_running_loop().run_in_executor(request.app[POOL], engine.load_weights, path, version)
    except WeightLoadError as e:
        return _json({"success": False, "message": str(e)}, status=400)
    return _json({"success": True, "message": f"loaded {path} as policy version {version}", "num_paused_requests": 0})


@web.middleware
async def _auth(request: web.Request, handler):
    """401 unless the request carries the engine's bearer token (module docstring)."""
    if request.path.startswith(OPEN_PREFIX):
        return await handler(request)
    given = request.headers.get("Authorization", "").encode("utf-8", "surrogatepass")
    if not hmac.compare_digest(given, b"Bearer " + request.app[API_KEY]):
        log.warning("engine.server.unauthorized", path=request.path, remote=request.remote)
        response = _error(401, "Unauthorized: this engine demands its run's bearer token "
                               "(Authorization: Bearer <token>)", "unauthorized")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response
    return await handler(request)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(e.status, e.reason, "http_error")
    except Exception as e:  # a bug: still answer JSON so clients can attach it
        log.exception("engine.server.error", path=request.path)
        return _error(500, f"{type(e).__name__}: {e}", "internal_error")


def make_app(engine: Engine, *, api_key: str, max_workers: int = 256) -> web.Application:
    """The aiohttp app serving `engine`. api_key: the bearer token every route but
    `/health*` demands (non-empty; raises ValueError otherwise). max_workers bounds
    concurrent /generate calls (each holds a worker thread while its decode steps
    interleave with the others)."""
    if not api_key:
        raise ValueError("the engine server demands a bearer token: api_key must be non-empty")
    app = web.Application(middlewares=[_errors, _auth], client_max_size=256 * 1024 * 1024)
    app[API_KEY] = api_key.encode("utf-8")
    app[ENGINE] = engine
    app[SERVING] = {"on": True}
    app[KV_HOLD] = {}
    app[POOL] = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="engine")

    async def _shutdown(app: web.Application) -> None:
        app[ENGINE].abort_all()
        app[POOL].shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(_shutdown)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/get_weight_version", weight_version)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_route("*", "/flush_cache", flush_cache)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    return app


async def serve(engine: Engine, host: str = "127.0.0.1", port: int = 0, *,
                api_key: str) -> tuple[web.Application, web.AppRunner, str]:
    """Starts the app on host:port (0 = a free port), demanding `api_key` (`make_app`).
    Returns (app, runner, base url); stop it with `await runner.cleanup()`."""
    app = make_app(engine, api_key=api_key)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]  # the real port when port == 0
    url = f"http://{bound_host}:{bound_port}"
    log.info("engine.server.started", url=url, model_dir=engine.cfg.model_dir)
    return app, runner, url


class EmbeddedHost:
    """The embedded engine and its server, as a cell holds them (gyre.serving.host.EngineHost).
    api_key: the run's engine token the server demands."""

    def __init__(self, engine: Engine, *, api_key: str) -> None:
        self.engine = engine
        self.api_key = api_key
        self.url = ""
        self._app: web.Application | None = None
        self._runner: web.AppRunner | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._app, self._runner, self.url = await serve(self.engine, host=host, port=port, api_key=self.api_key)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def set_serving(self, on: bool) -> None:
        assert self._app is not None, "start() the host first"
        set_serving(self._app, on)

    @property
    def serving(self) -> bool:
        return self._app is not None and is_serving(self._app)

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def released(self) -> bool:
        return self.engine.released

    def drain(self, timeout_s: float = 10.0) -> bool:
        return self.engine.drain(timeout_s)

    def release(self) -> None:
        self.engine.release()

    def load_tensors(self, tensors, version: int) -> None:
        self.engine.load_tensors(tensors, version)

    def load_weights(self, path, version: int) -> None:
        self.engine.load_weights(path, version)

    def export_kv(self, execution: str, block_tokens: int = 64):
        return self.engine.export_kv(execution, block_tokens)

    def import_kv(self, execution: str, blocks) -> bool:
        return self.engine.import_kv(execution, blocks)

    def set_kv_hold(self, hold) -> None:
        assert self._app is not None, "start() the host first"
        set_kv_hold(self._app, hold)

    def counters(self) -> dict[str, int]:
        return self.engine.counters()
