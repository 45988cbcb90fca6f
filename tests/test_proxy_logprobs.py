"""Chat Completions `logprobs`: the answer carries every sampled token's behaviour log-prob,
the same numbers `call.completed` records, with each token's bytes (also a token holding
part of a UTF-8 character); streamed, the `openai` SDK gathers them; `top_logprobs` > 0 is
refused in OpenAI's error shape, and a call that does not ask gets `logprobs: null`."""
from __future__ import annotations

import openai
import pytest

from gyre.serving.tokenizer import IM_END
from tests.test_proxy import TASK, Stack, bus, tok  # noqa: F401 - fixtures

TEXT = "café 中文 🦩 done"  # " 🦩" is three tokens: b" \xf0\x9f", b"\xa6", b"\xa9"


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_logprobs_are_the_recorded_behaviour_logprobs(tok, bus, run_id, stream):  # noqa: F811
    stack = Stack(tok, bus, run_id)
    try:
        engine = await stack.engine([TEXT, "plain"])
        await stack.proxy(engine=engine)
        client = stack.client("ex-lp")
        kw = dict(model="m", messages=[TASK], logprobs=True, top_logprobs=0, temperature=0.7)
        if stream:
            async with client.chat.completions.stream(**kw) as s:
                answer = await s.get_final_completion()
        else:
            answer = await client.chat.completions.create(**kw)
        history = [TASK, {"role": "assistant", "content": answer.choices[0].message.content},
                   {"role": "user", "content": "again"}]
        plain = await client.chat.completions.create(model="m", messages=history)
        first, _ = await stack.calls(2)
    finally:
        await stack.close()
    choice = answer.choices[0]
    assert choice.message.content == TEXT
    entries = choice.logprobs.content
    comp = first.tokens.completion_ids
    assert comp[-1] == IM_END and len(entries) == len(comp)  # the stop token included
    assert [e.logprob for e in entries] == list(first.tokens.logprobs)
    assert first.sampling.temperature == 0.7 and all(e.top_logprobs == [] for e in entries)
    raw = b"".join(bytes(e.bytes) for e in entries)
    assert raw.decode() == TEXT + "<|im_end|>"
    assert all(bytes(e.bytes).decode("utf-8", "backslashreplace") == e.token for e in entries)
    assert [e.token for e in entries if "\\x" in e.token] == [" \\xf0\\x9f", "\\xa6", "\\xa9"]
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("body,param", [({"logprobs": True, "top_logprobs": 5}, "top_logprobs"),
                                        ({"top_logprobs": 21}, "top_logprobs"),
                                        ({"logprobs": "yes"}, "logprobs")])
async def test_chat_logprobs_not_served_are_a_400_in_openai_shape(tok, body, param):  # noqa: F811
    stack = Stack(tok, None, "lp-400")
    try:
        engine = await stack.engine(["x"])
        await stack.proxy(engine=engine)
        with pytest.raises(openai.BadRequestError) as err:
            await stack.client("ex-lp").chat.completions.create(model="m", messages=[TASK], extra_body=body)
    finally:
        await stack.close()
    assert err.value.body["param"] == param and not engine.requests


@pytest.mark.parametrize("body,param", [({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]},
                                         "include"),
                                        ({"top_logprobs": 3}, "top_logprobs"),
                                        ({"include": "message.output_text.logprobs"}, "include")])
async def test_responses_logprobs_are_a_400_not_an_empty_list(tok, body, param):  # noqa: F811
    stack = Stack(tok, None, "lp-resp-400")
    try:
        engine = await stack.engine(["x", "y"])
        await stack.proxy(engine=engine)
        client = stack.client("ex-lp")
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model="m", input="hi", extra_body=body)
        # what Codex CLI sends is answered
        ok = await client.responses.create(model="m", input="hi", include=["reasoning.encrypted_content"],
                                           store=False)
    finally:
        await stack.close()
    assert err.value.body["param"] == param and len(engine.requests) == 1
    assert ok.output_text == "x"
