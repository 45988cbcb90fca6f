"""The processes `gyre bench proxy` (handlers/bench/proxy.py) starts besides nats-server, each
as `python -m handlers.bench.proxy_servers _engine|_passthrough|_proxy ...` (`main`):
- `_engine` (`serve_engine`): the instant engine, SGLang's `/generate` answered at once with
  a fixed completion and its log-probs. It is the baseline of the bench's figures: it does
  no other work.
- `_passthrough` (`serve_passthrough`): the floor, a bare aiohttp server that forwards
  `/generate` to the engine and answers the engine's bytes.
- `_proxy` (`serve_proxy`): `handlers.proxy.daemon.run` with its production defaults (but
  `check_drift`), JSON logs on stderr.
Each serves on 127.0.0.1 at a free port, writes its URL to `--url-file` (the proxy writes
its own JSON url file) and runs until SIGTERM or SIGINT. `_wait_url` is the bench's side:
the URL, or RuntimeError when the process exits first or does not start within its bound.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from handlers.daemon import run_async

SERVERS = ("_engine", "_passthrough", "_proxy")


# --------------------------------------------------------------------------- the servers (each its own process)


def serve_engine(url_file: str, completion_ids: list[int], seed: int = 0) -> None:
    """Serve `/generate` answering `completion_ids` at once (SGLang native wire format)."""
    from aiohttp import web

    rng = random.Random(seed)
    logprobs = [[round(-rng.expovariate(2.0) - 1e-4, 6), i, None] for i in completion_ids]
    from gyre.serving.tokenizer import IM_END

    async def generate(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        n = len(body["input_ids"])
        meta = {"id": body.get("rid") or "", "finish_reason": {"type": "stop", "matched": IM_END}, "prompt_tokens": n,
                "completion_tokens": len(completion_ids), "cached_tokens": 0, "output_token_logprobs": logprobs,
                "weight_version": "0", "gyre_versions": [[0, len(completion_ids), 0]]}
        return web.Response(body=orjson.dumps({"text": "", "output_ids": completion_ids, "meta_info": meta}),
                            content_type="application/json")

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", ok)
    app.router.add_get("/health", ok)
    run_async(_serve_until_signalled(app, url_file))


def serve_passthrough(url_file: str, engine_url: str) -> None:
    """The floor: an aiohttp server whose `/generate` forwards the body to the engine's
    with an aiohttp client (`make_session`, the proxy's session for its other engine
    requests; the proxy's `/generate` leg is leaner, `handlers.engines.connections`: the floor is
    kept as it was, a gauge of the machine's speed comparable across versions) and answers
    the engine's bytes."""
    from aiohttp import web

    from handlers.engines.client import make_session

    async def serve() -> None:
        session = make_session()  # inside the running loop

        async def generate(request: web.Request) -> web.Response:
            body = await request.read()
            async with session.post(engine_url + "/generate", data=body,
                                    headers={"Content-Type": "application/json"}) as resp:
                return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")

        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/generate", generate)
        try:
            await _serve_until_signalled(app, url_file)
        finally:
            await session.close()

    run_async(serve())


def serve_proxy(url_file: str, engine_url: str, nats_url: str, nats_token: str | None, run: str,
                check_drift: bool = True) -> None:
    """`handlers.proxy.daemon.run` with production defaults (but `check_drift`), JSON logs on
    stderr; as a run's proxy, its spill file and call journal beside `url_file`."""
    from handlers.bench.proxy_load import SECRET
    from handlers.daemon import configure_logging
    from handlers.proxy.daemon import Config, run as proxy_run

    configure_logging("proxy", json_lines=True)
    cfg = Config(run=run, key_secret=SECRET, nats_url=nats_url, nats_token=nats_token, engine_url=engine_url,
                 url_file=url_file, shutdown_grace_s=30.0, check_drift=check_drift,
                 spill_file=str(Path(url_file).with_name("proxy-unpublished.jsonl")),
                 journal=str(Path(url_file).with_name("proxy-journal")))

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await proxy_run(cfg, stop)

    run_async(main())


async def _serve_until_signalled(app: Any, url_file: str) -> None:
    """Serve `app` on 127.0.0.1 (a free port, its URL written to `url_file`) until SIGTERM
    or SIGINT."""
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    _write_url(url_file, f"http://127.0.0.1:{runner.addresses[0][1]}")
    await _until_signalled()
    await runner.cleanup()


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def _write_url(path: str, url: str) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(url)
    tmp.replace(path)


def _wait_url(path: Path, proc: subprocess.Popen, what: str, bound_s: float = 120.0) -> str:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if path.exists():
            text = path.read_text()
            return orjson.loads(text)["url"] if text.startswith("{") else text
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before serving")
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not start within {bound_s}s")


def main(argv: list[str] | None = None) -> int:
    """Serve one of `SERVERS` (argv[0]) until signalled; a usage error exits 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_engine":
        p = argparse.ArgumentParser(prog="python -m handlers.bench.proxy_servers _engine")
        p.add_argument("--url-file", required=True)
        p.add_argument("--ids", required=True)
        a = p.parse_args(argv[1:])
        serve_engine(a.url_file, [int(x) for x in a.ids.split(",")])
        return 0
    if argv and argv[0] == "_passthrough":
        p = argparse.ArgumentParser(prog="python -m handlers.bench.proxy_servers _passthrough")
        p.add_argument("--url-file", required=True)
        p.add_argument("--engine-url", required=True)
        a = p.parse_args(argv[1:])
        serve_passthrough(a.url_file, a.engine_url)
        return 0
    if argv and argv[0] == "_proxy":
        p = argparse.ArgumentParser(prog="python -m handlers.bench.proxy_servers _proxy")
        for name in ("--url-file", "--engine-url", "--nats-url", "--run"):
            p.add_argument(name, required=True)
        p.add_argument("--no-drift-check", action="store_true")
        a = p.parse_args(argv[1:])
        serve_proxy(a.url_file, a.engine_url, a.nats_url, os.environ.get("GYRE_BENCH_NATS_TOKEN") or None, a.run,
                    check_drift=not a.no_drift_check)
        return 0
    p = argparse.ArgumentParser(prog="python -m handlers.bench.proxy_servers")
    p.error(f"the first argument must be one of {', '.join(SERVERS)}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
