"""Roles of model calls: which harness made a call and what kind of call it is. Pure.

DESIGN.md glossary "role": `main`, `main-summary` (the main agent's compaction request
and its calls after compaction), `sub-agent`, `sub-agent-summary`, and `auxiliary`
(token counting, titles, side calls to a different small model: answered, recorded,
never trained).

Harness profiles (`PROFILES`), chosen per execution by `profile_for_harness(name)` (the
runner's profile name from `execution.started`) or, when unknown, by `detect_profile`
from the request headers (names lower-case):
- `claude-code`: `x-claude-code-session-id`, or `anthropic-version` with an
  `anthropic-beta` flag starting `claude-code-`.
- `codex`: `x-codex-turn-metadata`, or a `session-id` header with an `originator`/
  `user-agent` naming codex.
- `mini-swe-agent`: a Chat Completions call from an OpenAI SDK (`x-stainless-*`).
- `generic`: anything else.

Rules (`classify`), in order:
1. `auxiliary`: `count_tokens`; for `claude-code`, a call asking for a JSON-schema
   answer with no tools (its title generation) and, without an agent-id header, a call
   with no tools to a model whose name contains `haiku` (the small side model; the
   Explore sub-agent runs on haiku and is a `sub-agent`, and an agent run with `--model
   haiku` sends its tools with every call: `main`). Other harnesses' schema-constrained calls stay agent calls: an
   agent built on structured outputs may send nothing else, and none of them was seen
   making titles.
2. Agent: `claude-code` calls with an `x-claude-code-agent-id` header are `sub-agent`;
   `codex` calls with an `x-openai-subagent` header (`collab_spawn` on the calls of a
   sub-agent spawned through its `multi_agent_v1` tools; `compact` there means
   compaction, anything else a sub-agent); everything else is `main`.
3. Summary: `claude-code` — the last user message holds the compaction instruction
   ("Your task is to create a detailed summary of the conversation so far") or the
   first user message is the continuation ("This session is being continued from a
   previous conversation"); `codex` — `x-codex-turn-metadata.request_kind` is
   `compaction`, the last user message holds the checkpoint-compaction prompt
   ("CONTEXT CHECKPOINT COMPACTION"), or a user message starts with Codex's summary
   prefix ("Another language model started to solve this problem"). A summary call of
   the main agent is `main-summary`, of a sub-agent `sub-agent-summary`.
`mini-swe-agent` and `generic` have no compaction or sub-agents: `main` unless rule 1.

Metadata (`Classification.meta`, strings): `harness` always; `session_id`
(`x-claude-code-session-id`, Codex `session-id`/`thread-id`, or the body's), `agent_id`
(`x-claude-code-agent-id`), `request_kind` (Codex's; `compaction` / `count_tokens` /
`title` where rule 1 or 3 found one), `turn_id` (Codex's) where present.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

PROFILES = ("claude-code", "mini-swe-agent", "codex", "generic")
ROLES = ("main", "main-summary", "sub-agent", "sub-agent-summary", "auxiliary")

CLAUDE_COMPACT_REQUEST = "Your task is to create a detailed summary of the conversation so far"
CLAUDE_CONTINUATION = "This session is being continued from a previous conversation"
CODEX_COMPACT_REQUEST = "CONTEXT CHECKPOINT COMPACTION"
CODEX_SUMMARY_PREFIX = "Another language model started to solve this problem"
SMALL_MODEL_MARKERS = ("haiku",)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CallFacts:
    """What a classifier may look at for one call.

    api: `chat` | `responses` | `messages` | `count_tokens`. headers: request headers,
    lower-case names. model: the model name asked for. messages: the call's messages in
    the internal chat form (role, content string, …). tools: number of function tools
    offered. json_output: the call asks for a JSON-schema-shaped answer. body_meta:
    identity found in the body (e.g. `session_id`).
    """

    api: str
    headers: Mapping[str, str]
    model: str = ""
    messages: Sequence[Mapping[str, Any]] = ()
    tools: int = 0
    json_output: bool = False
    body_meta: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class Classification:
    """role: one of ROLES. harness: the profile used. meta: harness session metadata."""

    role: str
    harness: str
    meta: dict[str, str]


def profile_for_harness(name: str | None) -> str | None:
    """The roles profile of a runner harness profile name, None when it says nothing
    (then `detect_profile` decides per call)."""
    if not name:
        return None
    name = name.lower()
    if name.startswith("claude"):
        return "claude-code"
    if name.startswith("codex"):
        return "codex"
    if name.startswith("mini"):
        return "mini-swe-agent"
    return "generic"


def detect_profile(headers: Mapping[str, str], api: str) -> str:
    """The harness profile a call's headers reveal (module docstring); `generic` when none."""
    beta = headers.get("anthropic-beta", "")
    if "x-claude-code-session-id" in headers or (
            "anthropic-version" in headers and any(f.strip().startswith("claude-code-") for f in beta.split(","))):
        return "claude-code"
    origin = (headers.get("originator", "") + " " + headers.get("user-agent", "")).lower()
    if "x-codex-turn-metadata" in headers or ("session-id" in headers and "codex" in origin):
        return "codex"
    if api == "chat" and any(k.startswith("x-stainless-") for k in headers):
        return "mini-swe-agent"
    return "generic"


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return ""


def _user_texts(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    return [_text(m) for m in messages if isinstance(m, Mapping) and m.get("role") == "user"]


def _codex_metadata(headers: Mapping[str, str]) -> dict:
    raw = headers.get("x-codex-turn-metadata")
    if not raw:
        return {}
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


META_CHARS = 256
"""Characters kept of each metadata value (session ids are UUIDs; a value comes from the
harness's headers or body and is carried on every `call.completed`, which must fit the bus)."""


def classify(facts: CallFacts, profile: str | None = None) -> Classification:
    """Role and metadata of one call, each metadata value cut to META_CHARS and valid UTF-8
    (`clean_meta`). profile: the execution's configured profile (one of PROFILES), None =
    detect it from the headers. Raises ValueError on an unknown profile."""
    c = _classify(facts, profile)
    if not all(len(v) <= META_CHARS and (v.isascii() or _utf8(v)) for v in c.meta.values()):
        c = Classification(c.role, c.harness, {k: clean_meta(v) for k, v in c.meta.items()})
    return c


def _utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def clean_meta(value: str) -> str:
    """`value` cut to META_CHARS, its surrogates (a header's bytes that are not UTF-8, as
    aiohttp decodes them, or a `\\ud800` escape in Codex's JSON metadata) written as
    `\\udcff` escapes: the event that carries it must encode as UTF-8, or the call would
    never be stored."""
    value = value[:META_CHARS]
    return value if _utf8(value) else value.encode("utf-8", "backslashreplace").decode("utf-8")


def _classify(facts: CallFacts, profile: str | None) -> Classification:
    harness = profile or detect_profile(facts.headers, facts.api)
    if harness not in PROFILES:
        raise ValueError(f"unknown harness profile {harness!r}; known: {PROFILES}")
    h = facts.headers
    meta: dict[str, str] = {"harness": harness}
    summary = sub = False
    # Only these two profiles read the user turns (a walk over the whole history).
    users = _user_texts(facts.messages) if harness in ("claude-code", "codex") else []
    last_user = users[-1] if users else ""
    if harness == "claude-code":
        session = h.get("x-claude-code-session-id") or facts.body_meta.get("session_id")
        if session:
            meta["session_id"] = session
        if h.get("x-claude-code-agent-id"):
            meta["agent_id"] = h["x-claude-code-agent-id"]
            sub = True
        if CLAUDE_COMPACT_REQUEST in last_user:
            meta["request_kind"] = "compaction"
            summary = True
        elif users and CLAUDE_CONTINUATION in users[0]:
            summary = True
    elif harness == "codex":
        session = h.get("session-id") or h.get("thread-id") or facts.body_meta.get("session_id")
        if session:
            meta["session_id"] = session
        turn = _codex_metadata(h)
        for key, name in (("request_kind", "request_kind"), ("turn_id", "turn_id")):
            if isinstance(turn.get(key), str):
                meta[name] = turn[key]
        subagent = h.get("x-openai-subagent", "")
        if subagent:
            meta["agent_id"] = subagent
            sub = subagent != "compact"
            summary = subagent == "compact"
        if meta.get("request_kind") == "compaction" or CODEX_COMPACT_REQUEST in last_user:
            meta.setdefault("request_kind", "compaction")
            summary = True
        elif any(u.lstrip().startswith(CODEX_SUMMARY_PREFIX) for u in users):
            summary = True
    elif facts.body_meta.get("session_id"):
        meta["session_id"] = facts.body_meta["session_id"]

    if facts.api == "count_tokens":
        meta["request_kind"] = "count_tokens"
        return Classification("auxiliary", harness, meta)
    if harness == "claude-code" and facts.json_output and facts.tools == 0:
        meta.setdefault("request_kind", "title")
        return Classification("auxiliary", harness, meta)
    if harness == "claude-code" and not sub and facts.tools == 0 \
            and any(m in facts.model.lower() for m in SMALL_MODEL_MARKERS):
        # the main agent's side calls to its small model carry no tools; the agent itself may
        # run on haiku (`--model haiku`), and a sub-agent's own model may be haiku
        return Classification("auxiliary", harness, meta)
    if sub:
        return Classification("sub-agent-summary" if summary else "sub-agent", harness, meta)
    return Classification("main-summary" if summary else "main", harness, meta)
