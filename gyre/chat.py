"""Chat rendering and completion parsing in the Qwen3 format.

- `render` turns OpenAI-format messages (+ tools) into the prompt text through the
  tokenizer's chat template (gyre/templates/qwen3_chat.jinja on the embedded default).
  Messages are normalised first: `developer` → `system`, content parts → one string,
  tool-call arguments → JSON text. Invalid input raises `ValueError` naming the message.
- `parse_completion` splits a completion's text into reasoning (`<think>…</think>`),
  content, and tool calls (`<tool_call>{"name": …, "arguments": {…}}</tool_call>`).
  It never raises: a malformed or unclosed block stays in the content as plain text.

Rendering a conversation and then appending an assistant turn (without generation
prompt) yields a string prefix of the rendering of any continuation that adds tool
results or assistant turns; TITO prefix matching (gyre.tito) relies on it.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
STOP_TEXTS = ("<|im_end|>", "<|endoftext|>")

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call the policy wrote."""

    id: str  # deterministic: "<prefix>_<index among the completion's valid calls>"
    name: str  # function name
    arguments: str  # JSON object text, e.g. '{"command": "ls"}'


@dataclass(frozen=True, slots=True)
class Parsed:
    """A completion split into its parts."""

    content: str  # visible text (everything that is not reasoning or a valid tool call)
    reasoning: str | None  # text inside <think>…</think>, stripped; None when absent or empty
    tool_calls: tuple[ToolCall, ...]  # in order of appearance


def call_id_prefix(key: str) -> str:
    """A tool-call id prefix derived from a stable key (e.g. the proxy's call id): "call_<24 hex>"."""
    return "call_" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:24]


def content_text(content: Any, where: str = "content") -> str:
    """Flatten message content (None, str, or a list of text parts) into one string.

    Errors: `ValueError` for a non-text part or an unsupported content type.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        out = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") in TEXT_PART_TYPES:
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError(f"{where}[{i}].text must be a string, got {type(text).__name__}")
                out.append(text)
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"{where}[{i}] has unsupported part type {kind!r}; only text parts")
        return "".join(out)
    raise ValueError(f"{where} must be a string or a list of text parts, got {type(content).__name__}")


def _arguments_text(arguments: Any, where: str) -> str:
    if arguments is None:
        return "{}"
    if isinstance(arguments, str):
        return arguments
    if isinstance(arguments, Mapping):
        return json.dumps(arguments, ensure_ascii=False)
    raise ValueError(f"{where} must be a JSON string or an object, got {type(arguments).__name__}")


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-format messages → the plain dicts the chat template expects.

    Errors: `ValueError` naming the message index and field.
    """
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}")
        role = "system" if role == "developer" else role
        norm: dict[str, Any] = {"role": role, "content": content_text(msg.get("content"), f"messages[{i}].content")}
        if role == "assistant":
            reasoning = msg.get("reasoning_content")
            if isinstance(reasoning, str):
                norm["reasoning_content"] = reasoning
            calls = []
            for j, call in enumerate(msg.get("tool_calls") or ()):
                where = f"messages[{i}].tool_calls[{j}]"
                fn = call.get("function") if isinstance(call, Mapping) else None
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                    raise ValueError(f"{where}.function.name must be a string")
                calls.append(
                    {
                        "id": call.get("id"),
                        "type": "function",
                        "function": {
                            "name": fn["name"],
                            "arguments": _arguments_text(fn.get("arguments"), f"{where}.function.arguments"),
                        },
                    }
                )
            if calls:
                norm["tool_calls"] = calls
        elif role == "tool":
            for key in ("tool_call_id", "name"):
                if msg.get(key) is not None:
                    norm[key] = msg[key]
        out.append(norm)
    return out


def render(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    *,
    enable_thinking: bool | None = None,
) -> str:
    """Prompt text for `messages` (and `tools`, OpenAI `{"type": "function", ...}` objects).

    `tokenizer` is any HF tokenizer carrying a chat template (gyre.tokenizer.build_tokenizer
    or gyre.model.load_tokenizer). `enable_thinking=False` ends the generation prompt with
    an empty think block (Qwen3's switch); None leaves the template's default.
    Errors: `ValueError` for malformed messages (see `normalize_messages`).
    """
    kwargs: dict[str, Any] = {}
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    text = tokenizer.apply_chat_template(
        normalize_messages(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **kwargs,
    )
    if not isinstance(text, str):  # a template that returns a batch or ids would break TITO
        raise ValueError(f"chat template returned {type(text).__name__}, expected str")
    return text


def _tool_call(body: str, call_id: str) -> ToolCall | None:
    """A ToolCall from a <tool_call> body, or None when the body is not a valid call."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(id=call_id, name=name, arguments=json.dumps(args, ensure_ascii=False))


def parse_completion(text: str, *, id_prefix: str = "call") -> Parsed:
    """Split a Qwen3-format completion into content, reasoning and tool calls.

    `text` is the decoded completion; a trailing <|im_end|> / <|endoftext|> is dropped.
    Reasoning is recognised only with a closing </think> (the opening <think> may sit in
    the prompt); an unclosed <think> stays in the content. Each `<tool_call>` block whose
    body is a JSON object with a string "name" and an object "arguments" (or a JSON string
    of one) becomes a ToolCall with id "<id_prefix>_<i>"; other blocks stay in the content.
    When tool calls are found the remaining content is stripped of surrounding whitespace.
    Never raises.
    """
    try:
        return _parse(text, id_prefix)
    except Exception:  # defensive: parsing policy output must never fail a call
        return Parsed(content=text if isinstance(text, str) else str(text), reasoning=None, tool_calls=())


def _parse(text: str, id_prefix: str) -> Parsed:
    stripped = True
    while stripped:
        stripped = False
        for stop in STOP_TEXTS:
            if text.endswith(stop):
                text, stripped = text[: -len(stop)], True

    reasoning: str | None = None
    content = text
    if "</think>" in text:
        head, _, tail = text.partition("</think>")
        before, _, inner = head.rpartition("<think>")
        reasoning = inner.strip() or None
        before, tail = before.strip(), tail.lstrip("\n")
        content = f"{before}\n\n{tail}" if before and tail else (before or tail)

    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in _TOOL_CALL_RE.finditer(content):
        call = _tool_call(m.group(1).strip(), f"{id_prefix}_{len(calls)}")
        if call is None:
            continue  # malformed: the block stays in the content
        kept.append(content[pos : m.start()])
        pos = m.end()
        calls.append(call)
    if calls:
        kept.append(content[pos:])
        content = "".join(kept).strip()
    return Parsed(content=content, reasoning=reasoning, tool_calls=tuple(calls))
