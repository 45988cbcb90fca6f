"""The load generator of `gyre bench proxy` (handlers/bench/proxy.py): the workload, the
simulated harness, and the runs.

Workload: realistic agent turns. An execution starts from a ~1,000-token system prompt,
one bash tool and a task; each call's answer (the tool call the proxy parsed) is sent
back in the history with a ~200-token tool result; after 50 calls the execution ends
(`execution.finished` is published, as the runner does, so the proxy frees its store) and
a new one takes its place. Executions start at a uniformly random age in [0, 50) reached
by an unmeasured warm-up (the measured window starts once its calls are stored), so
histories are in their steady state from the first measured call; a variant's later runs
continue the executions where the previous run left them (no second warm-up).

`Workload.build(tok, seed)` makes the texts and the engine's fixed completion (ValueError
when that is not `COMPLETION_TOKENS` ids with this tokenizer); `direct_prompts` the
pre-tokenised prompts of the direct path; `Conversation` one simulated execution in one API
(chat, messages or responses; streamed or not), reading answers back as a harness does.
`Load` runs the load: `run_proxy` (through the proxy, exponential think times, `think_s` 0
a closed loop; the executions are kept across a variant's runs in `pool`) and `run_direct`
(the same calls pre-tokenised, to the engine or the pass-through); a failed call is counted
in `RunStats.errors`, never raised; `settle` waits until every answered call is stored
(`_wait_stored`, the CALLS stream's count). `process_cpu_s` reads a process's CPU time.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import structlog

log = structlog.get_logger()

CALLS_PER_EXECUTION = 50
COMPLETION_TOKENS = 20
TOOL_RESULT_TOKENS = 200
SYSTEM_TOKENS = 1000
SECRET = b"gyre-bench-proxy-secret-0123456789"
MODEL = "gyre"
BASH_DESCRIPTION = "Run a bash command in the workspace and return its output."
BASH_SCHEMA = {"type": "object", "properties": {"command": {"type": "string", "description": "the command"}},
               "required": ["command"]}


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


async def _stored_calls(bus: Any, run: str) -> int:
    from bus import subjects
    from schemas.call import CallCompleted

    info = await bus.js.stream_info(subjects.stream_for(CallCompleted.NAME).stream_name(run))
    return int(info.state.messages)


async def _wait_stored(bus: Any, run: str, expected: int, bound_s: float) -> tuple[int, float]:
    t0 = time.perf_counter()
    stored = await _stored_calls(bus, run)
    while stored < expected and time.perf_counter() - t0 < bound_s:
        await asyncio.sleep(0.1)
        stored = await _stored_calls(bus, run)
    return stored, time.perf_counter() - t0
