"""OpenAI Chat Completions wire shape of the proxy; Responses is handlers/proxy/responses.py.

Chat Completions (`POST /v1/chat/completions`): `messages` in chat form (passed to TITO
as they are), `tools`, `stream`, `stream_options.include_usage`, `max_completion_tokens`
/ `max_tokens`, `temperature`/`top_p`/`top_k`, `stop` (a string or a list: the answer
ends before the one the completion stopped on), `logprobs` (every sampled token's
behaviour log-prob, as `call.completed` records it: `choices[].logprobs.content`, with the
token's text and bytes, `top_logprobs` empty; all the completion's tokens, thinking and
tool-call markup included, not only the content's; streamed, on the finish chunk); `n` > 1 and
`top_logprobs` > 0 refused (the engine returns the sampled token's log-prob only), and so
are the deprecated `functions` / `function_call` (rather than dropped unseen); `custom`
tools (free-form input) are shown as functions of one `input` string, and the policy's
call to one is answered in OpenAI's custom shape (`{"type": "custom", "custom": {name,
input}}`; streamed, the name first, then the input in pieces); an assistant's `custom`
tool call sent back is rendered as a function call with arguments `{"input": …}` (as
Responses' `custom_tool_call`); other fields ignored.
Streams: a role chunk, reasoning (`reasoning_content`) and content deltas, tool-call
deltas (index, id, type, name, then argument fragments), one finish chunk (`tool_calls` |
`stop` | `length`), a usage chunk when asked, `data: [DONE]`.
"""
from __future__ import annotations

from typing import Any

import orjson

from gyre.serving.chat import call_id_prefix, custom_input
from handlers.proxy.api import (
    Answer, Api, ApiError, ModelRequest, StreamStart, check_count, custom_tool, flag, internal_message,
    parse_sampling, pieces, sse, tool_results_in_call_order, unique_hex,
)
from schemas.call import SamplingParams


# --------------------------------------------------------------------------- Chat Completions


def parse_chat_request(body: Any, defaults: SamplingParams, memo: Any = None) -> ModelRequest:
    """Validate a Chat Completions body; unknown fields are ignored (messages pass through
    as sent, so `memo` is unused). Raises ApiError(400)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    check_count(messages, "messages")
    if not all(type(m) is dict for m in messages):
        i = next(i for i, m in enumerate(messages) if type(m) is not dict)
        raise ApiError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
    messages = tool_results_in_call_order(messages, "chat")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", param="tools")
    custom: set[str] = set()
    for i, tool in enumerate(tools or ()):
        if type(tool) is not dict:
            raise ApiError(400, f"tools[{i}] must be an object", param=f"tools[{i}]")
        kind = tool.get("type") or "function"
        if kind in ("function", "custom") and not (type(spec := tool.get(kind)) is dict
                                                  and isinstance(spec.get("name"), str)):
            raise ApiError(400, f"tools[{i}] is a {kind} tool without a '{kind}' object naming it",
                           param=f"tools[{i}].{kind}")
        if kind == "custom":
            if tool["custom"]["name"] in custom:
                raise ApiError(400, f"tools[{i}]: custom tool {tool['custom']['name']!r} has the name of another "
                                    "tool: the model could not tell them apart", param="tools")
            custom.add(tool["custom"]["name"])
    if custom and custom & {t["function"]["name"] for t in tools if (t.get("type") or "function") == "function"}:
        raise ApiError(400, "a custom tool and a function tool have the same name: the model could not tell them "
                            "apart", param="tools")
    if custom:  # shown as functions of one `input` string, their calls answered as custom calls
        tools = [custom_tool(t["custom"]["name"], t["custom"].get("description"), t["custom"].get("format"))
                 if t.get("type") == "custom" else t for t in tools]
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:  # dropped silently, the policy would never see the functions
            raise ApiError(400, f"'{legacy}' (deprecated by OpenAI) is not served; send 'tools' and "
                                "'tool_choice'", param=legacy)
    if body.get("n") not in (None, 1):
        raise ApiError(400, "only n = 1 is supported", param="n")
    top = body.get("top_logprobs")
    if top is not None and (type(top) is not int or not 0 <= top <= 20):
        raise ApiError(400, f"'top_logprobs' must be an integer from 0 to 20, got {top!r}"[:200], param="top_logprobs")
    if top:
        raise ApiError(400, "top_logprobs > 0 is not served: the engine returns only the sampled token's log-prob; "
                            "ask with logprobs: true and top_logprobs 0", param="top_logprobs")
    sampling = parse_sampling(body, defaults, ("max_completion_tokens", "max_tokens"), "stop")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    include_usage = flag(options or {}, "include_usage")
    fmt = body.get("response_format")
    json_output = isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object")
    model = body.get("model") if isinstance(body.get("model"), str) else ""
    return ModelRequest(api="chat", messages=messages, tools=tools or None, stream=flag(body, "stream"),
                        sampling=sampling, model=model, json_output=json_output,
                        options={"include_usage": include_usage, "logprobs": flag(body, "logprobs"),
                                 "custom": custom})


def answer_message(answer: Answer, custom: set[str] | frozenset[str] = frozenset()) -> dict:
    """The assistant message as OpenAI returns it: the recorded message, with content None
    when there are only tool calls, and a call of a custom tool (a name in `custom`) in
    OpenAI's custom shape `{"id", "type": "custom", "custom": {"name", "input"}}`
    (`gyre.serving.chat.custom_input`)."""
    msg = internal_message(answer)
    if not answer.content and answer.tool_calls:
        msg["content"] = None
    if custom and answer.tool_calls:
        msg["tool_calls"] = [
            {"id": tc.id, "type": "custom", "custom": {"name": tc.name, "input": custom_input(tc.arguments)}}
            if tc.name in custom else call for tc, call in zip(answer.tool_calls, msg["tool_calls"])]
    return msg


_ENTRY_HEADS: dict[bytes, bytes] = {}
"""A token's bytes → its log-prob entry's JSON up to the log-prob (at most one per id of
the vocabulary): the entries of a long answer are joined, not built as objects."""


def _entry_head(raw: bytes) -> bytes:
    head = _ENTRY_HEADS.get(raw)
    if head is None:
        head = orjson.dumps({"token": raw.decode("utf-8", "backslashreplace"), "bytes": list(raw),
                             "top_logprobs": []})[:-1] + b',"logprob":'
        if len(_ENTRY_HEADS) < 1 << 18:
            _ENTRY_HEADS[raw] = head
    return head


def chat_logprobs(answer: Answer) -> dict | None:
    """`choices[].logprobs` (None unless asked): `content`, one entry per sampled token (all
    of them: thinking, tool-call markup and the stop token included, not only the message
    content's), its text (bytes that are not whole UTF-8 characters as `\\x..` escapes),
    bytes and behaviour log-prob, `top_logprobs` empty. `content` is an `orjson.Fragment`
    (the JSON array, ≈ 80 bytes a token), written as it is by `orjson.dumps`."""
    if answer.token_logprobs is None:
        return None
    pairs = answer.token_logprobs
    if not pairs:
        return {"content": [], "refusal": None}
    values = orjson.dumps([lp for _, lp in pairs])[1:-1].split(b",")
    body = b"},".join(_entry_head(raw) + value for (raw, _), value in zip(pairs, values))
    return {"content": orjson.Fragment(b"[" + body + b"}]"), "refusal": None}


def chat_finish(answer: Answer) -> str:
    return "tool_calls" if answer.tool_calls and answer.finish == "stop" else answer.finish


class ChatApi(Api):
    name = "chat"

    def new_id(self) -> str:
        return f"chatcmpl-{unique_hex()}"

    def tool_id_prefix(self, key: str) -> str:
        return call_id_prefix(key)

    def sse_error(self, err: ApiError, start: StreamStart | None = None) -> bytes:
        return sse(err.body())

    def render(self, answer: Answer, req: ModelRequest) -> dict | list[bytes]:
        usage = {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
                 "total_tokens": answer.prompt_tokens + answer.completion_tokens,
                 "completion_tokens_details": {"reasoning_tokens": answer.reasoning_tokens}}
        message = answer_message(answer, req.options.get("custom", ()))
        finish = chat_finish(answer)
        logprobs = chat_logprobs(answer)
        head = {"id": answer.rid, "created": answer.created, "model": req.model}
        if not req.stream:
            return {**head, "object": "chat.completion",
                    "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
                    "usage": usage}
        include_usage = req.options.get("include_usage", False)

        def chunk(delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> bytes:
            out = {**head, "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}
            if include_usage:
                out["usage"] = None
            return sse(out)

        # Content null for an answer of only tool calls, as non-streamed (`answer_message`).
        frames = [chunk({"role": "assistant", "content": "" if message.get("content") is not None else None})]
        frames += [chunk({"reasoning_content": p}) for p in pieces(answer.reasoning or "")]
        frames += [chunk({"content": p}) for p in pieces(answer.content)]
        for i, tc in enumerate(message.get("tool_calls") or ()):
            if tc["type"] == "custom":  # as OpenAI streams one: the name first, then the input in pieces
                frames.append(chunk({"tool_calls": [{"index": i, "id": tc["id"], "type": "custom",
                                                     "custom": {"name": tc["custom"]["name"], "input": ""}}]}))
                frames += [chunk({"tool_calls": [{"index": i, "custom": {"input": p}}]})
                           for p in pieces(tc["custom"]["input"])]
                continue
            fn = tc["function"]
            frames.append(chunk({"tool_calls": [{"index": i, "id": tc["id"], "type": "function",
                                                 "function": {"name": fn["name"], "arguments": ""}}]}))
            frames += [chunk({"tool_calls": [{"index": i, "function": {"arguments": p}}]})
                       for p in pieces(fn["arguments"])]
        frames.append(chunk({}, finish, logprobs))
        if include_usage:
            frames.append(sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage}))
        frames.append(b"data: [DONE]\n\n")
        return frames
