"""Bad input gets a clear answer (issue "Confinement", item 4): each input below was found
by trying public bug reports on the running product, through the real proxy, the official
SDKs and a scripted engine speaking SGLang's wire protocol."""
from __future__ import annotations

import json

import aiohttp
import anthropic
import openai
import pytest

from gyre.env.harness import execution_key
from tests.test_proxy import SECRET, Stack, bus, tok  # noqa: F401 - fixtures

READ = {"name": "read", "description": "read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}
TWO_READS = ('<tool_call>\n{"name": "read", "arguments": {"path": "a.py"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "read", "arguments": {"path": "b.py"}}\n</tool_call>')
RESULTS = {"a.py": "print(1)", "b.py": "print(2)"}


@pytest.fixture
async def local(tok):  # noqa: F811
    s = Stack(tok, None, "bad-input")
    yield s
    await s.close()


def prompt(tok, engine, i: int = -1) -> str:  # noqa: F811
    return tok.decode(engine.requests[i]["input_ids"], skip_special_tokens=False)


async def _parallel_calls_answered_in_reverse(local, api: str) -> list[str]:
    """Two calls (_0 reads a.py, _1 reads b.py) answered _1 first, through `api`; returns the
    (call id, path) pairs in the order the harness sent the results."""
    task = {"role": "user", "content": "read both files"}
    if api == "chat":
        oai = local.client("e-chat")
        tools = [{"type": "function", "function": READ}]
        first = await oai.chat.completions.create(model="m", messages=[task], tools=tools)
        calls = first.choices[0].message.tool_calls
        sent = list(reversed(calls))
        await oai.chat.completions.create(model="m", tools=tools, messages=[
            task, first.choices[0].message.model_dump(exclude_none=True),
            *({"role": "tool", "tool_call_id": c.id, "content": RESULTS[json.loads(c.function.arguments)["path"]]}
              for c in sent)])
        return [c.id for c in sent]
    if api == "messages":
        claude = local.anthropic("e-messages")
        tools = [{"name": READ["name"], "description": READ["description"], "input_schema": READ["parameters"]}]
        first = await claude.messages.create(model="m", max_tokens=100, messages=[task], tools=tools)
        uses = [b for b in first.content if b.type == "tool_use"]
        sent = list(reversed(uses))
        await claude.messages.create(model="m", max_tokens=100, tools=tools, messages=[
            task, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": RESULTS[u.input["path"]]}
                                         for u in sent]}])
        return [u.id for u in sent]
    oai = local.client("e-responses")
    tools = [{"type": "function", **READ}]
    first = await oai.responses.create(model="m", input=[task], tools=tools)
    calls = [item for item in first.output if item.type == "function_call"]
    sent = list(reversed(calls))
    await oai.responses.create(model="m", tools=tools, input=[
        task, *(item.model_dump(exclude_none=True) for item in first.output),
        *({"type": "function_call_output", "call_id": c.call_id, "output": RESULTS[json.loads(c.arguments)["path"]]}
          for c in sent)])
    return [c.call_id for c in sent]


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
async def test_parallel_tool_results_reach_the_policy_in_the_order_of_its_calls(local, tok, api):  # noqa: F811
    """The Qwen3 format renders tool results without their ids, so the policy reads the k-th
    result as its k-th call's: results sent back in another order are rendered in the
    order of the calls, and the request still extends the call that made them."""
    engine = await local.engine([TWO_READS, "done"])
    await local.proxy(engine=engine)
    sent = await _parallel_calls_answered_in_reverse(local, api)
    assert sent[0].endswith("_1") and sent[1].endswith("_0")  # the harness answered _1 first
    text = prompt(tok, engine)
    assert text.count("<tool_response>") == 2
    assert text.index("<tool_response>\nprint(1)\n</tool_response>") < text.index("<tool_response>\nprint(2)\n")
    store = local.store(f"e-{api}")
    first, second = store.calls
    assert second.parent is first and second.prefix_len == first.full_len  # an extension, ids reused


ORPHANS = [
    ("chat", "/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "read", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_nope", "content": "x"}]}, "call_nope"),
    ("chat", "/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": "go"}, {"role": "tool", "tool_call_id": "", "content": "x"}]}, "empty"),
    ("responses", "/v1/responses", {"model": "m", "input": [
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "call_0", "name": "read", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_nope", "output": "x"}]}, "call_nope"),
    ("responses", "/v1/responses", {"model": "m", "input": [
        {"role": "user", "content": "go"}, {"type": "function_call_output", "call_id": "", "output": "x"}]}, "empty"),
    ("messages", "/v1/messages", {"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_0", "name": "read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]},
     "toolu_nope"),
    ("messages", "/v1/messages/count_tokens", {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]},
     "toolu_nope"),
]


@pytest.mark.parametrize("api,path,body,named", ORPHANS, ids=[f"{o[0]}-{o[3]}" for o in ORPHANS])
async def test_a_tool_output_for_no_call_of_the_history_is_a_400_naming_the_id(local, api, path, body, named):
    """The hosted APIs refuse a tool output whose call id is absent from the request's own
    history (or empty); rendered, it would reach the policy as an orphan user turn."""
    engine = await local.engine(["ok"])
    url = await local.proxy(engine=engine)
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json=body, headers={"x-api-key": execution_key(SECRET, "e-orphan")}) as r:
            answer = await r.json()
            assert r.status == 400, answer
    if api == "messages":
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
        message = answer["error"]["message"]
    else:
        assert answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["param"] == ("input" if api == "responses" else answer["error"]["param"])
        message = answer["error"]["message"]
    assert (named in message) if named != "empty" else ("is empty" in message)
    assert engine.requests == []  # refused before anything reached an engine


async def test_sdk_clients_see_the_orphan_refusal_as_a_bad_request(local):
    engine = await local.engine(["ok"])
    await local.proxy(engine=engine)
    with pytest.raises(openai.BadRequestError, match="call_nope"):
        await local.client("e-sdk").responses.create(model="m", input=[
            {"role": "user", "content": "go"}, {"type": "function_call_output", "call_id": "call_nope", "output": "x"}])
    with pytest.raises(anthropic.BadRequestError, match="toolu_nope"):
        await local.anthropic("e-sdk").messages.create(model="m", max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}])


async def test_responses_additional_tools_are_rendered_where_they_are_offered(local, tok):  # noqa: F811
    """An `additional_tools` input item (tools made available from its place on) reaches
    the prompt as a system turn at that place, listing them as the header lists the
    request's tools; a call to one is answered as a call of that tool (a namespace's
    function with its namespace apart)."""
    spawn = '<tool_call>\n{"name": "agents__spawn", "arguments": {"task": "t"}}\n</tool_call>'
    engine = await local.engine(['<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>', spawn])
    await local.proxy(engine=engine)
    oai = local.client("e-added")
    added = {"type": "additional_tools", "role": "developer", "tools": [
        {"type": "function", "name": "lookup", "description": "look a word up",
         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
        {"type": "namespace", "name": "agents", "description": "sub-agents",
         "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}]}]}
    items = [{"role": "user", "content": "first"}, added, {"role": "user", "content": "now look it up"}]
    bash = [{"type": "function", "name": "bash", "parameters": {"type": "object"}}]
    first = await oai.responses.create(model="m", input=items, tools=bash)
    text = prompt(tok, engine)
    header, _, rest = text.partition("<|im_end|>")
    assert '"name": "bash"' in header and "lookup" not in header
    turn = "<|im_start|>system\n# Additional tools"
    assert text.index("first") < text.index(turn) < text.index("now look it up")
    listed = rest[rest.index(turn):rest.index("\n</tools>")]
    assert '"name": "lookup"' in listed and '"name": "agents__spawn"' in listed and "look a word up" in listed
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "lookup" and json.loads(call.arguments) == {"q": "x"}
    second = await oai.responses.create(model="m", tools=bash, input=[
        *items, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "found"}])
    spawned = next(item for item in second.output if item.type == "function_call").model_dump()
    assert (spawned["namespace"], spawned["name"]) == ("agents", "spawn")


@pytest.mark.parametrize("item,named", [
    ({"type": "additional_tools", "role": "developer", "tools": "lookup"}, "tools must be a list"),
    ({"type": "additional_tools", "role": "user", "tools": []}, "must be 'developer'"),
    ({"type": "additional_tools", "role": "developer", "tools": [{"type": "function"}]}, "without a string 'name'"),
])
async def test_a_malformed_additional_tools_item_is_a_400(local, item, named):
    engine = await local.engine(["ok"])
    url = await local.proxy(engine=engine)
    body = {"model": "m", "input": [{"role": "user", "content": "go"}, item]}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/responses", json=body,
                             headers={"Authorization": f"Bearer {execution_key(SECRET, 'e-added')}"}) as r:
            answer = await r.json()
    assert r.status == 400 and named in answer["error"]["message"] and answer["error"]["message"].startswith("input[1]")
    assert engine.requests == []


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf", "soon"])
def test_gyre_run_refuses_a_timeout_that_is_not_positive_before_anything_starts(value, tmp_path, monkeypatch, capsys):
    """`gyre run toy --timeout -5` used to start a run and end it as `timeout`: a usage
    error (exit 2) now, before a run directory, a nats-server or a daemon exists."""
    from handlers.cli import main

    monkeypatch.setenv("GYRE_RUNS_DIR", str(tmp_path / "runs"))
    with pytest.raises(SystemExit) as exit_:
        main(["run", "toy", "--timeout", value])
    assert exit_.value.code == 2
    assert "--timeout" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


async def test_an_empty_thinking_block_branches_and_the_builder_keeps_two_trajectories(tok, bus, run_id):  # noqa: F811
    """The engine answers `<think>\n\n</think>\n\nI am good!`; the client sends the history
    back as {"role": "assistant", "content": "I am good!"} plus a new user message. The
    template renders that turn without the block, so the second call branches after the
    shared prefix (it used to reuse all of call 1's ids, the empty block included), and the
    trajectory tree has two leaves the builder keeps."""
    from gyre.trajectory.tree import build_tree, trajectories

    stack = Stack(tok, bus, run_id)
    try:
        engine = await stack.engine(["<think>\n\n</think>\n\nI am good!", "Glad to hear."])
        await stack.proxy(engine=engine)
        oai = stack.client("e-think")
        history = [{"role": "user", "content": "How are you?"}]
        first = await oai.chat.completions.create(model="m", messages=history)
        assert first.choices[0].message.content == "I am good!"
        assert getattr(first.choices[0].message, "reasoning_content", None) is None
        await oai.chat.completions.create(model="m", messages=[
            *history, {"role": "assistant", "content": "I am good!"}, {"role": "user", "content": "And the weather?"}])
        calls = await stack.calls(2)
        c1, c2 = calls
        full1 = c1.tokens.prompt_ids + c1.tokens.completion_ids
        assert c2.parent_call == c1.call and c2.prefix_len == len(c1.tokens.prompt_ids) < len(full1)
        second_prompt = full1[:c2.prefix_len] + c2.tokens.prompt_ids  # diverges where <think> was sampled
        assert "<think>" not in tok.decode(second_prompt, skip_special_tokens=False)
        kept = trajectories(build_tree("e-think", calls), j_max=5)
        assert len(kept) == 2
    finally:
        await stack.close()
