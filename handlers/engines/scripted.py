"""A scripted engine: SGLang's native HTTP contract, answering with chosen completions.

For tests and demos that need an engine whose output is known in advance. It speaks the
same endpoints as `handlers/engines/embedded.py` (SGLang native API):

- `POST /generate` {input_ids, sampling_params{max_new_tokens, temperature, top_p, top_k},
  rid, return_logprob, ...; unknown fields (e.g. `gyre_execution`) ignored} →
  {text, output_ids, meta_info{id, finish_reason{type: stop|length|abort, matched|length},
  prompt_tokens, completion_tokens, cached_tokens, output_token_logprobs [[lp, id, null]],
  weight_version, gyre_versions [[start, end, version]]}}.
  The completion is the next scripted text (cycled), or what `callback(body)` returns
  (a string, possibly via an awaitable), encoded with the real tokenizer (special-token
  text such as `<tool_call>` becomes its id) plus `<|im_end|>` as the stop token; it is
  cut to `max_new_tokens` (finish `length`, no stop token then), or after the id whose
  text completes one of `sampling_params.stop` (finish `stop`, matched: that string; the
  string's ids kept, as SGLang does). Log-probs are negative,
  deterministic in (seed, prompt length, position) and plausible, not a model's.
- `POST /abort_request` {rid} aborts a generation in flight (finish `abort`, no ids);
  answers {success, aborted: 1 if it was in flight else 0}.
- `GET /health`, `GET|POST /flush_cache`, `GET /get_model_info`, `GET /get_weight_version`,
  `POST /update_weights_from_disk` {model_path, weight_version?} (bumps the policy version).

Context: with `context_length` C set, requests are refused (400) in SGLang's words and
shape where SGLang refuses them, in its order: a prompt of C ids or more, or one whose ids
and `max_new_tokens` together reach C (its tokenizer manager), then a prompt of C − 6 ids
or more (its scheduler's `max_req_input_len`); and `max_new_tokens` is capped at
C − 2 − prompt, as its scheduler caps it.

Fault injection: `fail_next(n, status)` answers the next n `/generate` calls with
`status` (503 = engine unavailable); `abort_next(n)` finishes them with `abort` (a cell
leaving rollout); `delay_s` holds each generation that long (abortable).

Playbooks (`Playbook`, `Rule`): a callback that drives a real harness to the end of its
task deterministically, whatever the order or concurrency of its calls. The prompt ids
are decoded (special tokens kept) and split into ChatML turns; the first rule whose
conditions all hold answers `turns[k]`, k = the number of assistant turns already in the
prompt (the last turn repeats once k runs past the end). Conditions (substrings, '' =
any): `system` in the first system turn, `last` in the last non-assistant turn,
`first` in the first user turn, `contains` anywhere in the prompt, `execution` in the
request's `gyre_execution`; a rule's `hold_s` keeps each of its answers in flight that long
(abortable), so a test can act while a call is surely running. So a sub-agent is told apart by its delegated prompt (its first
user turn) or its own system prompt, a compaction by its instructions in the last user
turn, and each harness by its execution id. `tool_call(name, args)` writes
a call in Qwen3's format: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.

CLI: `python -m handlers.engines.scripted --script file.jsonl --port N` where each line is
a JSON string or an object with a `text` field, or a rule object (`turns` plus
conditions), which makes the file a playbook (`ScriptedEngine.from_script`).

Behind a cell (recipe `engine.kind = "scripted"`, `engine.script = <that file>`) it is the
cell's engine host (gyre.serving.host.EngineHost): `set_serving(False)` and `release()`
make `/generate` and `/health` answer 503 until it serves again; a load (`load_tensors`,
`load_weights`) sets the policy version it reports; `drain()` aborts the generations in
flight; it keeps no KV (`export_kv` is None, `import_kv` False, and a moved execution's
`gyre_kv_from` hint is ignored: no request waits for blocks); `counters()` counts the prompt
ids it answered (`prefill_tokens`; `kv_imported_tokens` and `kv_dropped` stay 0), also on
`GET /get_model_info`.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import json
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
import structlog
from aiohttp import web

from gyre.serving.tokenizer import IM_END, fast_decoder, parse_stop, stop_hit, stop_window

log = structlog.get_logger(__name__)

Callback = Callable[[dict], "str | Awaitable[str]"]


class ScriptedEngine:
    """An engine whose completions are scripted.

    tokenizer: HF tokenizer with Qwen3's special tokens (`gyre.serving.tokenizer.build_tokenizer()`).
    completions: texts answered in turn (cycled); or callback(body) -> text.
    policy_version: version reported in `weight_version` and `gyre_versions`.
    delay_s: seconds each generation takes (polled for abort every 10 ms).
    context_length: the model's context in tokens, as SGLang enforces it (0 = none).
    Attributes: `requests` (every /generate body received, in order), `aborted` (rids),
    `gate` (None, or an asyncio.Event each generation waits for once its delay is over, still
    abortable: a test knows a request is in flight until it sets it).
    """

    def __init__(self, tokenizer: Any, completions: Sequence[str] | None = None, callback: Callback | None = None,
                 *, policy_version: int = 0, delay_s: float = 0.0, seed: int = 0, context_length: int = 0):
        if (completions is None) == (callback is None):
            raise ValueError("give exactly one of completions or callback")
        if completions is not None and not completions:
            raise ValueError("completions must not be empty")
        self.tokenizer = tokenizer
        self.completions = list(completions) if completions is not None else None
        self.callback = callback
        self.policy_version = policy_version
        self.delay_s = delay_s
        self.seed = seed
        self.context_length = context_length
        self.requests: list[dict] = []
        self.aborted: set[str] = set()
        self._next = 0
        self._fail: list[int] = []
        self._in_flight: set[str] = set()
        self.gate: asyncio.Event | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""
        self._serving = True
        self._released = False
        self.prefill_tokens = 0

    @classmethod
    def from_script(cls, path: str | Path, tokenizer: Any, **kw) -> "ScriptedEngine":
        """The engine a script file makes (module docstring: texts, or playbook rules).
        Raises ValueError (a file that mixes both, or a bad line), OSError."""
        texts, rules = _load(path)
        if rules and texts:
            raise ValueError(f"{path}: mixes completion texts and playbook rules")
        if rules:
            return cls(tokenizer, callback=Playbook(rules).callback(tokenizer), **kw)
        if not texts:
            raise ValueError(f"{path}: holds no completion text and no playbook rule")
        return cls(tokenizer, texts, **kw)

    # -- the engine-host interface (gyre.serving.host.EngineHost) ------------------------------
    def set_serving(self, on: bool) -> None:
        self._serving = bool(on)

    @property
    def serving(self) -> bool:
        return self._serving

    @property
    def version(self) -> int:
        return self.policy_version

    @property
    def released(self) -> bool:
        return self._released

    def drain(self, timeout_s: float = 10.0) -> bool:
        self.aborted.update(self._in_flight)
        deadline = time.monotonic() + timeout_s
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._in_flight

    def release(self) -> None:
        self._released = True
        self.drain(0.0)

    def load_tensors(self, tensors, version: int) -> None:
        self.policy_version, self._released = int(version), False

    def load_weights(self, path, version: int) -> None:
        self.policy_version, self._released = int(version), False

    def export_kv(self, execution: str, block_tokens: int = 64) -> None:
        return None

    def import_kv(self, execution: str, blocks) -> bool:
        return False

    def set_kv_hold(self, hold) -> None:
        """Ignored: no KV is imported here, so no request waits for it."""

    def counters(self) -> dict[str, int]:
        return {"prefill_tokens": self.prefill_tokens, "kv_imported_tokens": 0, "kv_dropped": 0}

    def _unavailable(self) -> web.Response | None:
        if self._serving and not self._released:
            return None
        why = "released" if self._released else "not serving"
        return web.json_response({"error": {"message": f"engine is {why} (cell is not in rollout)",
                                            "type": "unavailable"}}, status=503)

    def fail_next(self, n: int, status: int = 503) -> None:
        """Answer the next n /generate calls with HTTP `status` (before scripting)."""
        self._fail.extend([status] * n)

    def abort_next(self, n: int) -> None:
        """Finish the next n /generate calls with `abort` and no ids, as a cell leaving
        rollout does with the requests it still holds."""
        self._fail.extend([0] * n)

    async def _text(self, body: dict) -> str:
        if self.callback is not None:
            out = self.callback(body)
            if inspect.isawaitable(out):
                out = await out
            return out if isinstance(out, str) else str(out)  # a `Held` text keeps its hold
        text = self.completions[self._next % len(self.completions)]
        self._next += 1
        return text

    def _beyond_context(self, prompt_len: int, max_new: int) -> str:
        """SGLang's refusal of a request its context cannot hold ('' when it fits)."""
        n = self.context_length
        if not n:
            return ""
        if prompt_len >= n:
            return f"The input ({prompt_len} tokens) is longer than the model's context length ({n} tokens)."
        if prompt_len + max_new >= n:
            return (f"Requested token count exceeds the model's maximum context length of {n} tokens. You requested "
                    f"a total of {prompt_len + max_new} tokens: {prompt_len} tokens from the input messages and "
                    f"{max_new} tokens for the completion. Please reduce the number of tokens in the input messages "
                    "or the completion to fit within the limit.")
        if prompt_len >= n - 6:  # then the scheduler: max_req_input_len = (n - 1) - 5
            return (f"Input length ({prompt_len} tokens) exceeds the maximum allowed length ({n - 6} tokens). "
                    "Use a shorter input or enable --allow-auto-truncate.")
        return ""

    def _logprobs(self, prompt_len: int, ids: Sequence[int]) -> list[float]:
        rng = random.Random(self.seed * 1_000_003 + prompt_len)
        return [round(-rng.expovariate(2.0) - 1e-4, 6) for _ in ids]

    async def generate(self, request: web.Request) -> web.Response:
        unavailable = self._unavailable()
        if unavailable is not None:
            return unavailable
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        if not isinstance(body, dict) or not isinstance(body.get("input_ids"), list) or not body["input_ids"]:
            return web.json_response({"error": {"message": "input_ids must be a non-empty list"}}, status=400)
        self.requests.append(body)
        self.prefill_tokens += len(body["input_ids"])
        rid = str(body.get("rid") or f"scripted-{len(self.requests)}")
        if self._fail:
            status = self._fail.pop(0)
            if status == 0:
                meta = {"id": rid, "finish_reason": {"type": "abort", "message": "scripted abort"},
                        "prompt_tokens": len(body["input_ids"]), "completion_tokens": 0, "cached_tokens": 0,
                        "output_token_logprobs": [], "weight_version": str(self.policy_version), "gyre_versions": []}
                return web.json_response({"text": "", "output_ids": [], "meta_info": meta})
            return web.json_response({"error": {"message": "scripted failure"}}, status=status)
        params = body.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens") or 128)
        refused = self._beyond_context(len(body["input_ids"]), max_new)
        if refused:
            return web.json_response({"error": {"message": refused}}, status=400)
        if self.context_length:  # SGLang's scheduler caps the completion at max_req_len - 1 - prompt
            max_new = min(max_new, self.context_length - 2 - len(body["input_ids"]))
        text = await self._text(body)
        ids = [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]] + [IM_END]
        finish: dict[str, Any] = {"type": "stop", "matched": IM_END}
        try:
            stops = parse_stop(params.get("stop"), "sampling_params.stop")
        except ValueError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        if stops:
            decode = fast_decoder(self.tokenizer)
            window = stop_window(stops)
            for n in range(1, min(len(ids), max_new) + 1):
                if ids[n - 1] == IM_END:
                    break  # the stop token comes first, as in the engines
                hit = stop_hit(decode, ids[:n], stops, window)
                if hit is not None:
                    ids, finish = ids[:n], {"type": "stop", "matched": hit}
                    break
        if len(ids) > max_new:
            ids = ids[:max_new]
            finish = {"type": "length", "length": max_new}
        deadline = time.monotonic() + self.delay_s + getattr(text, "hold_s", 0.0)
        self._in_flight.add(rid)
        try:
            while (time.monotonic() < deadline or (self.gate is not None and not self.gate.is_set())) \
                    and rid not in self.aborted:
                await asyncio.sleep(0.01)
        finally:
            self._in_flight.discard(rid)
        if rid in self.aborted:
            ids, finish = [], {"type": "abort", "message": "aborted by request"}
        prompt_len = len(body["input_ids"])
        logprobs = self._logprobs(prompt_len, ids)
        version = self.policy_version
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": prompt_len,
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "output_token_logprobs": [[lp, i, None] for lp, i in zip(logprobs, ids)],
            "weight_version": str(version),
            "gyre_versions": [[0, len(ids), version]] if ids else [],
        }
        text_out = self.tokenizer.decode([i for i in ids if i != IM_END], skip_special_tokens=False)
        log.debug("scripted_engine.generate", rid=rid, prompt_tokens=prompt_len, completion_tokens=len(ids),
                  finish=finish["type"])
        return web.json_response({"text": text_out, "output_ids": ids, "meta_info": meta})

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read() or b"{}")
        except orjson.JSONDecodeError:
            body = {}
        rid = body.get("rid") if isinstance(body, dict) else None
        if not rid:
            return web.json_response({"error": {"message": "rid (string) is required"}}, status=400)
        in_flight = str(rid) in self._in_flight
        self.aborted.add(str(rid))
        return web.json_response({"success": True, "aborted": int(in_flight)})

    async def health(self, request: web.Request) -> web.Response:
        return self._unavailable() or web.Response(text="ok")

    async def flush_cache(self, request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed.")

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "scripted", "is_generation": True,
                                  "weight_version": str(self.policy_version), "serving": self._serving,
                                  "in_flight": len(self._in_flight), "counters": self.counters()})

    async def weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.policy_version)})

    async def update_weights(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read() or b"{}")
        except orjson.JSONDecodeError:
            return web.json_response({"success": False, "message": "body is not JSON"}, status=400)
        version = body.get("weight_version") if isinstance(body, dict) else None
        self.policy_version = int(version) if version is not None else self.policy_version + 1
        return web.json_response({"success": True, "message": f"policy version {self.policy_version}"})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_get("/health", self.health)
        app.router.add_get("/flush_cache", self.flush_cache)
        app.router.add_post("/flush_cache", self.flush_cache)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/get_weight_version", self.weight_version)
        app.router.add_post("/update_weights_from_disk", self.update_weights)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on host:port (0 = a free port); returns the base URL."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0][1]
        self.url = f"http://{host}:{bound}"
        log.info("scripted_engine.started", url=self.url)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def tool_call(name: str, arguments: dict, content: str = "") -> str:
    """A completion text calling tool `name` in Qwen3's format, after optional `content`."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{content}\n\n<tool_call>\n{call}\n</tool_call>" if content else f"<tool_call>\n{call}\n</tool_call>"


class Held(str):
    """A completion text the engine holds `hold_s` seconds in flight (abortable) before it
    answers with it (a playbook rule's `hold_s`)."""

    hold_s: float

    def __new__(cls, text: str, hold_s: float) -> "Held":
        out = super().__new__(cls, text)
        out.hold_s = float(hold_s)
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class Turns:
    """A decoded prompt split into ChatML turns.

    system: text of the first system turn ('' if none). first: text of the first user
    turn. last: text of the last turn that is not the assistant's. assistant_turns: completed assistant turns in the prompt (the
    generation prompt excluded). text: the whole decoded prompt.
    """

    system: str
    first: str
    last: str
    assistant_turns: int
    text: str


def split_turns(text: str) -> Turns:
    """`Turns` of a decoded ChatML prompt (`<|im_start|>role\n…<|im_end|>` blocks)."""
    blocks = text.split("<|im_start|>")[1:]
    system, first, last, assistant = "", None, "", 0
    for i, block in enumerate(blocks):
        role, _, body = block.partition("\n")
        body = body.split("<|im_end|>", 1)[0]
        if role == "assistant":
            if i < len(blocks) - 1 or "<|im_end|>" in block:
                assistant += 1
            continue
        if role == "system" and not system:
            system = body
        if role == "user" and first is None:
            first = body
        last = body
    return Turns(system=system, first=first or "", last=last, assistant_turns=assistant, text=text)


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """One conversation of a playbook: its completions by assistant turn and when it applies
    (all conditions are substrings; '' matches anything)."""

    turns: tuple[str, ...]
    system: str = ""
    first: str = ""
    last: str = ""
    contains: str = ""
    execution: str = ""
    name: str = ""
    hold_s: float = 0.0
    """Seconds each answer of this rule is held in flight before it is sent (abortable): a
    call a test needs in flight at this engine while something happens (a switch)."""

    def __post_init__(self) -> None:
        if not self.turns or not all(isinstance(t, str) for t in self.turns):
            raise ValueError("Rule.turns must be a non-empty sequence of completion texts")
        if not isinstance(self.hold_s, (int, float)) or self.hold_s < 0:
            raise ValueError("Rule.hold_s must be a number of seconds ≥ 0")

    def matches(self, turns: Turns, execution: str) -> bool:
        return (self.system in turns.system and self.first in turns.first and self.last in turns.last and self.contains in turns.text
                and self.execution in execution)

    @classmethod
    def from_json(cls, item: dict) -> "Rule":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(item) - fields
        if unknown:
            raise ValueError(f"unknown rule fields {sorted(unknown)}; known: {sorted(fields)}")
        return cls(**{**item, "turns": tuple(item.get("turns") or ())})


class Playbook:
    """Rules tried in order (see the module docstring); `callback(tokenizer)` plugs it
    into a ScriptedEngine. `matched` records (execution, rule name or index, k) per call.
    Raises LookupError from the callback (→ HTTP 500) when no rule applies."""

    def __init__(self, rules: Sequence[Rule]):
        if not rules:
            raise ValueError("a playbook needs at least one rule")
        self.rules = list(rules)
        self.matched: list[tuple[str, str, int]] = []

    def answer(self, turns: Turns, execution: str = "") -> str:
        for i, rule in enumerate(self.rules):
            if rule.matches(turns, execution):
                k = turns.assistant_turns
                self.matched.append((execution, rule.name or str(i), k))
                text = rule.turns[min(k, len(rule.turns) - 1)]
                return Held(text, rule.hold_s) if rule.hold_s else text
        raise LookupError(f"no playbook rule for execution {execution!r}; last turn {turns.last[-300:]!r}")

    def callback(self, tokenizer: Any) -> Callback:
        def cb(body: dict) -> str:
            text = tokenizer.decode(body["input_ids"], skip_special_tokens=False)
            return self.answer(split_turns(text), str(body.get("gyre_execution") or ""))
        return cb


def load_script(path: str | Path) -> list[str]:
    """Completion texts from a JSONL file: each line a JSON string or {"text": ...}."""
    texts, rules = _load(path)
    if rules:
        raise ValueError(f"{path}: holds playbook rules; use load_playbook")
    return texts


def load_playbook(path: str | Path) -> Playbook:
    """A playbook from a JSONL file of rule objects (`Rule` fields)."""
    texts, rules = _load(path)
    if texts or not rules:
        raise ValueError(f"{path}: a playbook file holds rule objects only")
    return Playbook(rules)


def _load(path: str | Path) -> tuple[list[str], list[Rule]]:
    texts: list[str] = []
    rules: list[Rule] = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        item = orjson.loads(line)
        if isinstance(item, dict) and "turns" in item:
            try:
                rules.append(Rule.from_json(item))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{n}: {exc}") from None
        elif isinstance(item, dict) and isinstance(item.get("text"), str):
            texts.append(item["text"])
        elif isinstance(item, str):
            texts.append(item)
        else:
            raise ValueError(f"{path}:{n}: expected a JSON string, an object with 'text', or a rule with 'turns'")
    return texts, rules


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m handlers.engines.scripted", description=__doc__.splitlines()[0])
    p.add_argument("--script", required=True, help="JSONL file of completion texts (cycled) or playbook rules")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--model-dir", help="tokenizer from this HF checkpoint (default: the built-in Qwen3 tokenizer)")
    p.add_argument("--delay-s", type=float, default=0.0)
    p.add_argument("--policy-version", type=int, default=0)
    a = p.parse_args(argv)
    if a.model_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.model_dir)
    else:
        from gyre.serving.tokenizer import build_tokenizer

        tokenizer = build_tokenizer()
    try:
        engine = ScriptedEngine.from_script(a.script, tokenizer, delay_s=a.delay_s, policy_version=a.policy_version)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None

    async def _serve() -> None:
        url = await engine.start(a.host, a.port)
        print(url, flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await engine.stop()

    try:
        asyncio.run(_serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
