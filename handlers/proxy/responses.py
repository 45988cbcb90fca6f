"""OpenAI Responses wire shape of the proxy (as Codex CLI uses it); Chat Completions is
handlers/proxy/openai.py.

Responses (`POST /v1/responses`): `input` (a string or items) and `instructions` become
chat messages: `message` items (roles user/assistant/system/developer → system; parts
`input_text`/`output_text`, images and files as placeholders), `function_call`
{call_id, name, arguments} joined onto the preceding assistant message (one with a `namespace`
named by its flat name, below), `function_call_output`
{call_id, output} → a tool message (its `call_id` must name a call item of the input: a
400 otherwise, `handlers.proxy.api.tool_results_in_call_order`), `custom_tool_call`/`_output`
likewise (input as `{"input": …}`), `reasoning` items' text (summary or content parts) →
the reasoning of the assistant turn they precede (as a Messages `thinking` block);
`additional_tools` {role: developer, tools} → a system message at its place listing those
tools as the header lists the request's (`gyre.serving.chat.added_tools_text`; converted as
`tools` are, and a call to one answered as a call to those); unknown items (web searches,
shell calls: nothing the template renders) dropped.
Tools: `function` tools, and the functions of a `namespace` tool (Codex's sub-agent tools)
under their flat name `namespace__name`, a call to one answered with `name` and
`namespace` apart, as Codex dispatches it; `custom` tools (free-form input, such as the
`apply_patch` Codex sends for the models it knows) shown as functions of one `input`
string, a call to one answered as a `custom_tool_call` item (streamed with
`response.custom_tool_call_input.delta`…, `.done`); `web_search`, `local_shell`, … are
tolerated and not rendered. `max_output_tokens`,
`temperature`, `top_p`. The proxy stores no responses or conversations: a request naming
`previous_response_id` or `conversation` is refused (400, `previous_response_not_found`
as the hosted API answers an unknown id), and so is an `item_reference` input item,
rather than answered without the history it stands for; so is a request for log-probs
(`include: ["message.output_text.logprobs"]`, `top_logprobs` > 0: the parts' `logprobs`
are always `[]`, which would read as an answer of no tokens). `text.format` (a JSON schema),
`reasoning.effort`, `tool_choice` and `background` are accepted and not acted on. Answers: output items `reasoning` (summary text), `message`
(one `output_text` part) and `function_call` (ids `fc_…`, call ids `call_…`); a stream is
`response.created`, `response.in_progress`, per item `response.output_item.added`,
(`response.content_part.added`, `response.output_text.delta`…, `response.output_text.done`,
`response.content_part.done` | `response.function_call_arguments.delta`…, `.done` |
`response.reasoning_summary_part.added`, `response.reasoning_summary_text.delta`…, `.done`,
`response.reasoning_summary_part.done`),
`response.output_item.done`, then `response.completed` with usage — also when the
completion hit the token cap: status `incomplete`, `incomplete_details.reason`
`max_output_tokens` (Codex retries a `response.incomplete` event as a broken stream).
Errors: OpenAI's `{"error": {...}}`; in a stream, `response.failed`.
"""
from __future__ import annotations

import json
import time
from typing import Any

from gyre.serving.chat import added_tools_text, call_id_prefix, custom_arguments, custom_input
from handlers.proxy.api import (
    Answer, Api, ApiError, ModelRequest, StreamStart, check_count, custom_tool, flag, function_tool,
    parse_sampling, pieces, sse, tool_results_in_call_order, unique_hex,
)
from schemas.call import SamplingParams


def _parts_text(content: Any, where: str) -> str:
    """Text of a Responses content value: a string or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of content parts", param="input")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise ApiError(400, f"{where} has a part that is not an object", param="input")
        kind = part.get("type")
        if isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            raise ApiError(400, f"{where}: a {kind} part needs a string 'text'", param="input")
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_image", "image"):
            texts.append("[image]")
        elif kind in ("input_file", "file"):
            texts.append(f"[file {part.get('filename') or ''}]".replace(" ]", "]"))
        elif kind == "input_audio":
            texts.append("[audio]")
    return "\n\n".join(texts)


def _reasoning_text(item: dict) -> str:
    """The text of a `reasoning` input item: its `content` parts (`reasoning_text`) when it
    has any, else its `summary` parts joined by a blank line; "" when only encrypted."""
    for field in ("content", "summary"):
        parts = item.get(field)
        if isinstance(parts, list):
            texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str) and p["text"]]
            if texts:
                return "\n\n".join(texts)
    return ""


def responses_messages(body: dict, added: list[dict] | None = None) -> list[dict]:
    """`instructions` + `input` → internal chat messages (module docstring). added: the
    tools of the input's `additional_tools` items are appended to it, as sent (their
    calls are answered by `responses_tools` of them). Raises ApiError(400)."""
    out: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, f"'instructions' must be a string, got {type(instructions).__name__}",
                       param="instructions")
    if instructions:
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list):
        raise ApiError(400, "'input' must be a string or a list of items", param="input")
    check_count(items, "input")
    reasoning: list[str] = []  # `reasoning` items' text, for the assistant turn they precede
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object", param="input")
        # without a type: a message when it has a role, else a reference (only `id` is required)
        kind = item.get("type") or ("message" if "role" in item else "item_reference" if "id" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role must be user, assistant, system or developer, got {role!r}",
                               param="input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _parts_text(item.get("content"), f"{where}.content")})
            if role == "assistant" and reasoning:
                out[-1]["reasoning_content"] = "\n\n".join(reasoning)
            reasoning = []  # reasoning not followed by its turn's answer belongs to no later turn
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise ApiError(400, f"{where} needs string 'call_id' and 'name'", param="input")
            if isinstance(item.get("namespace"), str) and item["namespace"]:
                name = flat_name(item["namespace"], name)  # as the policy wrote it (`responses_tools`)
            if kind == "function_call":
                args = item.get("arguments")  # JSON text; an object is taken as what it stands for
                args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False) if isinstance(
                    args, dict) else "{}"
            else:
                args = custom_arguments(item.get("input") or "")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and not reasoning:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning:
                    out[-1]["reasoning_content"] = "\n\n".join(reasoning)
                    reasoning = []
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise ApiError(400, f"{where} needs a string 'call_id'", param="input")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _parts_text(item.get("output"), f"{where}.output")})
            reasoning = []
        elif kind == "item_reference":  # a stored item: as `previous_response_id`, not to be dropped
            raise ApiError(400, f"{where}: item with id {str(item.get('id'))[:200]!r} not found: this proxy "
                                "stores no items; send the item itself", param="input")
        elif kind == "additional_tools":
            if item.get("role", "developer") != "developer":
                raise ApiError(400, f"{where}.role must be 'developer' (the only role that provides tools), "
                                    f"got {item.get('role')!r}"[:300], param="input")
            if not isinstance(item.get("tools"), list):
                raise ApiError(400, f"{where}.tools must be a list of tools", param="input")
            shown, _, _ = responses_tools(item["tools"], where=f"{where}.tools")
            if shown:
                out.append({"role": "system", "content": added_tools_text(shown)})
            if added is not None:
                added.extend(item["tools"])
            reasoning = []
        elif kind == "reasoning":  # its summary (ours is the whole reasoning) or its reasoning_text parts
            text = _reasoning_text(item)
            if text:
                reasoning.append(text)
        else:
            reasoning = []  # another item (a web search, a shell call) comes between it and its turn
        # Unknown kinds carry nothing the template renders. Reasoning only encrypted stays
        # unseen here; TITO restores what the policy wrote from the call it extends.
    if not out:
        raise ApiError(400, "'input' holds no message", param="input")
    return tool_results_in_call_order(out, "responses")


def flat_name(namespace: str, name: str) -> str:
    """The name the policy sees for function `name` of a `namespace` tool: Codex's
    canonical flat name (`multi_agent_v1__spawn_agent`), `__` between them."""
    return namespace.rstrip("_") + "__" + name.lstrip("_")


def responses_tools(tools: Any, where: str = "tools") -> tuple[list[dict] | None, dict[str, tuple[str, str]], set[str]]:
    """(function tools in chat form, {flat name: (namespace, name)}, custom tool names). The
    functions of a `namespace` tool (Codex's sub-agent tools: `{"type": "namespace", "name":
    "multi_agent_v1", "tools": [functions]}`) are shown under their flat name (`flat_name`);
    `custom` tools (free-form input, e.g. Codex's `apply_patch` for the models it knows) as
    functions of one `input` string (`handlers.proxy.api.custom_tool`), their calls answered
    as `custom_tool_call` items; other tool types are tolerated and not rendered. Raises
    ApiError(400) for a tool that is not an object, or a function, custom or namespace tool
    (or a namespace's function) without a string `name`. where: the field the tools are
    in, for error messages (`tools`, or an `additional_tools` item's `input[k].tools`)."""
    if tools is None:
        return None, {}, set()
    if not isinstance(tools, list):
        raise ApiError(400, f"'{where}' must be a list", param=where.partition("[")[0])
    out: list[dict] = []
    namespaces: dict[str, tuple[str, str]] = {}
    custom: set[str] = set()
    functions = {t["name"] for t in tools if isinstance(t, dict) and t.get("type") == "function"
                 and isinstance(t.get("name"), str)}
    names = functions | {t["name"] for t in tools if isinstance(t, dict) and t.get("type") == "custom"
                         and isinstance(t.get("name"), str)}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ApiError(400, f"{where}[{i}] must be an object", param=f"{where}[{i}]")
        if not isinstance(tool.get("type"), str):  # as the hosted API: a tool without one is not guessed at
            raise ApiError(400, f"{where}[{i}] needs a string 'type' ('function', 'custom', …)", param=f"{where}[{i}].type")
        if tool.get("type") in ("function", "custom", "namespace") and not isinstance(tool.get("name"), str):
            raise ApiError(400, f"{where}[{i}] is a {tool['type']} tool without a string 'name'", param=f"{where}[{i}].name")
        if tool.get("type") == "function":
            params = tool.get("parameters")
            out.append(function_tool(tool, params if isinstance(params, dict) else {}))
        elif tool.get("type") == "custom":
            if tool["name"] in custom or tool["name"] in functions:
                raise ApiError(400, f"{where}[{i}]: custom tool {tool['name']!r} has the name of another tool: the model "
                                    "could not tell them apart", param=where.partition("[")[0])
            out.append(custom_tool(tool["name"], tool.get("description"), tool.get("format")))
            custom.add(tool["name"])
        elif tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
            for j, inner in enumerate(tool["tools"]):
                if isinstance(inner, dict) and inner.get("type", "function") == "function":
                    if not isinstance(inner.get("name"), str):
                        raise ApiError(400, f"{where}[{i}].tools[{j}] is a function without a string 'name'",
                                       param=f"{where}[{i}].tools[{j}].name")
                    flat = flat_name(tool["name"], inner["name"])
                    if flat in names or flat in namespaces:  # the policy could not tell them apart
                        raise ApiError(400, f"tool {inner['name']!r} of namespace {tool['name']!r} is shown to the "
                                            f"model as {flat!r}, the name of another tool", param=where.partition("[")[0])
                    namespaces[flat] = (tool["name"], inner["name"])
                    params = inner.get("parameters")
                    out.append(function_tool({**inner, "name": flat}, params if isinstance(params, dict) else {}))
    return out or None, namespaces, custom


def parse_responses_request(body: Any, defaults: SamplingParams, memo: Any = None) -> ModelRequest:
    """Validate a Responses body (module docstring). `memo` is unused: input items are
    grouped across items, not converted one by one. Raises ApiError(400)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for field, what in (("previous_response_id", "Previous response"), ("conversation", "Conversation")):
        ref = body.get(field)
        if ref:
            ref = ref.get("id") if isinstance(ref, dict) else ref
            raise ApiError(400, f"{what} with id {str(ref)[:200]!r} not found: this proxy stores no responses or "
                                "conversations; send the whole conversation as input (store: false, as Codex CLI does)",
                           code="previous_response_not_found" if field == "previous_response_id" else None,
                           param=field)
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(x, str) for x in include)):
        raise ApiError(400, "'include' must be a list of strings", param="include")
    asked = ("include" if "message.output_text.logprobs" in (include or ())
             else "top_logprobs" if body.get("top_logprobs") not in (None, 0) else None)
    if asked:  # answered with `logprobs: []`, it would read as an answer of no tokens
        raise ApiError(400, "log-probs are not served on Responses (an answer's tokens are not split between its "
                            "output items); Chat Completions answers logprobs: true with every sampled token's",
                       param=asked)
    for field, kind, what in (("parallel_tool_calls", bool, "a boolean"), ("metadata", dict, "an object")):
        if body.get(field) is not None and not isinstance(body[field], kind):  # echoed in the Response
            raise ApiError(400, f"'{field}' must be {what}, got {type(body[field]).__name__}", param=field)
    added: list[dict] = []
    messages = responses_messages(body, added)
    tools, namespaces, custom = responses_tools(body.get("tools"))
    if added:  # answered as calls of those tools, wherever in the conversation they were offered
        _, more_namespaces, more_custom = responses_tools(added)
        namespaces, custom = {**more_namespaces, **namespaces}, custom | more_custom
    sampling = parse_sampling(body, defaults, ("max_output_tokens",))
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    json_output = isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object")
    model = body.get("model") if isinstance(body.get("model"), str) else ""
    echo = {k: body.get(k) for k in ("instructions", "tool_choice", "parallel_tool_calls", "reasoning",
                                     "metadata", "prompt_cache_key", "store", "tools", "max_output_tokens", "top_p")
            if k in body}
    if isinstance(fmt, dict):
        echo["text"] = text
    return ModelRequest(api="responses", messages=messages, tools=tools, stream=flag(body, "stream"),
                        sampling=sampling, model=model, json_output=json_output,
                        options={"echo": echo, "namespaces": namespaces, "custom": custom})


_CALL_EVENTS = {"function_call": ("arguments", "response.function_call_arguments"),
                "custom_tool_call": ("input", "response.custom_tool_call_input")}
"""A call item's type → (its streamed field, its events' prefix)."""


class ResponsesApi(Api):
    name = "responses"
    history = "input"

    def new_id(self) -> str:
        return f"resp_{unique_hex()}"

    def tool_id_prefix(self, key: str) -> str:
        return call_id_prefix(key)

    @staticmethod
    def _response(rid: str, created: int, req: ModelRequest, status: str, output: list, usage: dict | None,
                  incomplete: dict | None = None, error: dict | None = None) -> dict:
        echo = req.options.get("echo", {})
        return {
            "id": rid, "object": "response", "created_at": created, "status": status, "model": req.model,
            "output": output, "usage": usage, "error": error, "incomplete_details": incomplete,
            "instructions": echo.get("instructions"), "metadata": echo.get("metadata") or {},
            "parallel_tool_calls": echo.get("parallel_tool_calls", True), "tool_choice": echo.get("tool_choice", "auto"),
            "tools": echo.get("tools") or [], "temperature": req.sampling.temperature, "top_p": echo.get("top_p", req.sampling.top_p),
            "max_output_tokens": echo.get("max_output_tokens"), "reasoning": echo.get("reasoning"),
            "store": echo.get("store", False), "text": echo.get("text", {"format": {"type": "text"}}),
            "completed_at": int(time.time()) if status == "completed" else None,
        }

    def preamble(self, start: StreamStart, req: ModelRequest) -> list[bytes]:
        resp = self._response(start.rid, start.created, req, "in_progress", [], None)
        return [sse({"type": "response.created", "sequence_number": 0, "response": resp}, "response.created"),
                sse({"type": "response.in_progress", "sequence_number": 1, "response": resp}, "response.in_progress")]

    @staticmethod
    def _param(err: ApiError) -> str | None:
        """The request field an error names; the conversation is `input` here, where the
        shared errors (`context_exceeded`) name Chat's `messages`."""
        return "input" if err.param == "messages" else err.param

    def error_body(self, err: ApiError) -> dict:
        body = err.body()
        body["error"]["param"] = self._param(err)
        return body

    def sse_error(self, err: ApiError, start: StreamStart | None = None) -> bytes:
        error = {"code": err.code or err.type, "message": err.message}
        if start is None:
            return sse({"type": "error", "code": error["code"], "message": err.message, "param": self._param(err),
                        "sequence_number": 0}, "error")
        resp = {"id": start.rid, "object": "response", "created_at": start.created, "status": "failed",
                "model": start.model, "output": [], "error": error, "usage": None}
        return sse({"type": "response.failed", "sequence_number": 2, "response": resp}, "response.failed")

    @staticmethod
    def output_items(answer: Answer, namespaces: dict[str, tuple[str, str]],
                     custom: set[str] | frozenset[str] = frozenset()) -> list[dict]:
        """The answer's output items, complete; a call to a function of a `namespace` tool
        (`responses_tools`: its flat name → (namespace, name)) names both, as Codex
        dispatches it; a call of a custom tool (a name in `custom`) is a `custom_tool_call`
        item with its `input` (`gyre.serving.chat.custom_input`)."""
        key = answer.rid.removeprefix("resp_")
        items: list[dict] = []
        if answer.reasoning:
            items.append({"type": "reasoning", "id": f"rs_{key}", "status": "completed", "encrypted_content": None,
                          "summary": [{"type": "summary_text", "text": answer.reasoning}]})
        if answer.content or not answer.tool_calls:
            items.append({"type": "message", "id": f"msg_{key}", "role": "assistant", "status": "completed",
                          "content": [{"type": "output_text", "text": answer.content, "annotations": [],
                                       "logprobs": []}]})
        for i, tc in enumerate(answer.tool_calls):
            if tc.name in custom:
                items.append({"type": "custom_tool_call", "id": f"ctc_{key}_{i}", "call_id": tc.id, "name": tc.name,
                              "input": custom_input(tc.arguments), "status": "completed"})
                continue
            item = {"type": "function_call", "id": f"fc_{key}_{i}", "call_id": tc.id, "name": tc.name,
                    "arguments": tc.arguments, "status": "completed"}
            if tc.name in namespaces:
                item["namespace"], item["name"] = namespaces[tc.name]
            items.append(item)
        return items

    def render(self, answer: Answer, req: ModelRequest) -> dict | list[bytes]:
        usage = {"input_tokens": answer.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": answer.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": answer.reasoning_tokens},
                 "total_tokens": answer.prompt_tokens + answer.completion_tokens}
        items = self.output_items(answer, req.options.get("namespaces", {}), req.options.get("custom", ()))
        truncated = answer.finish == "length"
        for item in items if truncated else ():  # the cap cut the message short, as OpenAI marks it
            if item["type"] == "message":
                item["status"] = "incomplete"
        final = self._response(answer.rid, answer.created, req, "incomplete" if truncated else "completed", items,
                               usage, {"reason": "max_output_tokens"} if truncated else None)
        if not req.stream:
            return final
        frames: list[bytes] = []
        seq = 2  # after the preamble's response.created / response.in_progress

        def emit(kind: str, **fields: Any) -> None:
            nonlocal seq
            frames.append(sse({"type": kind, "sequence_number": seq, **fields}, kind))
            seq += 1

        for index, item in enumerate(items):
            if item["type"] == "message":
                part = item["content"][0]
                emit("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                               "content": []})
                emit("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                     part={**part, "text": ""})
                for p in pieces(part["text"]):
                    emit("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                         delta=p, logprobs=[])
                emit("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                     text=part["text"], logprobs=[])
                emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
            elif item["type"] in _CALL_EVENTS:  # a call's arguments (input) streamed in pieces
                field, events = _CALL_EVENTS[item["type"]]
                emit("response.output_item.added", output_index=index, item={**item, "status": "in_progress", field: ""})
                for p in pieces(item[field]):
                    emit(events + ".delta", item_id=item["id"], output_index=index, delta=p)
                done = {"name": item["name"]} if item["type"] == "function_call" else {}
                emit(events + ".done", item_id=item["id"], output_index=index, **done, **{field: item[field]})
            else:  # reasoning: its summary part streamed as OpenAI streams one (Codex shows these deltas)
                part = item["summary"][0]
                emit("response.output_item.added", output_index=index,
                     item={**item, "status": "in_progress", "summary": []})
                emit("response.reasoning_summary_part.added", item_id=item["id"], output_index=index,
                     summary_index=0, part={**part, "text": ""})
                for p in pieces(part["text"]):
                    emit("response.reasoning_summary_text.delta", item_id=item["id"], output_index=index,
                         summary_index=0, delta=p)
                emit("response.reasoning_summary_text.done", item_id=item["id"], output_index=index,
                     summary_index=0, text=part["text"])
                emit("response.reasoning_summary_part.done", item_id=item["id"], output_index=index,
                     summary_index=0, part=part)
            emit("response.output_item.done", output_index=index, item=item)
        emit("response.completed", response=final)
        return frames
