"""The official `anthropic` and `openai` SDKs stream and parse every answer the proxy sends
(Messages, Responses, Chat; text, thinking, tool calls), and their echoed conversations
extend the recorded calls token for token. No bus: the proxy's call store is read directly."""
from __future__ import annotations

import json

import pytest

from gyre.serving.tokenizer import IM_END
from handlers.engines.scripted import ScriptedEngine
from tests.test_proxy import Stack, encode, tok  # noqa: F401 - tok is a fixture

THINK_CALL = ('<think>\nI should list the files first.\n</think>\n\nLet me look.\n<tool_call>\n'
              '{"name": "bash", "arguments": {"command": "ls -la", "note": "caf\u00e9 \u2713"}}\n</tool_call>')
RAW_ARGS = '{"command": "ls -la", "note": "café ✓"}'
TOOLS_ANTHROPIC = [{"name": "bash", "description": "run a command",
                    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
TOOLS_RESPONSES = [{"type": "function", "name": "bash", "description": "run a command",
                    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}},
                   {"type": "web_search"}, {"type": "namespace", "name": "mcp", "description": "d", "tools": []},
                   {"type": "custom", "name": "apply_patch", "description": "patch"}]


@pytest.fixture
async def local(tok):  # noqa: F811 - the fixture of the same name
    s = Stack(tok, None, "sdk")
    yield s
    await s.close()


def full_ids(rec):
    return rec.full_ids().tolist()


async def test_anthropic_stream_events_then_echo_extends(local, tok):  # noqa: F811
    engine = await local.engine([THINK_CALL, "All done.", "The answer is long enough to be cut."])
    await local.proxy(engine=engine)
    client = local.anthropic("ex1")
    system1 = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=aaaa;"},
               {"type": "text", "text": "You are Claude Code."},
               {"type": "text", "text": "Be careful.", "cache_control": {"type": "ephemeral"}}]
    task = {"role": "user", "content": "List the files."}
    stream = await client.messages.create(
        model="claude-unknown-model", max_tokens=64000, system=system1, messages=[task], tools=TOOLS_ANTHROPIC,
        stream=True, thinking={"type": "adaptive"}, metadata={"user_id": json.dumps({"session_id": "s-1"})},
        extra_body={"context_management": {"edits": []}, "output_config": {"effort": "high"}},
        extra_headers={"anthropic-beta": "claude-code-20250219,some-unknown-flag-2099"})
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]  # (the SDK hides ping)
    assert events[0].message.usage.input_tokens == len(engine.requests[0]["input_ids"])
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert kinds.count("content_block_stop") == 3
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == "I should list the files first."
    assert [d.signature for d in deltas if d.type == "signature_delta"][0].startswith("gyre-")
    fragments = [d.partial_json for d in deltas if d.type == "input_json_delta"]
    assert fragments[0] == "" and "".join(fragments) == RAW_ARGS
    (tool_start,) = [e.content_block for e in events if e.type == "content_block_start" and e.index == 2]
    assert tool_start.id.startswith("toolu_") and tool_start.name == "bash"
    assert events[-2].delta.stop_reason == "tool_use"
    assert events[-2].usage.output_tokens == len(encode(tok, THINK_CALL)) + 1
    assert engine.requests[0]["sampling_params"]["max_new_tokens"] == 4096  # capped
    prompt0 = tok.decode(engine.requests[0]["input_ids"])
    assert "billing" not in prompt0 and "You are Claude Code.\n\nBe careful." in prompt0

    # Turn 2 with the SDK's stream helper: the harness echoes thinking (with signature),
    # text and tool_use, moves its cache marker, turns the task into a text block, and
    # changes the billing line.
    rec0 = local.store("ex1").calls[0]
    echoed = [{"type": "thinking", "thinking": "I should list the files first.",
               "signature": [d.signature for d in deltas if d.type == "signature_delta"][0]},
              {"type": "text", "text": "Let me look."},
              {"type": "tool_use", "id": tool_start.id, "name": "bash",
               "input": {"note": "café ✓", "command": "ls -la"}}]
    system2 = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=bbbb;"},
               {"type": "text", "text": "You are Claude Code."}, {"type": "text", "text": "Be careful."}]
    turn2 = [{"role": "user", "content": [{"type": "text", "text": "List the files."}]},
             {"role": "assistant", "content": echoed},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_start.id, "content": "a.txt",
                                           "cache_control": {"type": "ephemeral"}}]}]
    async with client.messages.stream(model="claude-unknown-model", max_tokens=1000, system=system2,
                                      messages=turn2, tools=TOOLS_ANTHROPIC) as s:
        message = await s.get_final_message()
    assert message.content[0].text == "All done." and message.stop_reason == "end_turn"
    assert message.usage.input_tokens == len(engine.requests[1]["input_ids"])
    rec1 = local.store("ex1").calls[1]
    assert (rec1.parent, rec1.prefix_len) == (rec0, rec0.full_len)
    assert engine.requests[1]["input_ids"][:rec0.full_len] == full_ids(rec0)

    # Turn 3 through the beta resource (`?beta=true`), not streamed, cut by max_tokens.
    turn3 = [*turn2, {"role": "assistant", "content": [{"type": "text", "text": "All done."}]},
             {"role": "system", "content": "A mid-conversation system note."},
             {"role": "user", "content": "Now explain."}]
    reply = await client.beta.messages.create(model="claude-unknown-model", max_tokens=3, system=system2,
                                              messages=turn3, tools=TOOLS_ANTHROPIC, betas=["context-1m-2025-08-07"])
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 3
    # A new user query: the template drops turn 1's thinking, so this is a branch off
    # call 0 (inside its thinking), not a crash.
    rec2 = local.store("ex1").calls[2]
    prompt2 = tok.decode(engine.requests[2]["input_ids"])
    assert rec2.parent is rec0 and rec2.prefix_len < rec0.full_len - rec0.completion_len + 3
    assert "I should list the files first." not in prompt2 and IM_END not in rec2.own_ids[-3:].tolist()
    assert "<|im_start|>system\nA mid-conversation system note.<|im_end|>" in prompt2


async def test_anthropic_count_tokens_and_sampling(local, tok):  # noqa: F811
    engine = await local.engine(["ok"])
    await local.proxy(engine=engine)
    client = local.anthropic("ex2")
    messages = [{"role": "user", "content": "How long is this?"}]
    counted = await client.messages.count_tokens(model="claude-x", messages=messages, tools=TOOLS_ANTHROPIC,
                                                 system="You are terse.")
    await client.messages.create(model="claude-x", max_tokens=10, messages=messages, tools=TOOLS_ANTHROPIC,
                                 system="You are terse.", extra_body={"temperature": 0.5, "top_k": 20})
    assert counted.input_tokens == len(engine.requests[0]["input_ids"])
    # The sampling the harness asked for is what the engine's log-probs describe.
    assert engine.requests[0]["sampling_params"] == {"temperature": 0.5, "top_p": 1.0, "top_k": 20,
                                                     "max_new_tokens": 10}
    # Counting is auxiliary: it never enters the call store.
    assert [r.call for r in local.store("ex2").calls] == ["ex2:1"]


async def test_responses_stream_helper_events_and_echo_extends(local, tok):  # noqa: F811
    engine = await local.engine([THINK_CALL, "All done.", "Truncated answer here."])
    await local.proxy(engine=engine)
    client = local.client("ex3")
    inputs = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]}]
    kinds = []
    async with client.responses.stream(model="gpt-unknown", input=inputs, tools=TOOLS_RESPONSES,
                                       reasoning={"effort": "medium"}, store=False,
                                       include=["reasoning.encrypted_content"], prompt_cache_key="thread-1") as s:
        async for event in s:
            kinds.append(event.type)
        final = await s.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for needed in ("response.content_part.added", "response.output_text.delta", "response.output_text.done",
                   "response.content_part.done", "response.function_call_arguments.delta",
                   "response.function_call_arguments.done", "response.reasoning_summary_part.added",
                   "response.reasoning_summary_text.delta", "response.reasoning_summary_text.done",
                   "response.reasoning_summary_part.done"):
        assert needed in kinds
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].summary[0].text == "I should list the files first."
    assert [t.type for t in final.tools] == [t["type"] for t in TOOLS_RESPONSES]  # echoed as asked
    call = final.output[2]
    assert call.arguments == RAW_ARGS and call.call_id.startswith("call_") and call.name == "bash"
    assert final.output_text == "Let me look." and final.status == "completed"
    # what the request did not set is echoed as the hosted API does: null, not the proxy's own cap
    assert final.max_output_tokens is None and final.completed_at >= final.created_at
    assert final.usage.input_tokens == len(engine.requests[0]["input_ids"])
    think_ids = tok(THINK_CALL.partition("</think>")[0] + "</think>", add_special_tokens=False)["input_ids"]
    assert final.usage.output_tokens_details.reasoning_tokens == len(think_ids)
    prompt0 = tok.decode(engine.requests[0]["input_ids"])
    assert prompt0.startswith("<|im_start|>system\nYou are Codex.") and '"name": "web_search"' not in prompt0

    # Turn 2, streamed raw: Codex echoes the output items (re-serialised arguments) and
    # adds the function output.
    echoed = [o.model_dump(exclude_none=True) for o in final.output]
    echoed[2]["arguments"] = json.dumps(json.loads(RAW_ARGS), separators=(",", ":"))
    turn2 = [*inputs, *echoed, {"type": "function_call_output", "call_id": call.call_id, "output": "a.txt"}]
    stream = await client.responses.create(model="gpt-unknown", input=turn2, tools=TOOLS_RESPONSES, stream=True)
    events = [e async for e in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output[0].content[0].text == "All done."
    rec0, rec1 = local.store("ex3").calls
    assert (rec1.parent, rec1.prefix_len) == (rec0, rec0.full_len)

    # Not streamed, cut by max_output_tokens: status incomplete.
    turn3 = [*turn2, {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "All done."}]},
             {"type": "message", "role": "user", "content": "And now?"}]
    cut = await client.responses.create(model="gpt-unknown", input=turn3, tools=TOOLS_RESPONSES, max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.max_output_tokens == 2 and cut.completed_at is None
    assert cut.usage.output_tokens == 2
    assert [(i.type, i.status) for i in cut.output] == [("message", "incomplete")]
    assert local.store("ex3").calls[2].parent is rec0  # the new user query drops turn 1's thinking: a branch


async def test_chat_stream_helper_parses_tool_calls(local, tok):  # noqa: F811
    engine = await local.engine([THINK_CALL])
    await local.proxy(engine=engine)
    client = local.client("ex4")
    tools = [{"type": "function", "function": {"name": "bash", "parameters": TOOLS_ANTHROPIC[0]["input_schema"]}}]
    async with client.chat.completions.stream(model="m", messages=[{"role": "user", "content": "go"}],
                                              tools=tools, stream_options={"include_usage": True}) as s:
        final = await s.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert 0 < final.usage.completion_tokens_details.reasoning_tokens < final.usage.completion_tokens
    (tc,) = choice.message.tool_calls
    assert tc.function.arguments == RAW_ARGS and json.loads(tc.function.arguments)["note"] == "café ✓"


async def test_a_tool_only_answer_has_null_content_streamed_or_not(local, tok):  # noqa: F811
    """An answer of only tool calls has `content: null` as OpenAI sends it, and the stream
    helper assembles the same message as the non-streamed answer."""
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    engine = await local.engine([call, call])
    await local.proxy(engine=engine)
    client = local.client("ex-null")
    tools = [{"type": "function", "function": {"name": "bash", "parameters": TOOLS_ANTHROPIC[0]["input_schema"]}}]
    messages = [{"role": "user", "content": "go"}]
    plain = (await client.chat.completions.create(model="m", messages=messages, tools=tools)).choices[0].message
    async with client.chat.completions.stream(model="m", messages=messages, tools=tools) as s:
        streamed = (await s.get_final_completion()).choices[0].message
    assert plain.content is None and streamed.content is None
    assert [(t.function.name, t.function.arguments) for t in streamed.tool_calls] == \
        [(t.function.name, t.function.arguments) for t in plain.tool_calls] == [("bash", '{"command": "ls"}')]


async def test_state_kept_server_side_is_refused_and_any_model_can_be_retrieved(local, tok):  # noqa: F811
    """The proxy stores no responses: a `previous_response_id` (or `conversation`) would
    otherwise be answered without the history it stands for and recorded as a new root."""
    import anthropic
    import openai

    engine = await local.engine(["ok"])
    await local.proxy(engine=engine)
    client = local.client("ex5")
    tail = [{"type": "function_call_output", "call_id": "call_1", "output": "a.txt"}]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model="m", input=tail, previous_response_id="resp_abc")
    assert refused.value.code == "previous_response_not_found" and refused.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model="m", input=tail, conversation="conv_abc", stream=True)
    assert refused.value.param == "conversation" and "conv_abc" in refused.value.message
    for reference in ({"type": "item_reference", "id": "fc_1"}, {"id": "fc_1"}):  # the type is optional
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model="m", input=[reference, *tail])
        assert refused.value.param == "input" and "fc_1" in refused.value.message
    assert engine.requests == [] and local.store("ex5").calls == []
    assert (await client.models.retrieve("gpt-anything")).id == "gpt-anything"
    assert (await local.anthropic("ex5").models.retrieve("claude-x")).id == "claude-x"
    async with anthropic.AsyncAnthropic(base_url=local.url, api_key="nope", max_retries=0) as stranger:
        with pytest.raises(anthropic.AuthenticationError):
            await stranger.models.retrieve("claude-x")


@pytest.mark.parametrize("known", [True, False], ids=["proxy_knows_the_context", "engine_refuses"])
async def test_a_prompt_beyond_the_context_gets_each_apis_prompt_too_long_error(local, tok, known,  # noqa: F811
                                                                               monkeypatch):
    """Harnesses compact (Claude Code, Codex CLI) or stop cleanly (litellm's
    ContextWindowExceededError, mini-swe-agent) only on the hosted APIs' wording and code;
    the engine's refusal passed on as a generic 400 ended long rollouts instead."""
    import anthropic
    import openai

    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # offline: litellm fetches it at import
    from litellm.litellm_core_utils.exception_mapping_utils import ExceptionCheckers

    engine = await local.engine(["ok"], context_length=120)
    await local.proxy(engine=engine, context_tokens=120 if known else 0)
    client, claude = local.client("ex6"), local.anthropic("ex6")
    long = [{"role": "user", "content": "word " * 300}]
    with pytest.raises(openai.BadRequestError) as chat:
        await client.chat.completions.create(model="m", messages=long)
    assert chat.value.code == "context_length_exceeded" and chat.value.param == "messages"
    assert ExceptionCheckers.is_error_str_context_window_exceeded(str(chat.value))
    assert "This model's maximum context length is 120 tokens" in chat.value.message
    with pytest.raises(openai.BadRequestError) as responses:
        await client.responses.create(model="m", input="word " * 300, stream=True)
    assert responses.value.code == "context_length_exceeded" and responses.value.param == "input"
    with pytest.raises(anthropic.BadRequestError) as messages:
        await claude.messages.create(model="m", max_tokens=64000, messages=long, stream=True)
    error = messages.value.body["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("prompt is too long: ")
    # A prompt that fits: the completion cap (64,000 asked, 4,096 the proxy's) is what room is left.
    short = [{"role": "user", "content": "hi"}]
    if known:
        assert engine.requests == []  # refused before any engine
        answer = await claude.messages.create(model="m", max_tokens=20000, messages=short)
        assert answer.content[0].text == "ok"
        sent = engine.requests[-1]
        assert sent["sampling_params"]["max_new_tokens"] == 120 - 2 - len(sent["input_ids"])
    else:  # not known yet: the engine's refusals name the context, which the proxy learns
        assert len(engine.requests) == 1 and local.state.context_tokens == 120
        answer = await claude.messages.create(model="m", max_tokens=20000, messages=short)
        assert answer.content[0].text == "ok"
        sent = engine.requests[-1]
        assert sent["sampling_params"]["max_new_tokens"] == 120 - 2 - len(sent["input_ids"])


async def test_a_fitting_prompt_refused_for_its_completion_cap_is_retried_capped(local, tok):  # noqa: F811
    """An engine whose context the proxy does not know yet refuses prompt + max_new_tokens
    beyond it (SGLang): the proxy learns the context from the refusal and sends the call
    again with the cap that fits, instead of telling the harness its prompt is too long."""
    import asyncio

    class BothInFlight(ScriptedEngine):
        """Holds the first two requests until both have arrived, so both are sent before
        either refusal can teach the proxy the context."""

        held = 0
        arrived = asyncio.Barrier(2)

        async def generate(self, request):
            if self.held < 2:
                self.held += 1
                await asyncio.wait_for(self.arrived.wait(), 10)
            return await super().generate(request)

    engine = BothInFlight(tok, ["ok"], context_length=200)
    await engine.start()
    local.engines.append(engine)
    await local.proxy(engine=engine, context_tokens=0, max_completion_tokens=1000)
    # Two calls in flight before the context is known: each is retried capped, not only the
    # one whose refusal taught it.
    answers = await asyncio.gather(*(local.anthropic(e).messages.create(
        model="m", max_tokens=1000, messages=[{"role": "user", "content": "hi"}]) for e in ("ex7", "ex8")))
    assert [a.content[0].text for a in answers] == ["ok", "ok"]
    caps = sorted(r["sampling_params"]["max_new_tokens"] for r in engine.requests)
    assert caps == [200 - 2 - len(engine.requests[0]["input_ids"])] * 2 + [1000, 1000]
    assert local.state.context_tokens == 200
    assert [r.call for r in local.store("ex7").calls] == ["ex7:0"]


async def test_an_answer_cut_while_thinking_is_reasoning_in_every_api(local, tok):  # noqa: F811
    thinking = "<think>\nhmm let me think about this a lot\n</think>\n\nDone."
    engine = await local.engine([thinking] * 4)
    await local.proxy(engine=engine)
    task = [{"role": "user", "content": "go"}]
    a = local.anthropic("ex-cut")
    reply = await a.messages.create(model="x", max_tokens=6, messages=task)
    assert reply.stop_reason == "max_tokens" and [b.type for b in reply.content] == ["thinking"]
    cut = reply.content[0].thinking
    assert cut and "<think>" not in cut and thinking[len("<think>\n"):].startswith(cut)
    async with a.messages.stream(model="x", max_tokens=6, messages=task) as s:
        streamed = await s.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking"] and streamed.content[0].thinking == cut
    # The harness echoes the cut thinking: the call extends the latest such answer, token for token.
    rec1 = local.store("ex-cut").calls[1]
    echo = [*task, {"role": "assistant", "content": [{"type": "thinking", "thinking": cut,
                                                       "signature": reply.content[0].signature}]},
            {"role": "user", "content": [{"type": "text", "text": "<tool_response>\nok\n</tool_response>"}]}]
    await a.messages.create(model="x", max_tokens=6, messages=echo)
    rec2 = local.store("ex-cut").calls[2]
    assert (rec2.parent, rec2.prefix_len, rec2.drift) == (rec1, rec1.full_len, 0)
    chat = await local.client("ex-cut-chat").chat.completions.create(model="x", max_tokens=6, messages=task)
    choice = chat.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    assert choice.message.model_extra["reasoning_content"] == cut
    assert chat.usage.completion_tokens_details.reasoning_tokens == chat.usage.completion_tokens == 6


def test_reasoning_tokens_end_at_the_think_end_id_or_span_a_cut_completion():
    from gyre.serving.tokenizer import THINK_END
    from handlers.proxy.call import _reasoning_tokens

    assert _reasoning_tokens([5, 6, THINK_END, 7, 8], cut=False) == 3
    assert _reasoning_tokens([5, 6, 7], cut=True) == 3  # cut short while thinking: all reasoning
    assert _reasoning_tokens([5, 6, 7, 8], cut=False) == 0  # "</think>" sampled in pieces: not known where


PATCH = "*** Begin Patch\n*** Add File: a.txt\n+caf\u00e9\n*** End Patch"
PATCH_CALL = ('<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n*** Add File: a.txt'
              '\\n+caf\\u00e9\\n*** End Patch"}}\n</tool_call>')
ODD_ARGS = '{"patch": "x", "n": 1}'  # the policy did not write {"input": …}: its whole arguments are the input
ODD_CALL = '<tool_call>\n{"name": "apply_patch", "arguments": ' + ODD_ARGS + '}\n</tool_call>'
GRAMMAR = "start: \"*** Begin Patch\" /(.|\\n)*/ \"*** End Patch\""


async def test_responses_custom_tools_are_shown_answered_as_custom_calls_and_echoes_extend(local, tok):  # noqa: F811
    """A `custom` tool (Codex's `apply_patch` for the models it knows) reaches the policy as a
    function of one `input` string (its grammar told); the policy's call comes back as a
    `custom_tool_call` item with the raw input, streamed with `custom_tool_call_input`
    events; sent back with its output, it extends the call it came from, also when the
    policy's arguments were not `{"input": …}`."""
    engine = await local.engine([PATCH_CALL, ODD_CALL, "Done."])
    await local.proxy(engine=engine)
    client = local.client("ex-custom-resp")
    tools = [{"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
              "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR}},
             {"type": "function", "name": "bash", "parameters": {"type": "object"}}]
    inputs = [{"type": "message", "role": "user", "content": "add a.txt"}]
    kinds = []
    async with client.responses.stream(model="m", input=inputs, tools=tools) as s:
        async for event in s:
            kinds.append(event.type)
        final = await s.get_final_response()
    prompt0 = tok.decode(engine.requests[0]["input_ids"])
    assert '"name": "apply_patch"' in prompt0 and "Edit files with a patch." in prompt0 and "lark grammar" in prompt0
    (item,) = final.output
    assert (item.type, item.name, item.input) == ("custom_tool_call", "apply_patch", PATCH)
    assert item.call_id.startswith("call_") and item.id.startswith("ctc_")
    assert "response.custom_tool_call_input.delta" in kinds and "response.custom_tool_call_input.done" in kinds
    assert "response.function_call_arguments.delta" not in kinds

    turn2 = [*inputs, item.model_dump(exclude_none=True),
             {"type": "custom_tool_call_output", "call_id": item.call_id, "output": "patched"}]
    second = await client.responses.create(model="m", input=turn2, tools=tools)
    (odd,) = second.output
    assert (odd.type, odd.input) == ("custom_tool_call", ODD_ARGS)
    turn3 = [*turn2, odd.model_dump(exclude_none=True),
             {"type": "custom_tool_call_output", "call_id": odd.call_id, "output": "ok"}]
    third = await client.responses.create(model="m", input=turn3, tools=tools, stream=True)
    events = [e async for e in third]
    assert events[-1].response.output_text == "Done."
    rec0, rec1, rec2 = local.store("ex-custom-resp").calls
    assert (rec1.parent, rec1.prefix_len, rec1.drift) == (rec0, rec0.full_len, 0)
    assert (rec2.parent, rec2.prefix_len, rec2.drift) == (rec1, rec1.full_len, 0)


async def test_chat_custom_tools_are_answered_in_the_custom_shape_streamed_or_not(local, tok):  # noqa: F811
    """Chat Completions: a `custom` tool is shown as a function of one `input` string; the
    policy's call is answered `{"type": "custom", "custom": {name, input}}`, streamed as
    the name then input pieces; the echoed call extends the first."""
    engine = await local.engine([PATCH_CALL, PATCH_CALL, "Done."])
    await local.proxy(engine=engine)
    client = local.client("ex-custom-chat")
    tools = [{"type": "custom", "custom": {"name": "apply_patch", "description": "Edit files with a patch.",
                                           "format": {"type": "grammar",
                                                      "grammar": {"syntax": "lark", "definition": GRAMMAR}}}}]
    task = {"role": "user", "content": "add a.txt"}
    r = await client.chat.completions.create(model="m", messages=[task], tools=tools)
    assert "lark grammar" in tok.decode(engine.requests[0]["input_ids"])
    (tc,) = r.choices[0].message.tool_calls
    assert (tc.type, tc.custom.name, tc.custom.input) == ("custom", "apply_patch", PATCH)
    assert r.choices[0].finish_reason == "tool_calls"

    stream = await client.chat.completions.create(model="m", messages=[task], tools=tools, stream=True)
    deltas = [c.choices[0].delta.model_dump() async for c in stream if c.choices]
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert calls[0]["type"] == "custom" and calls[0]["custom"]["name"] == "apply_patch" and calls[0]["id"]
    assert "".join(c["custom"]["input"] for c in calls) == PATCH

    echo = {"role": "assistant", "content": None,
            "tool_calls": [{"id": tc.id, "type": "custom", "custom": {"name": "apply_patch", "input": PATCH}}]}
    await client.chat.completions.create(
        model="m", messages=[task, echo, {"role": "tool", "tool_call_id": tc.id, "content": "patched"}], tools=tools)
    rec0, _, rec2 = local.store("ex-custom-chat").calls
    assert (rec2.parent, rec2.prefix_len, rec2.drift) == (rec0, rec0.full_len, 0)


@pytest.mark.parametrize("bad", [
    {"input": "hi", "instructions": 5},
    {"input": "hi", "instructions": ["You are terse."]},
    {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": 5}]}]},
    {"input": "hi", "tools": [{"name": "bash", "parameters": {"type": "object"}}]},
    {"input": "hi", "tools": [{"type": "custom"}]},
    {"input": "hi", "parallel_tool_calls": "yes"},
    {"input": "hi", "metadata": "x"},
], ids=["instructions-int", "instructions-list", "input-text-int", "tool-without-type", "custom-without-name",
        "parallel-str", "metadata-str"])
async def test_responses_fields_of_the_wrong_type_are_400(local, bad):
    """What the API types as a string, boolean or object, and a tool without a type, is a
    400 in OpenAI's shape, not dropped from the prompt or echoed back unchecked; nothing
    reaches the engine."""
    import openai

    engine = await local.engine(["ok"])
    await local.proxy(engine=engine)
    with pytest.raises(openai.BadRequestError) as err:
        await local.client("ex-bad-types").responses.create(model="m", **bad)
    assert err.value.body["type"] == "invalid_request_error"
    assert engine.requests == []


async def test_responses_compact_is_an_endpoint_not_served_not_a_response_id(local):
    import openai

    await local.proxy(engine=await local.engine(["ok"]))
    with pytest.raises(openai.NotFoundError) as err:
        await local.client("ex-compact").responses.compact(model="m", input="hi")
    assert "unknown endpoint POST /v1/responses/compact" in err.value.message


async def test_a_custom_call_with_keys_beside_input_is_answered_whole_and_its_echo_extends(local):
    """Arguments holding more than `input` are the input as a whole (nothing the policy wrote
    is dropped), and sent back they extend the call."""
    from gyre.serving.chat import custom_input
    from handlers.engines.scripted import tool_call

    extra = '{"input": "P", "note": "why"}'
    assert custom_input(extra) == extra and custom_input('{"input": "P"}') == "P"
    engine = await local.engine([tool_call("apply_patch", {"input": "P", "note": "why"}), "Done."])
    await local.proxy(engine=engine)
    client = local.client("ex-extra")
    tools = [{"type": "custom", "name": "apply_patch", "description": "Edit files."}]
    inputs = [{"type": "message", "role": "user", "content": "go"}]
    (item,) = (await client.responses.create(model="m", input=inputs, tools=tools)).output
    assert item.input == extra
    turn2 = [*inputs, item.model_dump(exclude_none=True),
             {"type": "custom_tool_call_output", "call_id": item.call_id, "output": "ok"}]
    await client.responses.create(model="m", input=turn2, tools=tools)
    rec0, rec1 = local.store("ex-extra").calls
    assert (rec1.parent, rec1.prefix_len, rec1.drift) == (rec0, rec0.full_len, 0)


async def test_a_custom_and_a_function_tool_of_one_name_are_refused(local):
    """The policy would see two functions of that name, and its call could not be told
    apart: a 400, as for a namespace function whose flat name is another tool's."""
    import openai

    engine = await local.engine(["x"])
    await local.proxy(engine=engine)
    client = local.client("ex-clash")
    fn = {"type": "object", "properties": {"patch": {"type": "string"}}}
    for tools in ([{"type": "custom", "name": "apply_patch"}, {"type": "function", "name": "apply_patch",
                                                                "parameters": fn}],
                  [{"type": "custom", "name": "apply_patch"}, {"type": "custom", "name": "apply_patch"}]):
        with pytest.raises(openai.BadRequestError, match="could not tell them apart"):
            await client.responses.create(model="m", input="go", tools=tools)
    for other in ({"type": "function", "function": {"name": "apply_patch", "parameters": fn}},
                  {"type": "custom", "custom": {"name": "apply_patch"}}):
        with pytest.raises(openai.BadRequestError, match="could not tell them apart"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}],
                                                 tools=[{"type": "custom", "custom": {"name": "apply_patch"}}, other])
    assert engine.requests == []


async def test_a_tool_input_is_answered_as_the_policy_wrote_it_streamed_or_not(local):
    """A non-streamed `tool_use` carries the policy's arguments text itself, as the streamed
    `input_json_delta`s do: parsed by orjson and written again, an integer beyond 64 bits
    reached the harness as a float (1.2345678901234568e+22), another value than the one
    the policy sampled."""
    from handlers.engines.scripted import tool_call

    args = {"n": 12345678901234567890123, "s": "caf\u00e9", "nested": {"list": [1, -0.5, None, True]}}
    engine = await local.engine([tool_call("bash", args)] * 2)
    await local.proxy(engine=engine)
    client = local.anthropic("ex-bigint")
    request = dict(model="m", max_tokens=512, tools=TOOLS_ANTHROPIC, messages=[{"role": "user", "content": "go"}])
    raw = await client.messages.with_raw_response.create(**request)
    (block,) = [b for b in json.loads(raw.http_response.text)["content"] if b["type"] == "tool_use"]
    assert block["input"] == args and type(block["input"]["n"]) is int
    (tool,) = (await raw.parse()).content
    assert tool.input == args
    stream = await client.messages.create(**request, stream=True)
    fragments = [e.delta.partial_json async for e in stream
                 if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert json.loads("".join(fragments)) == args
