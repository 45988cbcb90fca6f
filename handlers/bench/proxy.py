"""`gyre bench proxy`: what the proxy adds to a call, and how many calls one proxy process
carries, with every `call.completed` stored (BENCHMARKS.md "gyre bench proxy").

Processes: a private nats-server (JetStream), an instant engine (`_engine`: SGLang's
`/generate` answered at once with a fixed 20-token completion — a bash tool call in
Qwen3's format ending with `<|im_end|>` — and its log-probs), one proxy process (`_proxy`:
`handlers.proxy.daemon.run` with its production defaults: publishing with PubAck awaited, drift
check on, JSON logs to a file), a bare aiohttp pass-through (`_passthrough`: the floor
below) and this process as the load generator.

Workload: realistic agent turns. An execution starts from a ~1,000-token system prompt,
one bash tool and a task; each call's answer (the tool call the proxy parsed) is sent
back in the history with a ~200-token tool result; after 50 calls the execution ends
(`execution.finished` is published, as the runner does, so the proxy frees its store) and
a new one takes its place. Executions start at a uniformly random age in [0, 50) reached
by an unmeasured warm-up (the measured window starts once its calls are stored), so
histories are in their steady state from the first measured call; a variant's later runs
continue the executions where the previous run left them (no second warm-up).
Variants: `chat` / `chat_stream` (OpenAI Chat Completions) and `messages` /
`messages_stream` (Anthropic Messages; skipped with a reason while the proxy has no
`/v1/messages`) by default; `responses` (OpenAI Responses as Codex CLI sends it:
`instructions`, input items with `function_call` / `function_call_output`, always
streamed) when named in `--variants` (not a BENCHMARKS.md key).

Per variant:
- latency: `executions` (256) simulated executions each send a call, wait for the whole
  answer, think for an exponential time (mean `think_s`, 1 s), for `duration_s` (10 s);
  the same load once through the proxy and once straight to the engine as the equivalent
  pre-tokenised `/generate` call (the prompt ids of the same history). Added latency =
  proxy-path percentile − direct percentile (p50, p99), in ms.
- throughput: closed loop, `concurrency` (64) executions, no think time, `duration_s`;
  calls answered per second through the one proxy process.
- CPU: the proxy process's user + system CPU time in each measured window divided by the
  calls answered in it (`/proc/<pid>/stat`, clock-tick resolution; it includes the
  window's background work: publishes, failed calls): `proxy_cpu_ms_per_call` in the
  latency run (≈ 250 calls/s with the defaults, the process sleeping between events) and
  `proxy_cpu_ms_per_call_saturated` in the throughput run. Less noisy than latency on a
  shared machine, and what the latency depends on: the one event loop queues calls
  behind each other's work.
- stored: after each run the CALLS stream must hold one `call.completed` per answered
  call (the proxy publishes each with its PubAck awaited); `unstored` counts the missing
  ones after a bounded drain, `drain_s` how long the stream took to catch up.

Floor (`floor`): the same latency pair with a bare aiohttp pass-through in the proxy's
place (an aiohttp server that forwards the pre-tokenised `/generate` body to the engine
with an aiohttp client session (`make_session`; kept as it was when the proxy's
`/generate` leg moved to `handlers.engines.connections`, so floors stay comparable), and returns the engine's
bytes): what one more HTTP hop and a third Python process cost on this machine before
gyre does any work. Measured `reps` times, pass-through and direct alternating;
`added_latency_ms_*` as for a variant, and `calls_per_s` from a closed loop of
`concurrency` through the pass-through: the most a process that does no work carries
with this load generator here (BENCHMARKS.md expects ~4,000 of a bare pass-through).

Repetitions: `reps` (3) per variant, each a latency pair (proxy and direct, alternating
which runs first) and a throughput run; the keys hold medians over repetitions with
`_min`/`_max` beside (BENCHMARKS.md preamble).

Output (`--json PATH`, also printed): {"chat": {...}, "chat_stream": {...}, "messages":
{...}, "messages_stream": {...}, "floor": {...}, "machine": {...}, "config": {...}}; each
variant holds `added_latency_ms_p50`, `added_latency_ms_p90`, `added_latency_ms_p99`,
`calls_per_s`, `proxy_cpu_ms_per_call`, `proxy_cpu_ms_per_call_saturated` (medians, with
`_min`/`_max`; null without /proc or under `--profile`; `floor` holds the latency keys
and `calls_per_s`), `errors` (non-2xx answers or broken connections, on either path), `unstored`, `settle` (per measured
proxy run: seconds until every call answered so far was stored — after the warm-up for a
variant's first run, after the previous run otherwise — and whether that wait timed out),
and `reps`: per repetition the raw percentiles (`proxy_latency_ms`, `direct_latency_ms`:
p50/p90/p99) and call counts; a skipped variant holds `skipped` and null figures.
Targets: added p50 ≤ 1 ms, p99 ≤ 5 ms; ≥ 1,000 calls/s.

`--smoke` runs the same code paths for about a second each (CI). `--profile PATH` runs
the proxy under cProfile and writes its stats there.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.metadata
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
from handlers.daemon import run_async
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import structlog

log = structlog.get_logger()

CALLS_PER_EXECUTION = 50
COMPLETION_TOKENS = 20
TOOL_RESULT_TOKENS = 200
SYSTEM_TOKENS = 1000
VARIANTS = ("chat", "chat_stream", "messages", "messages_stream")
EXTRA_VARIANTS = ("responses",)
"""Run only when named (`--variants`): not among BENCHMARKS.md's keys."""
SECRET = b"gyre-bench-proxy-secret-0123456789"
MODEL = "gyre"
BASH_DESCRIPTION = "Run a bash command in the workspace and return its output."
BASH_SCHEMA = {"type": "object", "properties": {"command": {"type": "string", "description": "the command"}},
               "required": ["command"]}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """Bench settings (BENCHMARKS.md defaults). Durations in seconds."""

    executions: int = 256
    think_s: float = 1.0
    duration_s: float = 10.0
    concurrency: int = 64
    variants: tuple[str, ...] = VARIANTS
    seed: int = 0
    profile: str = ""
    check_drift: bool = True
    reps: int = 3

    def __post_init__(self) -> None:
        if self.executions < 1 or self.concurrency < 1 or self.reps < 1:
            raise ValueError("executions, concurrency and reps must be >= 1")
        if self.duration_s <= 0 or self.think_s <= 0:
            raise ValueError("duration_s and think_s must be > 0")
        unknown = set(self.variants) - set(VARIANTS) - set(EXTRA_VARIANTS)
        if unknown:
            raise ValueError(f"unknown variants {sorted(unknown)}; known: {VARIANTS + EXTRA_VARIANTS}")


# --------------------------------------------------------------------------- workload (pure)


def _words(rng: random.Random, n: int) -> str:
    vocab = ("the", "agent", "workspace", "file", "test", "function", "returns", "value", "command", "output",
             "must", "should", "never", "always", "edit", "read", "python", "module", "error", "check", "run",
             "repository", "change", "minimal", "careful", "result", "patch", "line", "before", "after")
    return " ".join(rng.choice(vocab) for _ in range(n))


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    """Texts of the simulated agent: system prompt, task, tool results (one per call
    index), and the engine's fixed completion (ids and text)."""

    system: str
    task: str
    results: tuple[str, ...]
    completion_ids: tuple[int, ...]
    completion_text: str
    command: str

    @property
    def arguments(self) -> str:
        """The tool call's arguments as the proxy emits them (`gyre.serving.chat.parse_completion` of
        the completion): what a harness echoes back, so the direct path's prompts are the ids
        the proxy sends the engine."""
        return json.dumps({"command": self.command})

    @classmethod
    def build(cls, tok: Any, seed: int = 0) -> "Workload":
        rng = random.Random(seed)
        n_tok = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
        system = "You are a careful software engineering agent. " + _words(rng, 40) + ".\n"
        while n_tok(system) < SYSTEM_TOKENS:
            system += _words(rng, 30) + ".\n"
        task = "Fix the failing test in src/stats.py: mean() must return 0.0 for an empty list."
        results = []
        for i in range(CALLS_PER_EXECUTION):
            lines = []
            while n_tok("\n".join(lines)) < TOOL_RESULT_TOKENS:
                lines.append(f"-rw-r--r-- 1 agent agent {rng.randint(100, 99999):>5} Nov {rng.randint(1, 30):>2} "
                             f"src/mod_{i}_{len(lines)}.py  # {_words(rng, 3)}")
            results.append("\n".join(lines))
        from gyre.serving.tokenizer import IM_END

        command = "ls src"  # 19 ids with the Qwen3 tokenizer, + <|im_end|> = 20
        text = f'<tool_call>\n{{"name": "bash", "arguments": {{"command": "{command}"}}}}\n</tool_call>'
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) + 1 != COMPLETION_TOKENS:
            raise ValueError(f"the fixed completion is {len(ids) + 1} tokens with this tokenizer, not {COMPLETION_TOKENS}")
        return cls(system=system, task=task, results=tuple(results), completion_ids=tuple(ids) + (IM_END,),
                   completion_text=text, command=command)


def chat_tools() -> list[dict]:
    return [{"type": "function", "function": {"name": "bash", "description": BASH_DESCRIPTION,
                                              "parameters": BASH_SCHEMA}}]


def anthropic_tools() -> list[dict]:
    return [{"name": "bash", "description": BASH_DESCRIPTION, "input_schema": BASH_SCHEMA}]


def responses_tools() -> list[dict]:
    return [{"type": "function", "name": "bash", "description": BASH_DESCRIPTION, "strict": False,
             "parameters": BASH_SCHEMA}]


def direct_prompts(tok: Any, w: Workload) -> list[list[int]]:
    """Prompt ids of call k (k = 0..49) of an execution: the pre-tokenised equivalent of
    the k-th request (gyre.serving.chat.render of the same history)."""
    from gyre.serving.chat import render

    messages: list[dict] = [{"role": "system", "content": w.system}, {"role": "user", "content": w.task}]
    out = []
    for k in range(CALLS_PER_EXECUTION):
        text = render(tok, messages, chat_tools(), add_generation_prompt=True)
        out.append(list(tok(text, add_special_tokens=False)["input_ids"]))
        cid = f"call_{k}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": "bash",
                                                         "arguments": w.arguments}}]})
        messages.append({"role": "tool", "tool_call_id": cid, "content": w.results[k]})
    return out


# --------------------------------------------------------------------------- the simulated harness


class Conversation:
    """One simulated execution's history in one API; `body()` is its next request and
    `answer(raw)` appends the proxy's answer (parsed as a harness does) and a tool result.
    `fast_forward(age)` gives it the history of `age` earlier calls at once (its next call
    is then new to the proxy: a branch, tokenised whole, as after a proxy restart)."""

    def __init__(self, variant: str, w: Workload, execution: str):
        self.variant = variant
        self.api = "messages" if variant.startswith("messages") else "responses" if variant == "responses" else "chat"
        self.stream = variant.endswith("_stream") or self.api == "responses"  # Codex always streams
        self.w = w
        self.execution = execution
        self.calls = 0
        if self.api == "chat":
            self.messages: list[dict] = [{"role": "system", "content": w.system}, {"role": "user", "content": w.task}]
        elif self.api == "responses":  # input items; the system prompt goes in `instructions`
            self.messages = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": w.task}]}]
        else:
            self.messages = [{"role": "user", "content": w.task}]

    def fast_forward(self, age: int) -> None:
        args = {"command": self.w.command}
        for k in range(age):
            cid = f"call_ff{k}"
            result = self.w.results[k]
            if self.api == "chat":
                self.messages.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": cid, "type": "function", "function": {"name": "bash", "arguments": self.w.arguments}}]})
                self.messages.append({"role": "tool", "tool_call_id": cid, "content": result})
            elif self.api == "responses":
                self.messages.append({"type": "function_call", "name": "bash", "arguments": self.w.arguments,
                                      "call_id": cid})
                self.messages.append({"type": "function_call_output", "call_id": cid, "output": result})
            else:
                self.messages.append({"role": "assistant", "content": [
                    {"type": "tool_use", "id": cid, "name": "bash", "input": args}]})
                self.messages.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": cid, "content": result}]})
        self.calls = age

    def body(self) -> bytes:
        if self.api == "chat":
            body: dict = {"model": MODEL, "messages": self.messages, "tools": chat_tools(), "max_tokens": 1024}
            if self.stream:
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
        elif self.api == "responses":
            body = {"model": MODEL, "instructions": self.w.system, "input": self.messages, "tools": responses_tools(),
                    "tool_choice": "auto", "parallel_tool_calls": False, "store": False, "stream": True,
                    "include": [], "prompt_cache_key": self.execution}
        else:
            body = {"model": MODEL, "max_tokens": 1024, "system": self.w.system, "messages": self.messages,
                    "tools": anthropic_tools()}
            if self.stream:
                body["stream"] = True
        return orjson.dumps(body)

    def answer(self, raw: bytes) -> None:
        result = self.w.results[self.calls % CALLS_PER_EXECUTION]
        if self.api == "chat":
            msg = _chat_stream_message(raw) if self.stream else orjson.loads(raw)["choices"][0]["message"]
            calls = msg.get("tool_calls") or []
            turn = {"role": "assistant", "content": msg.get("content")}
            if calls:
                turn["tool_calls"] = calls
            self.messages.append(turn)
            if calls:
                for tc in calls:
                    self.messages.append({"role": "tool", "tool_call_id": tc["id"], "content": result})
            else:
                self.messages.append({"role": "user", "content": result})
        elif self.api == "responses":
            items = _responses_stream_items(raw)
            calls = [i for i in items if i.get("type") == "function_call"]
            for item in items:  # echoed back as Codex does: messages and calls, reasoning dropped
                if item.get("type") == "message":
                    self.messages.append({"type": "message", "role": "assistant", "content": item["content"]})
                elif item.get("type") == "function_call":
                    self.messages.append({k: item[k] for k in ("type", "name", "arguments", "call_id")})
            for item in calls:
                self.messages.append({"type": "function_call_output", "call_id": item["call_id"], "output": result})
            if not calls:
                self.messages.append({"type": "message", "role": "user",
                                      "content": [{"type": "input_text", "text": result}]})
        else:
            blocks = _messages_stream_blocks(raw) if self.stream else orjson.loads(raw)["content"]
            self.messages.append({"role": "assistant", "content": blocks})
            uses = [b for b in blocks if b.get("type") == "tool_use"]
            if uses:
                self.messages.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": b["id"], "content": result} for b in uses]})
            else:
                self.messages.append({"role": "user", "content": result})
        self.calls += 1


def _sse_data(raw: bytes) -> list[Any]:
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            out.append(orjson.loads(line[6:]))
    return out


def _chat_stream_message(raw: bytes) -> dict:
    content: list[str] = []
    calls: dict[int, dict] = {}
    for chunk in _sse_data(raw):
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                content.append(delta["content"])
            for tc in delta.get("tool_calls") or ():
                slot = calls.setdefault(tc["index"], {"id": "", "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                if tc.get("id"):
                    slot["id"] = tc["id"]
                fn = tc.get("function") or {}
                if fn.get("name"):
                    slot["function"]["name"] = fn["name"]
                slot["function"]["arguments"] += fn.get("arguments") or ""
    msg: dict = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg


def _responses_stream_items(raw: bytes) -> list[dict]:
    """The output items of a Responses stream (`response.output_item.done`), in order. A
    stream that ends otherwise than with `response.completed` raises ValueError."""
    events = _sse_data(raw)
    if not events or events[-1].get("type") != "response.completed":
        raise ValueError(f"a Responses stream ended with {events[-1].get('type') if events else 'nothing'}")
    done = [e for e in events if e.get("type") == "response.output_item.done"]
    return [e["item"] for e in sorted(done, key=lambda e: e["output_index"])]


def _messages_stream_blocks(raw: bytes) -> list[dict]:
    blocks: dict[int, dict] = {}
    partial: dict[int, list[str]] = {}
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: "):
            continue
        ev = orjson.loads(line[6:])
        kind = ev.get("type")
        if kind == "content_block_start":
            blocks[ev["index"]] = dict(ev["content_block"])
            partial[ev["index"]] = []
        elif kind == "content_block_delta":
            d = ev["delta"]
            if d.get("type") == "text_delta":
                blocks[ev["index"]]["text"] = blocks[ev["index"]].get("text", "") + d["text"]
            elif d.get("type") == "input_json_delta":
                partial[ev["index"]].append(d["partial_json"])
        elif kind == "content_block_stop":
            b = blocks[ev["index"]]
            if b.get("type") == "tool_use":
                b["input"] = orjson.loads("".join(partial[ev["index"]]) or b"{}")
    return [blocks[i] for i in sorted(blocks)]


# --------------------------------------------------------------------------- instant engine (own process)


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
    """`handlers.proxy.daemon.run` with production defaults (but `check_drift`), JSON logs on stderr."""
    from handlers.daemon import configure_logging
    from handlers.proxy.daemon import Config, run as proxy_run

    configure_logging("proxy", json_lines=True)
    cfg = Config(run=run, key_secret=SECRET, nats_url=nats_url, nats_token=nats_token, engine_url=engine_url,
                 url_file=url_file, shutdown_grace_s=30.0, check_drift=check_drift)

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


# --------------------------------------------------------------------------- load generation


@dataclasses.dataclass
class RunStats:
    latencies: list[float] = dataclasses.field(default_factory=list)
    errors: int = 0
    error_samples: list[str] = dataclasses.field(default_factory=list)
    calls: int = 0
    window_s: float = 0.0
    proxy_cpu_s: float | None = None  # the proxy process's CPU seconds in the window (None: not measured)


class Load:
    """The load generator: simulated executions against the proxy or the engine."""

    def __init__(self, session: Any, proxy_url: str, engine_url: str, w: Workload, prompts: list[list[int]],
                 bus: Any, run: str):
        self.session = session
        self.proxy_url = proxy_url
        self.engine_url = engine_url
        self.w = w
        self.direct_bodies = [orjson.dumps({"input_ids": p, "sampling_params": {
            "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 1024}, "return_logprob": True,
            "rid": f"direct-{k}", "stream": False, "gyre_execution": "direct"}) for k, p in enumerate(prompts)]
        self.bus = bus
        self.run = run
        self.answered = 0  # calls answered by the proxy (published events expected)
        self.stored_offset = 0  # calls stored before this load's first (the bench's probe)
        self.settles: list[dict] = []  # per measured run: how long until every answered call was stored
        self._finishing: set[asyncio.Task] = set()
        self.pool: list[Conversation] = []  # the variant's live executions, reused across its runs
        self.proxy_pid: int | None = None  # whose CPU time the proxy runs record (`process_cpu_s`)

    def new_conversation(self, variant: str) -> Conversation:
        return Conversation(variant, self.w, f"b{uuid.uuid4().hex[:12]}")

    def _headers(self, conv: Conversation) -> dict[str, str]:
        from gyre.env.harness import execution_key

        key = execution_key(SECRET, conv.execution)
        if conv.api in ("chat", "responses"):
            return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        return {"x-api-key": key, "anthropic-version": "2023-06-01", "Content-Type": "application/json"}

    async def _post(self, url: str, data: bytes, headers: dict[str, str], stats: RunStats | None) -> tuple[bytes, float]:
        """POST and read the answer: (body, seconds). A non-200 answer or a broken
        connection is counted in `stats` (errors, a few samples) and raises _CallFailed."""
        t0 = time.perf_counter()
        try:
            async with self.session.post(url, data=data, headers=headers) as resp:
                raw = await resp.read()
                status = resp.status
        except aiohttp.ClientError as exc:
            raw, status = repr(exc).encode(), 0
        dt = time.perf_counter() - t0
        if status != 200:
            if stats is not None:
                stats.errors += 1
                if len(stats.error_samples) < 3:
                    stats.error_samples.append(f"{status} {raw[:300]!r}")
            raise _CallFailed(status)
        return raw, dt

    async def proxy_call(self, conv: Conversation, stats: RunStats | None) -> None:
        path = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}.get(conv.api, "/v1/messages")
        raw, dt = await self._post(self.proxy_url + path, conv.body(), self._headers(conv), stats)
        self.answered += 1
        try:
            conv.answer(raw)
        except ValueError as exc:  # a 200 the harness cannot use (a Responses stream that failed)
            if stats is not None:
                stats.errors += 1
                if len(stats.error_samples) < 3:
                    stats.error_samples.append(f"200 {exc}: {raw[-300:]!r}")
            raise _CallFailed(200) from None
        if stats is not None:
            stats.latencies.append(dt)

    async def direct_call(self, k: int, stats: RunStats | None, url: str) -> None:
        raw, dt = await self._post(url + "/generate", self.direct_bodies[k], {"Content-Type": "application/json"},
                                   stats)
        orjson.loads(raw)
        if stats is not None:
            stats.latencies.append(dt)

    def finish_pool(self) -> None:
        """End the variant's live executions (execution.finished for each)."""
        for conv in self.pool:
            self.finished(conv)
        self.pool = []

    def finished(self, conv: Conversation) -> None:
        """Publish execution.finished (the runner would), so the proxy frees its store."""
        if self.bus is None:
            return
        import schemas
        from schemas import ids

        info = schemas.ExecutionInfo(execution=conv.execution, task="bench", group="g", step=0, harness="bench",
                                     group_size=1, step_groups=1)
        event = schemas.ExecutionFinished(event_id=ids.finished(self.run, conv.execution), info=info, status="ok",
                                          workspace="/nonexistent", exit_code=0, duration_s=0.0)
        task = asyncio.ensure_future(self.bus.publish(event))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def warm_up(self, variant: str, slots: int, rng: random.Random) -> list[Conversation]:
        """`slots` executions at uniformly random ages in [0, 50), each having made one
        unmeasured call (its history fast-forwarded), so the measured calls extend."""
        convs = []
        for _ in range(slots):
            conv = self.new_conversation(variant)
            conv.fast_forward(rng.randrange(CALLS_PER_EXECUTION - 1))
            convs.append(conv)
        sem = asyncio.Semaphore(16)

        async def one(conv: Conversation) -> None:
            async with sem:
                await self.proxy_call(conv, None)

        await asyncio.gather(*(one(c) for c in convs))
        return convs

    async def settle(self, bound_s: float = 60.0) -> None:
        """Wait until every call answered so far is stored. The warm-up's calls are branches
        with whole histories (object-store writes, full renders); their publishes finish
        after the answers, and the measured window starts once they have (steady state)."""
        if self.bus is not None:
            target = self.stored_offset + self.answered
            stored, waited = await _wait_stored(self.bus, self.run, target, bound_s)
            self.settles.append({"waited_s": round(waited, 3), "timed_out": stored < target})
            if stored < target:
                log.warning("bench.proxy.settle_timeout", stored=stored, expected=target, waited_s=round(waited, 1))

    async def run_proxy(self, variant: str, slots: int, think_s: float, duration_s: float,
                        rng: random.Random) -> RunStats:
        """`slots` executions, then `duration_s` measured. They are the variant's live ones
        (`pool`, left where the last run stopped, so already in their steady state); those
        missing are started at random ages by an unmeasured warm-up."""
        stats = RunStats()
        if len(self.pool) < slots:
            self.pool += await self.warm_up(variant, slots - len(self.pool), rng)
        convs = self.pool
        await self.settle()
        t_end = time.perf_counter() + duration_s

        async def slot(i: int) -> None:
            conv = convs[i]
            await _think(rng, think_s, t_end)
            while time.perf_counter() < t_end:
                if conv.calls >= CALLS_PER_EXECUTION:
                    self.finished(conv)
                    conv = self.new_conversation(variant)
                try:
                    await self.proxy_call(conv, stats)
                except _CallFailed:
                    self.finished(conv)
                    conv = self.new_conversation(variant)
                await _think(rng, think_s, t_end)
            convs[i] = conv

        t0 = time.perf_counter()
        cpu0 = process_cpu_s(self.proxy_pid)
        await asyncio.gather(*(slot(i) for i in range(slots)))
        cpu1 = process_cpu_s(self.proxy_pid)
        stats.window_s = time.perf_counter() - t0
        stats.calls = len(stats.latencies)
        if cpu0 is not None and cpu1 is not None:
            stats.proxy_cpu_s = cpu1 - cpu0
        return stats

    async def run_direct(self, slots: int, think_s: float, duration_s: float, rng: random.Random,
                         url: str = "") -> RunStats:
        """The pre-tokenised `/generate` calls of the same load, sent to `url` (default:
        straight to the engine; the pass-through for the floor); `think_s` 0 is a closed
        loop."""
        url = url or self.engine_url
        stats = RunStats()
        t_end = time.perf_counter() + duration_s

        async def slot(i: int) -> None:
            k = rng.randrange(CALLS_PER_EXECUTION)
            await _think(rng, think_s, t_end)
            while time.perf_counter() < t_end:
                try:
                    await self.direct_call(k, stats, url)
                except _CallFailed:
                    pass  # counted in stats.errors
                k = (k + 1) % CALLS_PER_EXECUTION
                await _think(rng, think_s, t_end)

        t0 = time.perf_counter()
        await asyncio.gather(*(slot(i) for i in range(slots)))
        stats.window_s = time.perf_counter() - t0
        stats.calls = len(stats.latencies)
        return stats

    async def run_throughput(self, variant: str, slots: int, duration_s: float, rng: random.Random) -> RunStats:
        """Closed loop, no think time; counts calls answered inside the window."""
        return await self.run_proxy(variant, slots, 0.0, duration_s, rng)


async def _think(rng: random.Random, think_s: float, t_end: float) -> None:
    """An exponential think time (mean think_s), cut at the window's end: no call starts
    after it, so the run ends with its last answer, not its longest remaining think.
    Returns at once for think_s 0 (a closed loop)."""
    if think_s:
        await asyncio.sleep(min(rng.expovariate(1.0 / think_s), max(t_end - time.perf_counter(), 0.0)))


class _CallFailed(Exception):
    def __init__(self, status: int):
        super().__init__(f"HTTP {status}")
        self.status = status


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds used so far by process `pid` (Linux `/proc/<pid>/stat`,
    clock-tick resolution); None without a pid or without /proc."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _calls_per_s(stats: RunStats) -> float | None:
    return round(stats.calls / stats.window_s, 1) if stats.window_s else None


def _cpu_ms_per_call(stats: RunStats) -> float | None:
    return round(1000.0 * stats.proxy_cpu_s / stats.calls, 3) if stats.proxy_cpu_s is not None and stats.calls else None


def _rep_figures(lat: RunStats, direct: RunStats, thr: RunStats) -> dict:
    """One repetition: proxy and direct latency percentiles, added latency, calls/s, the
    proxy's CPU per answered call in the latency and the throughput run."""
    p, d = percentiles_ms(lat.latencies), percentiles_ms(direct.latencies)
    return {"added_latency_ms": _added(p, d), "proxy_latency_ms": p, "direct_latency_ms": d,
            "calls_per_s": _calls_per_s(thr),
            "proxy_cpu_ms_per_call": _cpu_ms_per_call(lat), "proxy_cpu_ms_per_call_saturated": _cpu_ms_per_call(thr),
            "latency_calls": lat.calls, "direct_calls": direct.calls, "throughput_calls": thr.calls,
            "throughput_window_s": round(thr.window_s, 3), "errors": lat.errors + thr.errors,
            "error_samples": lat.error_samples + thr.error_samples}


def _added(path: dict[str, float | None], direct: dict[str, float | None]) -> dict[str, float | None]:
    """Added latency per percentile (ms): `path` minus `direct`, None where either is."""
    return {q: (round(path[q] - direct[q], 3) if path[q] is not None and direct[q] is not None else None)
            for q in path}


CPU_KEYS = ("proxy_cpu_ms_per_call", "proxy_cpu_ms_per_call_saturated")
FIGURE_KEYS = ("added_latency_ms_p50", "added_latency_ms_p90", "added_latency_ms_p99", "calls_per_s", *CPU_KEYS)
"""A variant's figures (medians); a skipped variant holds each as None."""


def _variant_figures(reps: list[dict]) -> dict:
    """A variant's keys: the median over repetitions of added p50/p90/p99, calls/s and the
    proxy's CPU per call (`CPU_KEYS`; repetitions without a figure are left out, None
    when none has one), with `_min`/`_max` beside (BENCHMARKS.md preamble), and every
    repetition under `reps`."""
    import statistics

    out: dict[str, Any] = {}
    series = {f"added_latency_ms_{q}": [r["added_latency_ms"][q] for r in reps] for q in ("p50", "p90", "p99")}
    series["calls_per_s"] = [r["calls_per_s"] for r in reps]
    for key in CPU_KEYS:
        series[key] = [r.get(key) for r in reps]
    for key, values in series.items():
        values = [v for v in values if v is not None]
        out[key] = round(statistics.median(values), 3) if values else None
        if len(values) > 1:
            out[f"{key}_min"], out[f"{key}_max"] = min(values), max(values)
    out["errors"] = sum(r["errors"] for r in reps)
    out["error_samples"] = [e for r in reps for e in r["error_samples"]][:3]
    out["reps"] = reps
    return out


def percentiles_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    arr = np.asarray(values) * 1000.0
    return {f"p{q}": round(float(np.percentile(arr, q)), 3) for q in (50, 90, 99)}


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    return {"cpu": cpu, "cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "torch": torch_version, "platform": platform.platform(),
            "loadavg_1m_at_start": load}


# --------------------------------------------------------------------------- orchestration


async def _stored_calls(bus: Any, run: str) -> int:
    from bus import subjects

    info = await bus.js.stream_info(subjects.stream_for("call.completed").stream_name(run))
    return int(info.state.messages)


async def _wait_stored(bus: Any, run: str, expected: int, bound_s: float) -> tuple[int, float]:
    t0 = time.perf_counter()
    stored = await _stored_calls(bus, run)
    while stored < expected and time.perf_counter() - t0 < bound_s:
        await asyncio.sleep(0.1)
        stored = await _stored_calls(bus, run)
    return stored, time.perf_counter() - t0


async def _probe_messages(session: Any, proxy_url: str) -> str:
    """'' when the proxy serves /v1/messages, else why not."""
    from gyre.env.harness import execution_key

    body = orjson.dumps({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    headers = {"x-api-key": execution_key(SECRET, "probe-messages"), "anthropic-version": "2023-06-01",
               "Content-Type": "application/json"}
    async with session.post(proxy_url + "/v1/messages", data=body, headers=headers) as resp:
        raw = await resp.read()
        if resp.status == 200:
            return ""
        return f"the proxy answered /v1/messages with {resp.status}: {raw[:200].decode(errors='replace')}"


async def bench(cfg: BenchConfig, workdir: Path) -> dict:
    from bus import Bus
    from bus.server import NatsServer
    from gyre.serving.tokenizer import build_tokenizer

    tok = build_tokenizer()
    w = Workload.build(tok, cfg.seed)
    prompts = direct_prompts(tok, w)
    run = "bench" + uuid.uuid4().hex[:8]
    nats = NatsServer.start(workdir / "nats")
    procs: list[subprocess.Popen] = []
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for stale in ("engine.url", "proxy.json", "passthrough.url"):
        (workdir / stale).unlink(missing_ok=True)
    result: dict = {}
    try:
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        ids_arg = ",".join(map(str, w.completion_ids))
        eng = subprocess.Popen([sys.executable, "-m", "handlers.bench.proxy", "_engine", "--url-file",
                                str(workdir / "engine.url"), "--ids", ids_arg],
                               stdout=open(logs / "engine.log", "wb"), stderr=subprocess.STDOUT, env=env)
        procs.append(eng)
        engine_url = _wait_url(workdir / "engine.url", eng, "engine")
        proxy_argv = [sys.executable]
        if cfg.profile:
            proxy_argv += ["-m", "cProfile", "-o", cfg.profile]
        proxy_argv += ["-m", "handlers.bench.proxy", "_proxy", "--url-file", str(workdir / "proxy.json"),
                       "--engine-url", engine_url, "--nats-url", nats.url, "--run", run]
        if not cfg.check_drift:
            proxy_argv.append("--no-drift-check")
        passthrough = subprocess.Popen([sys.executable, "-m", "handlers.bench.proxy", "_passthrough", "--url-file",
                                        str(workdir / "passthrough.url"), "--engine-url", engine_url],
                                       stdout=open(logs / "passthrough.log", "wb"), stderr=subprocess.STDOUT, env=env)
        procs.append(passthrough)
        passthrough_url = _wait_url(workdir / "passthrough.url", passthrough, "pass-through")
        penv = dict(env, GYRE_BENCH_NATS_TOKEN=nats.token or "")
        prox = subprocess.Popen(proxy_argv, stdout=open(logs / "proxy.log", "wb"), stderr=subprocess.STDOUT, env=penv)
        procs.append(prox)
        proxy_pid = None if cfg.profile else prox.pid  # under cProfile the figure would be the profiler's
        proxy_url = _wait_url(workdir / "proxy.json", prox, "proxy")
        bus = await Bus.connect(nats.url, token=nats.token, run=run, name="bench")
        await bus.ensure_streams()
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=120)
        rng = random.Random(cfg.seed)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            load = Load(session, proxy_url, engine_url, w, prompts, bus, run)
            load.proxy_pid = proxy_pid
            skip_messages = await _probe_messages(session, proxy_url)
            # the probe's own call (if answered) is stored before any variant starts counting
            await _wait_stored(bus, run, 0 if skip_messages else 1, 10.0)
            load.stored_offset = await _stored_calls(bus, run)
            result["machine"] = machine()
            for variant in cfg.variants:
                if variant.startswith("messages") and skip_messages:
                    result[variant] = {**{k: None for k in FIGURE_KEYS}, "skipped": skip_messages}
                    continue
                vlog = log.bind(variant=variant)
                before = load.answered
                load.settles.clear()
                stored_before = await _stored_calls(bus, run)
                reps = []
                for rep in range(cfg.reps):
                    # proxy and direct paths alternate which goes first, so a slow spell of
                    # this shared machine does not always fall on the same one
                    if rep % 2 == 0:
                        lat = await load.run_proxy(variant, cfg.executions, cfg.think_s, cfg.duration_s, rng)
                        direct = await load.run_direct(cfg.executions, cfg.think_s, cfg.duration_s, rng)
                    else:
                        direct = await load.run_direct(cfg.executions, cfg.think_s, cfg.duration_s, rng)
                        lat = await load.run_proxy(variant, cfg.executions, cfg.think_s, cfg.duration_s, rng)
                    thr = await load.run_throughput(variant, cfg.concurrency, cfg.duration_s, rng)
                    reps.append(_rep_figures(lat, direct, thr))
                load.finish_pool()
                expected = load.answered - before
                stored, drain_s = await _wait_stored(bus, run, stored_before + expected, 60.0)
                result[variant] = _variant_figures(reps)
                result[variant].update(answered=expected, unstored=max(stored_before + expected - stored, 0),
                                       drain_s=round(drain_s, 3), settle=list(load.settles))
                vlog.info("bench.proxy.variant", **{k: v for k, v in result[variant].items()
                                                    if k in ("added_latency_ms_p50", "added_latency_ms_p99",
                                                             "calls_per_s", "errors", "unstored")})
            result["floor"] = await _floor(load, passthrough_url, cfg, rng)
            log.info("bench.proxy.floor", added_latency_ms_p50=result["floor"]["added_latency_ms_p50"],
                     added_latency_ms_p99=result["floor"]["added_latency_ms_p99"])
        await bus.close()
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        nats.stop()
    result["config"] = {"reps": cfg.reps, "executions": cfg.executions, "think_s": cfg.think_s, "duration_s": cfg.duration_s,
                        "concurrency": cfg.concurrency, "calls_per_execution": CALLS_PER_EXECUTION,
                        "completion_tokens": len(w.completion_ids), "system_tokens": len(prompts[0]),
                        "last_prompt_tokens": len(prompts[-1]),
                        "proxy": "handlers.proxy.daemon defaults (PubAck awaited)", "check_drift": cfg.check_drift}
    return result


async def _floor(load: Load, passthrough_url: str, cfg: BenchConfig, rng: random.Random) -> dict:
    """`reps` repetitions, each a latency pair (the bare pass-through against the engine
    straight, alternating which runs first) and a closed loop of `concurrency` through the
    pass-through (`calls_per_s`: what a process doing no work at all carries with this
    load generator on this machine, the ceiling beside BENCHMARKS.md's "~4,000 here"). The
    variant keys without the CPU ones."""
    reps = []
    for rep in range(cfg.reps):
        runs = {}
        for path in (("passthrough", "direct") if rep % 2 == 0 else ("direct", "passthrough")):
            runs[path] = await load.run_direct(cfg.executions, cfg.think_s, cfg.duration_s, rng,
                                               passthrough_url if path == "passthrough" else "")
        thr = await load.run_direct(cfg.concurrency, 0.0, cfg.duration_s, rng, passthrough_url)
        p, d = percentiles_ms(runs["passthrough"].latencies), percentiles_ms(runs["direct"].latencies)
        reps.append({"added_latency_ms": _added(p, d), "passthrough_latency_ms": p, "direct_latency_ms": d,
                     "calls_per_s": _calls_per_s(thr),
                     "latency_calls": runs["passthrough"].calls, "direct_calls": runs["direct"].calls,
                     "throughput_calls": thr.calls,
                     "errors": runs["passthrough"].errors + runs["direct"].errors + thr.errors,
                     "error_samples": runs["passthrough"].error_samples + runs["direct"].error_samples
                     + thr.error_samples})
    out = _variant_figures(reps)
    for key in CPU_KEYS:
        out.pop(key, None)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_engine":
        p = argparse.ArgumentParser(prog="bench_proxy _engine")
        p.add_argument("--url-file", required=True)
        p.add_argument("--ids", required=True)
        a = p.parse_args(argv[1:])
        serve_engine(a.url_file, [int(x) for x in a.ids.split(",")])
        return 0
    if argv and argv[0] == "_passthrough":
        p = argparse.ArgumentParser(prog="bench_proxy _passthrough")
        p.add_argument("--url-file", required=True)
        p.add_argument("--engine-url", required=True)
        a = p.parse_args(argv[1:])
        serve_passthrough(a.url_file, a.engine_url)
        return 0
    if argv and argv[0] == "_proxy":
        p = argparse.ArgumentParser(prog="bench_proxy _proxy")
        for name in ("--url-file", "--engine-url", "--nats-url", "--run"):
            p.add_argument(name, required=True)
        p.add_argument("--no-drift-check", action="store_true")
        a = p.parse_args(argv[1:])
        serve_proxy(a.url_file, a.engine_url, a.nats_url, os.environ.get("GYRE_BENCH_NATS_TOKEN") or None, a.run,
                    check_drift=not a.no_drift_check)
        return 0
    p = argparse.ArgumentParser(prog="gyre bench proxy", description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--json", help="write the results here")
    p.add_argument("--smoke", action="store_true", help="the machinery only (CI; 10–30 s, mostly starting processes): 8 executions, 0.5 s runs")
    p.add_argument("--duration-s", type=float, default=None, help="seconds of load per run (default 10)")
    p.add_argument("--executions", type=int, default=None,
                   help="simulated executions in the latency runs (default 256)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="executions in the closed-loop throughput runs (default 64)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS + EXTRA_VARIANTS)} (default: {', '.join(VARIANTS)})")
    p.add_argument("--no-drift-check", action="store_true",
                   help="run the proxy with check_drift=False (diagnosis; not the benchmark's setting)")
    p.add_argument("--profile", default="", help="run the proxy under cProfile, stats to this path")
    p.add_argument("--workdir", default="", help="keep logs here (default: a temporary directory)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per variant, median reported (default 3)")
    a = p.parse_args(argv)
    base = BenchConfig(executions=8, duration_s=0.5, concurrency=4, think_s=0.2, reps=1) if a.smoke else BenchConfig()
    given = {name: getattr(a, name) for name in ("duration_s", "executions", "concurrency", "reps")
             if getattr(a, name) is not None}
    variants = tuple(dict.fromkeys(v.strip() for v in a.variants.split(",") if v.strip()))
    if not variants:
        p.error(f"--variants names none of {', '.join(VARIANTS + EXTRA_VARIANTS)}")
    profile = os.path.abspath(a.profile) if a.profile else ""
    if profile and not Path(profile).parent.is_dir():
        p.error(f"--profile: no directory {Path(profile).parent}")
    try:
        cfg = dataclasses.replace(base, **given, variants=variants, profile=profile, check_drift=not a.no_drift_check)
    except ValueError as exc:
        p.error(str(exc))
    from handlers.daemon import configure_logging

    configure_logging("bench-proxy")  # after the argument checks: a usage error configures nothing
    t0 = time.perf_counter()
    if a.workdir:
        Path(a.workdir).mkdir(parents=True, exist_ok=True)
        result = asyncio.run(bench(cfg, Path(a.workdir)))
    else:
        with tempfile.TemporaryDirectory(prefix="gyre-bench-proxy-") as d:
            result = asyncio.run(bench(cfg, Path(d)))
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(format_table(result))
    if a.json:
        Path(a.json).write_text(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")
        print(f"wrote {a.json}")
    return 0


def format_table(result: dict) -> str:
    """The figures as a table (BENCHMARKS.md: each bench prints one; `--json` has them all):
    per variant the added latency p50 / p99 (ms) and calls/s, medians with [min–max] over
    the repetitions, the proxy's CPU ms per call (latency run, saturated), failed calls and
    answered calls the bus does not hold (a skipped variant: why); then the targets and
    the machine."""
    def cell(fig: dict, key: str, fmt: str, spread: bool = True) -> str:
        value = fig.get(key)
        if value is None:
            return "—"
        lo, hi = fig.get(f"{key}_min"), fig.get(f"{key}_max")
        shown = spread and lo is not None and hi is not None and lo != hi
        return f"{value:{fmt}}" + (f" [{lo:{fmt}}–{hi:{fmt}}]" if shown else "")

    head = (f"{'variant':<17}{'added p50 ms':>22}{'added p99 ms':>22}{'calls/s':>26}{'CPU ms/call':>14}"
            f"{'saturated':>11}{'errors':>8}{'unstored':>10}")
    lines = [head, "-" * len(head)]
    for name in (*VARIANTS, *EXTRA_VARIANTS, "floor"):
        fig = result.get(name)
        if not isinstance(fig, dict):
            continue
        if fig.get("skipped"):
            lines.append(f"{name:<17}skipped: {fig['skipped']}")
            continue
        lines.append(f"{name:<17}{cell(fig, 'added_latency_ms_p50', '.2f'):>22}"
                     f"{cell(fig, 'added_latency_ms_p99', '.1f'):>22}{cell(fig, 'calls_per_s', ',.0f'):>26}"
                     f"{cell(fig, 'proxy_cpu_ms_per_call', '.2f', False):>14}"
                     f"{cell(fig, 'proxy_cpu_ms_per_call_saturated', '.2f', False):>11}"
                     f"{fig.get('errors', 0):>8}{fig.get('unstored', '—') if name != 'floor' else '—':>10}")
    lines.append("targets: added p50 ≤ 1 ms, p99 ≤ 5 ms; ≥ 1,000 calls/s (floor: a bare aiohttp pass-through)")
    m = result.get("machine") or {}
    lines.append(f"machine: {m.get('cpus')} cores ({m.get('cpu')}), Python {m.get('python')}, torch {m.get('torch')}; "
                 f"wall {result.get('wall_s', 0):.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
