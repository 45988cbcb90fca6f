"""Chat rendering and completion parsing in the Qwen3 format.

- `render` turns OpenAI-format messages (+ tools) into the prompt text through the
  tokenizer's chat template (gyre/serving/templates/qwen3_chat.jinja on the embedded default).
  Messages are normalised first: `developer` → `system`, content parts → one string,
  tool-call arguments → JSON text. Invalid input raises `ValueError` naming the message.
- `added_tools_text` is what a system message says that makes tools available mid-conversation
  (Responses `additional_tools` items), in the header's tool format.
- `parse_completion` splits a completion's text into reasoning (`<think>…</think>`),
  content, and tool calls (`<tool_call>{"name": …, "arguments": {…}}</tool_call>`).
  It never raises: a malformed or unclosed block stays in the content as plain text (but
  a completion cut short inside its opening `<think>` is reasoning).

- `render_appended` / `render_assistant_turn` render only what a conversation's tail adds,
  for gyre's own template (`uses_gyre_template`); `is_query` / `shows_reasoning` are the
  two facts about earlier messages that tail depends on (section "incremental rendering").

Rendering a conversation and then appending an assistant turn (without generation
prompt) yields a string prefix of the rendering of any continuation that adds tool
results or assistant turns; TITO prefix matching (gyre.serving.tito) relies on it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
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


MEDIA_PLACEHOLDERS = {"image_url": "[image]", "input_audio": "[audio]"}
"""What the policy sees for a Chat Completions media part (it reads text only); the
Responses and Messages parsers give their image, audio and file parts the same."""


def _media_text(part: Mapping) -> str | None:
    """A non-text part's text (a placeholder; a refusal's own text), or None when unknown."""
    kind = part.get("type")
    if kind in MEDIA_PLACEHOLDERS:
        return MEDIA_PLACEHOLDERS[kind]
    if kind == "file":
        file = part.get("file")
        name = file.get("filename") if isinstance(file, Mapping) else None
        return f"[file {name}]" if isinstance(name, str) and name else "[file]"
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return part["refusal"]
    return None


def content_text(content: Any, where: str = "content") -> str:
    """Flatten message content (None, str, or a list of parts) into one string: text parts
    as they are, images, audio and files as placeholders (`MEDIA_PLACEHOLDERS`), a
    refusal part as its text.

    Errors: `ValueError` for a part of another type (or a `type` that is not a string) or
    an unsupported content type.
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
            elif isinstance(part, Mapping) and not isinstance(part.get("type", "text"), str):
                raise ValueError(f"{where}[{i}].type must be a string, got {type(part.get('type')).__name__}")
            elif isinstance(part, Mapping) and part.get("type", "text") in TEXT_PART_TYPES:
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError(f"{where}[{i}].text must be a string, got {type(text).__name__}")
                out.append(text)
            elif isinstance(part, Mapping) and (media := _media_text(part)) is not None:
                out.append(media)
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"{where}[{i}] has unsupported part type {kind!r}; only text, image_url, "
                                 "input_audio, file and refusal parts")
        return "".join(out)
    raise ValueError(f"{where} must be a string or a list of text parts, got {type(content).__name__}")


def _arguments_text(arguments: Any, where: str) -> str:
    """A tool call's arguments as JSON text; none (None, "", blank: what some clients send
    for a call without arguments) is `{}`, so the template writes valid JSON."""
    if arguments is None:
        return "{}"
    if isinstance(arguments, str):
        return arguments if arguments.strip() else "{}"
    if isinstance(arguments, Mapping):
        return _DUMPS(arguments)
    raise ValueError(f"{where} must be a JSON string or an object, got {type(arguments).__name__}")


def custom_arguments(value: Any) -> str:
    """The arguments a custom tool call's free-form `value` is rendered with: `{"input": value}`
    as JSON text (Chat `custom` calls and Responses `custom_tool_call` items alike)."""
    return _DUMPS({"input": value})


def custom_input(arguments: str) -> str:
    """The free-form input of a custom tool call the policy wrote as `arguments` (JSON text):
    its `input` when that is a string and the only key (the form `custom_arguments` renders
    and `handlers.proxy.api.custom_tool` asks for), else the arguments text itself, so
    nothing the policy wrote is dropped (`gyre.serving.normalise` matches either form when the harness
    sends the call back)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    if isinstance(value, dict) and len(value) == 1 and isinstance(value.get("input"), str):
        return value["input"]
    return arguments


def call_function(call: Any) -> Any:
    """The `function` ({"name", "arguments"}) of a Chat tool call; a call of type `custom`
    (OpenAI's shape for custom tools: {"custom": {"name", "input"}}) as a function whose
    arguments are `{"input": …}`, as a Responses `custom_tool_call` is rendered. None when
    `call` is not an object."""
    if not isinstance(call, Mapping):
        return None
    custom = call.get("custom") if call.get("type") == "custom" else None
    if isinstance(custom, Mapping):
        text = custom.get("input")
        return {"name": custom.get("name"), "arguments": custom_arguments("" if text is None else text)}
    return call.get("function")


def added_tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The content of a system message that makes `tools` (chat-form function tools)
    available from its place in a conversation on (Responses `additional_tools` items):
    the list written as the template's header writes its tools (one JSON object a line
    inside `<tools></tools>`) and how to call them, so the policy reads them as it reads
    the first ones."""
    listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("# Additional tools\n\nThese functions are available from here on, beside any listed before. "
            "Their signatures are within <tools></tools> XML tags:\n<tools>" + listed + "\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


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
                fn = call_function(call)
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                    raise ValueError(f"{where}.function.name must be a string")
                if not isinstance(call.get("id"), (str, type(None))):  # (gyre.serving.normalise refuses them first in the proxy)
                    raise ValueError(f"{where}.id must be a string")
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
                    if not isinstance(msg[key], str):
                        raise ValueError(f"messages[{i}].{key} must be a string")
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

    `tokenizer` is any HF tokenizer carrying a chat template (gyre.serving.tokenizer.build_tokenizer
    or gyre.serving.model.load_tokenizer). `enable_thinking=False` ends the generation prompt with
    an empty think block (Qwen3's switch); None leaves the template's default.
    Errors: `ValueError` for malformed messages (see `normalize_messages`).
    """
    kwargs: dict[str, Any] = {}
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    norm, tool_list = normalize_messages(messages), list(tools) if tools else None
    plain = bool(norm) and all(isinstance(t, dict) for t in tool_list or ())
    compiled = _compiled(tokenizer.chat_template) if plain and uses_gyre_template(tokenizer) else None
    if compiled is not None:
        # gyre's template reads only messages, tools, add_generation_prompt and
        # enable_thinking: render it directly, without apply_chat_template's per-call deep
        # copies of the conversation (tests/test_chat.py checks the two agree). Tools given
        # as functions or other objects, and empty conversations, take transformers' path.
        text = compiled.render(messages=norm, tools=tool_list, add_generation_prompt=add_generation_prompt, **kwargs)
    else:
        text = tokenizer.apply_chat_template(norm, tools=tool_list, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **kwargs)
    if not isinstance(text, str):  # a template that returns a batch or ids would break TITO
        raise ValueError(f"chat template returned {type(text).__name__}, expected str")
    return text


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 reads as inf, which JSON cannot carry back
        raise ValueError(f"{text} overflows a double")
    return value


TOOL_ARGS_DEPTH = 64
"""Deepest nesting of tool-call arguments read as a call (orjson, which the proxy compares
messages with, stops at 255; no real tool takes more than a few levels)."""


def _depth_ok(value: Any, depth: int = 0) -> bool:
    if depth > TOOL_ARGS_DEPTH:
        return False
    if isinstance(value, dict):
        return all(_depth_ok(v, depth + 1) for v in value.values())
    if isinstance(value, list):
        return all(_depth_ok(v, depth + 1) for v in value)
    return True


_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)
_DUMPS = json.JSONEncoder(ensure_ascii=False).encode
"""Made once: `json.loads` / `json.dumps` with options build a decoder / encoder per call."""


def _loads(text: str) -> Any:
    return _DECODER.decode(text)


def _tool_call(body: str, call_id: str) -> ToolCall | None:
    """A ToolCall from a <tool_call> body, or None when the body is not a valid call:
    not JSON (NaN, Infinity and overflowing numbers included, which Python's json reads
    but JSON cannot carry), no name, arguments not an object or nested deeper than
    TOOL_ARGS_DEPTH, or a name or arguments holding an unpaired surrogate (`"\\ud800"`:
    Python's json reads the escape, but no UTF-8 answer can carry the character)."""
    try:
        obj = _loads(body)
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
            args = _loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict) or not _depth_ok(args):
        return None
    arguments = _DUMPS(args)
    try:
        name.encode()
        arguments.encode()
    except UnicodeEncodeError:
        return None
    return ToolCall(id=call_id, name=name, arguments=arguments)


def parse_completion(text: str, *, id_prefix: str = "call", cut: bool = False) -> Parsed:
    """Split a Qwen3-format completion into content, reasoning and tool calls.

    `text` is the decoded completion; a trailing <|im_end|> / <|endoftext|> is dropped.
    Reasoning is what precedes a closing </think> (after an opening <think>, which may sit
    in the prompt); a completion that opens with <think> and never closes it (cut short by
    `max_tokens` or a stop string) is all reasoning, as SGLang's Qwen3 reasoning parser
    reads it; an unclosed <think> after other text stays in the content. Each `<tool_call>` block whose
    body is a JSON object with a string "name" and an object "arguments" (or a JSON string
    of one) becomes a ToolCall with id "<id_prefix>_<i>"; other blocks stay in the content.
    When tool calls are found the remaining content is stripped of surrounding whitespace.
    `cut`: the completion was cut short, by the token cap or a stop string, in a request
    that offered tools: a last `<tool_call>` it never closed is a call the cut interrupted,
    not text, and is left out of the content (what SGLang's Qwen tool parser does with it;
    a hosted API never shows tool-call markup as text); the ids keep it. Otherwise an
    unclosed block is malformed output and stays text. Never raises.
    """
    try:
        return _parse(text, id_prefix, cut)
    except Exception:  # defensive: parsing policy output must never fail a call
        return Parsed(content=text if isinstance(text, str) else str(text), reasoning=None, tool_calls=())


def _parse(text: str, id_prefix: str, cut: bool = False) -> Parsed:
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
    elif (opened := text.lstrip()).startswith("<think>"):  # cut short while thinking (max_tokens, a stop string)
        return Parsed(content="", reasoning=opened[len("<think>"):].strip() or None, tool_calls=())

    if cut and (start := content.rfind("<tool_call>")) >= 0 and "</tool_call>" not in content[start:]:
        content = content[:start].rstrip()
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


# --------------------------------------------------------------------------- incremental rendering
#
# TITO (gyre.serving.tito) renders only the messages a call adds to its parent's conversation.
# That is exact for gyre's own template (gyre/serving/templates/qwen3_chat.jinja), where a
# message's rendering depends on the rest of the conversation only through:
#   - whether it is the first message (a leading system message becomes the tools header;
#     never the case for an appended message),
#   - the previous message's role (a run of tool messages is one user turn; an appended
#     run always follows an assistant answer),
#   - the position of the last real user query (`is_query`): an assistant shows its
#     reasoning only after it.
# Other templates (a checkpoint's own) are rendered in full; `uses_gyre_template` says which.

_SENTINEL_TEXT = "gyre"


def uses_gyre_template(tokenizer: Any) -> bool:
    """True when `tokenizer` renders with gyre's bundled Qwen3 template, whose locality
    `render_appended` relies on (a checkpoint saved by gyre carries the same text)."""
    return getattr(tokenizer, "chat_template", None) == _gyre_template()


@functools.lru_cache(maxsize=1)
def _gyre_template() -> str:
    from gyre.serving.tokenizer import chat_template

    return chat_template()


def is_query(message: Mapping[str, Any]) -> bool:
    """True for a real user query as gyre's template sees it: a `user` message whose text
    is not one wrapped tool response (`<tool_response>…</tool_response>`).
    Errors: `ValueError` for content `content_text` rejects (rendering would reject it too)."""
    if message.get("role") != "user":
        return False
    text = content_text(message.get("content"))
    return not (text.startswith("<tool_response>") and text.endswith("</tool_response>"))


def shows_reasoning(message: Mapping[str, Any]) -> bool:
    """True for an assistant message whose reasoning gyre's template renders when it comes
    after the last real user query: `reasoning_content` when it is a string, else the text
    between `<think>` and `</think>` in the content, non-empty once stripped."""
    if message.get("role") != "assistant":
        return False
    reasoning = message.get("reasoning_content")
    if not isinstance(reasoning, str):
        content = content_text(message.get("content"))
        reasoning = content.split("</think>")[0].split("<think>")[-1] if "</think>" in content else ""
    return bool(reasoning.strip("\n").strip())


_compiled_cache: dict[str, Any] = {}


def _render_fast(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """gyre's template on already-normalised messages, without tools: the compiled template
    transformers caches, called directly (apply_chat_template's per-call copying and
    conversion cost more than the template itself on a few messages). Falls back to
    `render` when that private helper is missing."""
    compiled = _compiled(tokenizer.chat_template)
    if compiled is None:  # pragma: no cover - depends on the transformers version
        return tokenizer.apply_chat_template(messages, tools=None, add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    return compiled.render(messages=messages, tools=None, add_generation_prompt=add_generation_prompt)


def _compiled(template: str) -> Any:
    """The template compiled the way transformers compiles it (its sandboxed Jinja
    environment and filters), cached; None when that private helper is missing."""
    compiled = _compiled_cache.get(template)
    if compiled is None:
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template
        except ImportError:  # pragma: no cover - depends on the transformers version
            return None
        compiled = _compiled_cache[template] = _compile_jinja_template(template)
    return compiled


def _cut_after_last_im_end(text: str) -> str:
    cut = text.rfind(STOP_TEXTS[0])
    if cut < 0:
        raise ValueError("the template rendered no <|im_end|>")
    return text[: cut + len(STOP_TEXTS[0])]


def _sentinel(after_query: bool) -> dict[str, str]:
    # A query sentinel keeps the last query before what follows; a system sentinel (not the
    # tools header: no tools are passed) keeps "no query yet".
    return {"role": "user" if after_query else "system", "content": _SENTINEL_TEXT}


_STAND_IN = {"role": "assistant", "content": _SENTINEL_TEXT}
_heads: dict[tuple[str, bool, bool], str] = {}


def _head(tokenizer: Any, after_query: bool, with_assistant: bool) -> str:
    """The rendered sentinel turn (+ a stand-in assistant), cut after its last <|im_end|>."""
    key = (tokenizer.chat_template, after_query, with_assistant)
    head = _heads.get(key)
    if head is None:
        msgs = [_sentinel(after_query), _STAND_IN] if with_assistant else [_sentinel(after_query)]
        head = _heads[key] = _cut_after_last_im_end(_render_fast(tokenizer, msgs, False))
    return head


def _check_template(tokenizer: Any) -> None:
    if not uses_gyre_template(tokenizer):
        raise ValueError("incremental rendering needs gyre's chat template (gyre/serving/templates/qwen3_chat.jinja)")


def render_appended(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, after_query: bool,
                    add_generation_prompt: bool = True) -> str:
    """The text `messages` (+ the generation prompt) add after a conversation that ends
    with an assistant message, in gyre's template: starting right after that assistant
    turn's `<|im_end|>`, so with "\n<|im_start|>" ("" for no messages and no prompt).

    For `conv` ending with an assistant message and `after_query` = any(is_query(m) for m
    in conv):  render(conv + messages, tools, g) == cut(render(conv, tools, False)) + this,
    where cut(t) ends right after t's last `<|im_end|>` — whenever that prefix relation
    holds at all: it fails exactly when `messages` hold a query while an assistant after
    conv's last query shows reasoning (`shows_reasoning`), which the new query hides.
    Cost: one render of a sentinel turn, a stand-in assistant and `messages`, whatever
    conv's length. Errors: `ValueError` for malformed messages (as `render`) or a
    tokenizer on another template (`uses_gyre_template`).
    """
    _check_template(tokenizer)
    norm = normalize_messages(messages)
    if all(m["role"] != "assistant" for m in norm):
        return _appended_without_assistant(norm, add_generation_prompt)
    head = _head(tokenizer, after_query, True)
    text = _render_fast(tokenizer, [_sentinel(after_query), _STAND_IN, *norm], add_generation_prompt)
    if not text.startswith(head):
        raise ValueError("the template does not render appended messages as a continuation")
    return text[len(head):]


def _appended_without_assistant(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """`render_appended` for normalised user / system / tool messages (what harnesses
    append: tool results, observations, reminders), written out from gyre's template —
    the same strings its loop emits for these roles after an assistant turn (tests check it
    against the template) — without the Jinja machinery, whose per-render cost is larger
    than the whole rest of a call's matching."""
    out = ["\n"]
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                out.append("<|im_start|>user")
            out.append("\n<tool_response>\n" + content + "\n</tool_response>")
            if i == len(messages) - 1 or messages[i + 1]["role"] != "tool":
                out.append("<|im_end|>\n")
        else:  # system (never the first message here) and user turns
            out.append("<|im_start|>" + role + "\n" + content + "<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    text = "".join(out)
    return text if len(text) > 1 else ""


def render_assistant_turn(tokenizer: Any, message: Mapping[str, Any], *, after_query: bool) -> str:
    """What an assistant `message` renders to in gyre's template when it ends a
    conversation (`after_query`: a real user query precedes it), starting right after the
    previous turn's `<|im_end|>` and ending with its own: "\n<|im_start|>assistant\n…<|im_end|>".
    Errors: as `render_appended`."""
    _check_template(tokenizer)
    if message.get("role") != "assistant":
        raise ValueError(f"render_assistant_turn renders an assistant message, got role {message.get('role')!r}")
    return "\n<|im_start|>assistant\n" + _assistant_body(normalize_messages([message])[0], after_query) + "<|im_end|>"


def _assistant_body(message: dict[str, Any], shows: bool) -> str:
    """The text gyre's template writes between an assistant turn's header and its
    `<|im_end|>`, for a normalised message (content a string, tool-call arguments JSON
    text); `shows`: the turn comes after the last real user query. Written out from the
    template's assistant branch (tests check it against the template)."""
    content = message["content"]
    reasoning = message.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].split("<think>")[-1]
            content = content.split("</think>")[-1].lstrip("\n")
    reasoning = reasoning.strip("\n")
    if shows and reasoning.strip():
        out = ["<think>\n" + reasoning + "\n</think>\n\n" + content.lstrip("\n")]
    else:
        out = [content]
    for i, call in enumerate(message.get("tool_calls") or ()):
        fn = call["function"]
        if i or content:
            out.append("\n")
        out.append('<tool_call>\n{"name": ' + _DUMPS(fn["name"]) + ', "arguments": '
                   + fn["arguments"] + "}\n</tool_call>")
    return "".join(out)
