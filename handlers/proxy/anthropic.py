"""Anthropic Messages wire shape of the proxy (`POST /v1/messages`, `/v1/messages/count_tokens`).

Requests → internal chat messages (handlers/proxy/api.py):
- `system`: a string or text blocks, joined with a blank line; a block starting with
  `x-anthropic-billing-header:` is dropped. Claude Code changes its hash after compaction;
  it is transport metadata, not an instruction, so it is neither rendered nor matched
  (the prompt ids are what the model sees, and the model never sees it).
- `messages[i]`: content a string or blocks. User: `text` (blocks of one message joined
  with a blank line), `document` → its title and context, one a line, a blank line, its
  text (a `text` source's data, a `content` source's text blocks; a PDF or URL source a
  placeholder), `search_result` → its title and source, a blank line, its content's text,
  `image` → a placeholder, `tool_result` {tool_use_id,
  content string|blocks, is_error → "Error: " prefix} → a `tool` message (texts around
  tool results become user messages), results in the order of the `tool_use` blocks they
  answer; a `tool_use_id` no earlier `tool_use` has is a 400 naming it
  (`handlers.proxy.api.tool_results_in_call_order`). Assistant: `thinking` →
  `reasoning_content`, `text` → content, `tool_use` {id, name, input} → a tool call whose
  arguments are the JSON text of `input`; `redacted_thinking` and server-tool blocks dropped.
  `role: "system"` entries mid-conversation stay system messages. `cache_control` anywhere
  is ignored (so a moving cache marker, or a string that became one text block, does not
  change the conversation).
- `tools`: `{name, description, input_schema}` → function tools (a custom tool without a
  string `name` or an `input_schema` object is a 400); Anthropic-defined tools (`type`
  other than `custom`) are not rendered.
- `max_tokens` (capped), `temperature`, `top_p`, `top_k`, `stop_sequences`; `stream`; `thinking`,
  `context_management`, `output_config` (a `json_schema` format marks a title call),
  `metadata` (its `user_id`, a JSON string holding `session_id`, becomes harness metadata),
  unknown fields and any model name are accepted.
Answers: content blocks `thinking` (with a `signature` that `thinking_signature` re-derives,
so a harness that echoes it matches), `text`, `tool_use` (ids `toolu_…`); `stop_reason`
`tool_use` | `max_tokens` | `end_turn` | `stop_sequence` (with `stop_sequence`, the text cut
before it); usage `input_tokens` = the whole prompt length.
Streams: `message_start` (with the true prompt length; sent when the stream opens,
`handlers.proxy.http.Reply`), `ping` keep-alives, per block `content_block_start` /
`content_block_delta` (`thinking_delta` + `signature_delta`, `text_delta`, `input_json_delta` whose first
fragment is "" and whose fragments concatenate to the input's JSON) / `content_block_stop`,
`message_delta` (stop reason, usage), `message_stop`; no `[DONE]`.
Errors: `{"type": "error", "error": {"type", "message"}}`, the type from the HTTP status;
in a stream an `error` event.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import orjson

from handlers.proxy.api import (
    Answer, Api, ApiError, MessageMemo, ModelRequest, StreamStart, check_count, flag, function_tool, parse_sampling,
    pieces, sse, tool_results_in_call_order, unique_hex,
)
from schemas.call import SamplingParams

BILLING_PREFIX = "x-anthropic-billing-header:"

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error", 500: "api_error", 502: "api_error", 503: "overloaded_error",
               529: "overloaded_error"}


def thinking_signature(thinking: str) -> str:
    """The signature the proxy attaches to a thinking block: `gyre-` + SHA-256 hex of its text."""
    return "gyre-" + hashlib.sha256(thinking.encode("utf-8")).hexdigest()


def _blocks_text(content: Any, where: str) -> str:
    """Text of a string or a list of text/image/document blocks, blocks joined by a blank line."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of content blocks")
    texts = []
    for block in content:
        if isinstance(block, str):
            texts.append(block)
        elif isinstance(block, dict):
            kind = block.get("type", "text")
            if not isinstance(kind, str):
                raise ApiError(400, f"{where} has a block whose 'type' is not a string")
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise ApiError(400, f"{where} has a text block whose 'text' is not a string")
                texts.append(block["text"])
            elif kind == "document":
                texts.append(_document_text(block, where))
            elif kind == "search_result":
                texts.append(_titled(block, ("title", "source"),
                                     _blocks_text(block.get("content"), f"{where} (search_result content)")))
            elif kind == "image":
                texts.append("[image]")
        else:
            raise ApiError(400, f"{where} has a block that is not an object")
    return "\n\n".join(texts)


def _titled(block: dict, fields: tuple[str, ...], text: str) -> str:
    """`text` after the block's string `fields` that are set, one a line, and a blank line."""
    head = "\n".join(block[f] for f in fields if isinstance(block.get(f), str) and block[f])
    return f"{head}\n\n{text}" if head else text


def _document_text(block: dict, where: str) -> str:
    """A `document` block's text after its `title` and `context`: a plain-text source's
    `data`, a content source's text blocks; other sources (PDF as base64, URL, file id) are
    a placeholder, as images are."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "text" and isinstance(source.get("data"), str):
        text = source["data"]
    elif kind == "content":
        text = _blocks_text(source.get("content"), f"{where} (document content)")
    else:
        text = "[document]"
    return _titled(block, ("title", "context"), text)


def system_text(system: Any) -> str:
    """The rendered system prompt: text blocks joined by a blank line, the billing line dropped."""
    if system is None:
        return ""
    if isinstance(system, str):
        return "" if system.startswith(BILLING_PREFIX) else system
    if not isinstance(system, list):
        raise ApiError(400, "'system' must be a string or a list of text blocks", param="system")
    kept = [b for b in system if not (isinstance(b, dict) and isinstance(b.get("text"), str)
                                      and b["text"].startswith(BILLING_PREFIX))]
    return _blocks_text(kept, "system")


def _user(content: Any, where: str) -> list[dict]:
    if not isinstance(content, list):
        return [{"role": "user", "content": _blocks_text(content, where)}]
    out: list[dict] = []
    texts: list[dict] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": _blocks_text(texts, where)})
            texts.clear()

    for j, block in enumerate(content):
        if isinstance(block, dict) and block.get("type") == "tool_result":
            flush()
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str):
                raise ApiError(400, f"{where}[{j}].tool_use_id must be a string", param="messages")
            text = _blocks_text(block.get("content"), f"{where}[{j}].content")
            if block.get("is_error"):
                text = "Error: " + text
            out.append({"role": "tool", "tool_call_id": tool_use_id, "content": text})
        else:
            texts.append(block)
    flush()
    return out


def _assistant(content: Any, where: str) -> dict:
    if not isinstance(content, list):
        return {"role": "assistant", "content": _blocks_text(content, where)}
    texts, thinking, calls = [], [], []
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise ApiError(400, f"{where}[{j}] must be an object", param="messages")
        kind = block.get("type")
        if not isinstance(kind, str):
            raise ApiError(400, f"{where}[{j}].type must be a string", param="messages")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise ApiError(400, f"{where}[{j}].text must be a string", param="messages")
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise ApiError(400, f"{where}[{j}] (tool_use) needs string 'id' and 'name'", param="messages")
            args = block.get("input")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(args if args is not None else {}, ensure_ascii=False)}})
    msg: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(texts)}
    if thinking:
        msg["reasoning_content"] = "\n\n".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _message(i: int, m: Any) -> list[dict]:
    """Internal messages of `messages[i]`. Raises ApiError(400)."""
    where = f"messages[{i}].content"
    if not isinstance(m, dict):
        raise ApiError(400, f"messages[{i}] must be an object", param="messages")
    role = m.get("role")
    if role == "user":
        return _user(m.get("content"), where)
    if role == "assistant":
        return [_assistant(m.get("content"), where)]
    if role == "system":
        return [{"role": "system", "content": system_text(m.get("content"))}]
    raise ApiError(400, f"messages[{i}].role must be user, assistant or system, got {role!r}", param="messages")


def anthropic_messages(body: dict, memo: MessageMemo | None = None) -> list[dict]:
    """`system` + `messages` → internal chat messages (module docstring). memo: the
    execution's `MessageMemo` (messages seen in its earlier requests are not converted
    again). Raises ApiError(400)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    check_count(messages, "messages")
    out: list[dict] = []
    system = system_text(body.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    if memo is not None:
        out.extend(memo.convert(messages, _message))
    else:
        for i, m in enumerate(messages):
            out.extend(_message(i, m))
    return tool_results_in_call_order(out, "messages")


def anthropic_tools(tools: Any) -> list[dict] | None:
    """Custom tools in chat form; Anthropic-defined tools (a `type` other than `custom` or null, e.g.
    `web_search_20250305`) are not rendered. Raises ApiError(400) for a tool that is not an
    object, or a custom tool without a string `name` and an `input_schema` object (as the
    hosted API does: rendered without them, the policy would see another tool set)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ApiError(400, f"tools.{i} must be an object", param="tools")
        if tool.get("type") not in (None, "custom"):  # null: the SDK's models dump an unset type so
            continue
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise ApiError(400, f"tools.{i}: a custom tool needs a string 'name' and an 'input_schema' object",
                           param="tools")
        out.append(function_tool(tool, tool["input_schema"]))
    return out or None


def _session_of(metadata: Any) -> dict:
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    if not isinstance(user_id, str):
        return {}
    try:
        parsed = orjson.loads(user_id)
    except orjson.JSONDecodeError:
        return {"user_id": user_id}
    if isinstance(parsed, dict) and isinstance(parsed.get("session_id"), str):
        return {"session_id": parsed["session_id"]}
    return {}


def parse_messages_request(body: Any, defaults: SamplingParams, memo: MessageMemo | None = None) -> ModelRequest:
    """Validate a Messages (or count_tokens) body (module docstring); memo: see
    `anthropic_messages`. Raises ApiError(400)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    messages = anthropic_messages(body, memo)
    tools = anthropic_tools(body.get("tools"))
    sampling = parse_sampling(body, defaults, ("max_tokens",), "stop_sequences")
    json_output = False
    for key in ("output_config", "output_format"):
        cfg = body.get(key)
        fmt = cfg.get("format", cfg) if isinstance(cfg, dict) else None
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            json_output = True
    model = body.get("model") if isinstance(body.get("model"), str) else ""
    thinking = body.get("thinking")
    return ModelRequest(api="messages", messages=messages, tools=tools, stream=flag(body, "stream"),
                        sampling=sampling, model=model, json_output=json_output,
                        options={"thinking": thinking.get("type") if isinstance(thinking, dict) else None},
                        body_meta=_session_of(body.get("metadata")))


def stop_reason(answer: Answer) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` of an answer: `max_tokens` for a
    length cut, then tool calls win over a stop sequence (a harness runs the tools of a
    `tool_use` answer and may stop on any other reason)."""
    if answer.finish == "length":
        return "max_tokens", None
    if answer.tool_calls:
        return "tool_use", None
    if answer.stop_sequence is not None:
        return "stop_sequence", answer.stop_sequence
    return "end_turn", None


def content_blocks(answer: Answer) -> list[dict]:
    """The answer's content blocks, complete. A tool's `input` is the arguments text the
    policy wrote (`gyre.serving.chat.ToolCall.arguments`, a JSON object), embedded as it is
    (`orjson.Fragment`), as the streamed `input_json_delta`s carry it: parsed and written
    again, an integer beyond 64 bits would reach the harness as a float."""
    blocks: list[dict] = []
    if answer.reasoning:
        blocks.append({"type": "thinking", "thinking": answer.reasoning,
                       "signature": thinking_signature(answer.reasoning)})
    if answer.content:
        blocks.append({"type": "text", "text": answer.content})
    for tc in answer.tool_calls:
        blocks.append({"type": "tool_use", "id": tc.id, "name": tc.name, "input": orjson.Fragment(tc.arguments)})
    if not blocks:
        blocks.append({"type": "text", "text": ""})
    return blocks


class MessagesApi(Api):
    name = "messages"
    keepalive = b'event: ping\ndata: {"type": "ping"}\n\n'

    def new_id(self) -> str:
        return f"msg_{unique_hex()}"

    def tool_id_prefix(self, key: str) -> str:
        return "toolu_" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:24]

    def error_body(self, err: ApiError) -> dict:
        kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": err.message}}

    def sse_error(self, err: ApiError, start: StreamStart | None = None) -> bytes:
        return sse(self.error_body(err), "error")

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"input_tokens": prompt_tokens, "output_tokens": completion_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}

    def preamble(self, start: StreamStart, req: ModelRequest) -> list[bytes]:
        message = {"id": start.rid, "type": "message", "role": "assistant", "model": req.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": self._usage(start.prompt_tokens, 0)}
        return [sse({"type": "message_start", "message": message}, "message_start"), self.keepalive]

    def render(self, answer: Answer, req: ModelRequest) -> dict | list[bytes]:
        blocks = content_blocks(answer)
        usage = self._usage(answer.prompt_tokens, answer.completion_tokens)
        reason, sequence = stop_reason(answer)
        if not req.stream:
            return {"id": answer.rid, "type": "message", "role": "assistant", "model": req.model, "content": blocks,
                    "stop_reason": reason, "stop_sequence": sequence, "usage": usage}
        frames: list[bytes] = []
        raw_args = {tc.id: tc.arguments for tc in answer.tool_calls}

        def emit(kind: str, **fields: Any) -> None:
            frames.append(sse({"type": kind, **fields}, kind))

        for index, block in enumerate(blocks):
            kind = block["type"]
            if kind == "thinking":
                emit("content_block_start", index=index, content_block={"type": "thinking", "thinking": "",
                                                                        "signature": ""})
                for p in pieces(block["thinking"]):
                    emit("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": p})
                emit("content_block_delta", index=index, delta={"type": "signature_delta",
                                                                "signature": block["signature"]})
            elif kind == "text":
                emit("content_block_start", index=index, content_block={"type": "text", "text": ""})
                for p in pieces(block["text"]):
                    emit("content_block_delta", index=index, delta={"type": "text_delta", "text": p})
            else:
                emit("content_block_start", index=index, content_block={**block, "input": {}})
                args = raw_args[block["id"]]  # the text the model wrote: JSON-equal to `input`
                for p in ["", *pieces(args)]:
                    emit("content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": p})
            emit("content_block_stop", index=index)
        emit("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage)
        emit("message_stop")
        return frames
