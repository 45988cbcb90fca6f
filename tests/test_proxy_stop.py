"""Stop strings through the proxy: OpenAI `stop` and Anthropic `stop_sequences` reach the
engine, the answer ends before the string (Anthropic: `stop_reason` `stop_sequence`),
the string's sampled ids stay in the recorded completion, and the next call extends it
with drift 0."""
from __future__ import annotations

import aiohttp
import numpy as np
import pytest

from gyre.env.harness import execution_key
from gyre.serving.tokenizer import IM_END
from tests.test_proxy import SECRET, TASK, Stack, bus, tok  # noqa: F401 - fixtures

THOUGHT = "THOUGHT: look around\n```bash\nls -la\n```\nOBSERVATION: invented by the model"


async def test_openai_stop_cuts_the_answer_keeps_the_ids_and_extends(tok, bus, run_id):  # noqa: F811
    stack = Stack(tok, bus, run_id)
    try:
        engine = await stack.engine([THOUGHT, "done"])
        await stack.proxy(engine=engine)
        client = stack.client("ex-stop")
        first = await client.chat.completions.create(model="m", messages=[TASK], stop=["OBSERVATION:", "```\nX"])
        choice = first.choices[0]
        assert choice.message.content == THOUGHT[: THOUGHT.index("OBSERVATION:")]
        assert choice.finish_reason == "stop"
        assert engine.requests[0]["sampling_params"]["stop"] == ["OBSERVATION:", "```\nX"]
        history = [TASK, {"role": "assistant", "content": choice.message.content},
                   {"role": "user", "content": "OBSERVATION: a.txt"}]
        second = await client.chat.completions.create(model="m", messages=history, stop="OBSERVATION:")
        assert second.choices[0].message.content == "done"
        one, two = await stack.calls(2)
        match = stack.store("ex-stop").match(history, None)
    finally:
        await stack.close()
    assert one.sampling.stop == ("OBSERVATION:", "```\nX") and two.sampling.stop == ("OBSERVATION:",)
    comp = one.tokens.completion_ids
    text = tok.decode(list(comp), skip_special_tokens=False)
    assert one.finish_reason == "stop" and IM_END not in comp
    assert text.endswith("OBSERVATION:") and "OBSERVATION:" not in tok.decode(list(comp[:-1]))
    # the next call extends the cut completion: its ids verbatim, then <|im_end|> (not sampled)
    assert (two.parent_call, two.prefix_len, two.drift) == (one.call, len(one.tokens.prompt_ids) + len(comp), 0)
    assert two.tokens.prompt_ids[0] == IM_END
    assert match.extended and match.drift == 0
    assert np.array_equal(match.prompt_ids[: two.prefix_len], np.array(one.tokens.prompt_ids + comp))


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_stop_sequences_give_stop_sequence(tok, bus, run_id, stream):  # noqa: F811
    stack = Stack(tok, bus, run_id)
    try:
        engine = await stack.engine(["the answer is 42 STOP and more"])
        await stack.proxy(engine=engine)
        client = stack.anthropic("ex-seq")
        kw = dict(model="claude-x", max_tokens=100, messages=[TASK], stop_sequences=["STOP", "never"])
        if stream:
            async with client.messages.stream(**kw) as s:
                msg = await s.get_final_message()
        else:
            msg = await client.messages.create(**kw)
        (event,) = await stack.calls(1)
    finally:
        await stack.close()
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "STOP")
    assert [b.text for b in msg.content] == ["the answer is 42 "]
    assert event.sampling.stop == ("STOP", "never") and event.finish_reason == "stop"
    assert tok.decode(list(event.tokens.completion_ids)).endswith("STOP")


async def test_malformed_stop_is_a_400_in_each_shape(tok):  # noqa: F811
    stack = Stack(tok, None, "stop-400")
    try:
        engine = await stack.engine(["x"])
        url = await stack.proxy(engine=engine)
        headers = {"Authorization": f"Bearer {execution_key(SECRET, 'ex-bad')}"}
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/chat/completions", headers=headers,
                                 json={"model": "m", "messages": [TASK], "stop": [1]}) as r:
                body = await r.json()
                assert r.status == 400 and body["error"]["param"] == "stop"
            async with http.post(url + "/v1/chat/completions", headers=headers,
                                 json={"model": "m", "messages": [TASK], "stop": ["s"] * 2 + [str(i) for i in range(16)]}) as r:
                body = await r.json()
                assert r.status == 400 and "at most 16" in body["error"]["message"]
            async with http.post(url + "/v1/messages", headers=headers,
                                 json={"model": "m", "max_tokens": 5, "messages": [TASK],
                                       "stop_sequences": {"a": 1}}) as r:
                body = await r.json()
                assert r.status == 400 and body["type"] == "error" and "stop_sequences" in body["error"]["message"]
            # count_tokens generates nothing: its stop_sequences are not even read
            async with http.post(url + "/v1/messages/count_tokens", headers=headers,
                                 json={"model": "m", "messages": [TASK], "stop_sequences": [1] * 20}) as r:
                assert r.status == 200 and (await r.json())["input_tokens"] > 0
        assert engine.requests == []
    finally:
        await stack.close()


TOOL_THEN_OBS = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\nOBS'
CASES = [  # engine text, stop sequences, answer text (tool calls aside), stop_reason, stop_sequence
    ("alpha beta gamma delta", ["gamma", "beta gamma"], "alpha beta ", "stop_sequence", "gamma"),  # list order
    ("alpha beta gamma delta", ["<|im_end|>"], "alpha beta gamma delta", "end_turn", None),  # the stop token first
    ("alpha beta gamma delta", ["delta<|im"], "alpha beta gamma delta", "end_turn", None),
    (TOOL_THEN_OBS, ["OBS"], "", "tool_use", None),  # tool calls win over the sequence
]


@pytest.mark.parametrize("text,stops,content,reason,sequence", CASES)
async def test_what_the_engine_matched_decides(tok, text, stops, content, reason, sequence):  # noqa: F811
    """The answer is cut at the stop string the engine reports (SGLang checks the stop token,
    then the strings in order), not at any string found in the decoded text."""
    stack = Stack(tok, None, "stop-order")
    try:
        engine = await stack.engine([text])
        await stack.proxy(engine=engine)
        msg = await stack.anthropic("ex-order").messages.create(
            model="claude-x", max_tokens=100, messages=[TASK], stop_sequences=stops,
            tools=[{"name": "bash", "input_schema": {"type": "object"}}])
        chat = await stack.client("ex-order-chat").chat.completions.create(
            model="m", messages=[TASK], stop=stops, tools=[{"type": "function", "function": {"name": "bash"}}])
    finally:
        await stack.close()
    assert "".join(b.text for b in msg.content if b.type == "text") == content
    assert (msg.stop_reason, msg.stop_sequence) == (reason, sequence)
    assert [b.type for b in msg.content if b.type == "tool_use"] == (["tool_use"] if reason == "tool_use" else [])
    assert (chat.choices[0].message.content or "") == content
    assert chat.choices[0].finish_reason == ("tool_calls" if reason == "tool_use" else "stop")
