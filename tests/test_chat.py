"""Qwen3-format rendering (exact strings, token ids, prefix stability) and completion parsing."""
from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.serving import tokenizer as qtok
from gyre.serving.chat import Parsed, ToolCall, call_id_prefix, parse_completion, render

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}


@pytest.fixture(scope="module")
def tok():
    return qtok.build_tokenizer()


def call(cid: str, command: str, as_dict: bool = False) -> dict:
    args = {"command": command}
    return {"id": cid, "type": "function", "function": {"name": "bash", "arguments": args if as_dict else json.dumps(args)}}


def tool_conversation() -> list[dict]:
    """The tool-result flow of a harness: user task, then assistant tool calls and tool results."""
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": [{"type": "text", "text": "Make the tests "}, {"type": "text", "text": "pass."}]},
        {"role": "assistant", "content": "Looking around.", "reasoning_content": "Start with ls.",
         "tool_calls": [call("c1", "ls"), call("c2", "cat a.py", as_dict=True)]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py\ntest_a.py"},
        {"role": "tool", "tool_call_id": "c2", "content": "def f(): pass"},
        {"role": "assistant", "content": None, "tool_calls": [call("c3", "pytest -q")]},
        {"role": "tool", "tool_call_id": "c3", "content": "1 failed"},
        {"role": "assistant", "content": "<think>\nFix f.\n</think>\n\nFixing.", "tool_calls": [call("c4", "sed -i s/pass/1/ a.py")]},
        {"role": "tool", "tool_call_id": "c4", "content": ""},
        {"role": "assistant", "content": "Done."},
    ]  # fmt: skip


def test_exact_rendering_of_a_tool_turn(tok):
    messages = [
        {"role": "user", "content": "List files"},
        {"role": "assistant", "content": "", "tool_calls": [call("c1", "ls")]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
    ]
    expected = (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(BASH)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nList files<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\na.py\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render(tok, messages, tools=[BASH]) == expected


def test_full_conversation_rendering(tok):
    text = render(tok, tool_conversation(), tools=[BASH], add_generation_prompt=False)
    assert text.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools\n")
    assert "<|im_start|>user\nMake the tests pass.<|im_end|>\n" in text
    # Reasoning after the last user query is kept, from reasoning_content or from <think> in content.
    assert "<|im_start|>assistant\n<think>\nStart with ls.\n</think>\n\nLooking around.\n<tool_call>\n" in text
    assert "<|im_start|>assistant\n<think>\nFix f.\n</think>\n\nFixing.\n<tool_call>\n" in text
    # Dict and string arguments render the same way; two calls are separated by one newline.
    assert (
        '{"command": "ls"}}\n</tool_call>\n<tool_call>\n{"name": "bash", "arguments": {"command": "cat a.py"}}\n'
        "</tool_call><|im_end|>\n" in text
    )
    # Consecutive tool results form one user turn.
    assert (
        "<|im_start|>user\n<tool_response>\na.py\ntest_a.py\n</tool_response>\n"
        "<tool_response>\ndef f(): pass\n</tool_response><|im_end|>\n" in text
    )
    assert text.endswith("<|im_start|>assistant\nDone.<|im_end|>\n")


def test_tokenised_conversation_keeps_markers_whole(tok):
    messages = tool_conversation()
    text = render(tok, messages, tools=[BASH])
    ids = tok.encode(text)
    assert tok.decode(ids) == text  # lossless
    assert ids[0] == qtok.IM_START
    assert ids[-3:] == [qtok.IM_START, *tok.encode("assistant\n")]
    assert ids.count(qtok.IM_START) == 1 + 1 + 4 + 3 + 1  # system, user, 4 assistant, 3 tool turns, prompt
    assert ids.count(qtok.IM_END) == ids.count(qtok.IM_START) - 1
    # The tools instruction spells <tool_call></tool_call> twice; then 4 calls.
    assert ids.count(qtok.TOOL_CALL) == ids.count(qtok.TOOL_CALL_END) == 2 + 4
    assert ids.count(qtok.TOOL_RESPONSE) == ids.count(qtok.TOOL_RESPONSE_END) == 4
    assert ids.count(qtok.THINK) == ids.count(qtok.THINK_END) == 2
    # Every marker string in the text is one id: no special token was split into bytes.
    for marker, tid in [("<|im_start|>", qtok.IM_START), ("<tool_call>", qtok.TOOL_CALL), ("<think>", qtok.THINK)]:
        assert text.count(marker) == ids.count(tid)
    assert max(ids) < len(tok)
    # Each tool response opens right after a lone "\n" token (198).
    assert all(ids[i - 1] == 198 for i, t in enumerate(ids) if t == qtok.TOOL_RESPONSE)


@pytest.mark.parametrize("with_reasoning", [False, True])
def test_prefix_stability_in_the_tool_result_flow(tok, with_reasoning):
    messages = tool_conversation()
    if not with_reasoning:
        for m in messages:
            m.pop("reasoning_content", None)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        # What the proxy holds after call k: the prompt plus the assistant's answer.
        prompt = render(tok, messages[:k], tools=[BASH], add_generation_prompt=True)
        answered = render(tok, messages[: k + 1], tools=[BASH], add_generation_prompt=False)
        assert answered.startswith(prompt)
        for longer in range(k + 2, len(messages) + 1):
            full = render(tok, messages[:longer], tools=[BASH], add_generation_prompt=True)
            assert full.startswith(answered), (k, longer)
            # Token level too: the boundary is "<|im_end|>\n", before a special token.
            a_ids = tok.encode(answered)
            assert tok.encode(full)[: len(a_ids)] == a_ids


def test_prefix_stability_in_the_text_observation_flow(tok):
    # mini-swe-agent's text mode: observations come back as user turns, no reasoning.
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    for step in range(3):
        messages.append({"role": "assistant", "content": f"THOUGHT {step}\n```bash\nls\n```"})
        answered = render(tok, messages, add_generation_prompt=False)
        messages.append({"role": "user", "content": f"<returncode>0</returncode>\n<output>{step}</output>"})
        assert render(tok, messages).startswith(answered)


def test_reasoning_dropped_before_the_last_user_query(tok):
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>r2</think>a2"},
    ]
    text = render(tok, messages, add_generation_prompt=False)
    assert text == (
        "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
        "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n<think>\nr2\n</think>\n\na2<|im_end|>\n"
    )
    # A user turn that only wraps tool responses is not a query.
    wrapped = [*messages[:2], {"role": "user", "content": "<tool_response>\nx\n</tool_response>"}]
    assert "<think>\nr1\n</think>" in render(tok, wrapped)


def test_roles_system_placement_and_generation_prompt(tok):
    messages = [
        {"role": "developer", "content": "dev rules"},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "mid"},
    ]
    assert render(tok, messages) == (
        "<|im_start|>system\ndev rules<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>system\nmid<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(tok, messages[1:2], add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    no_think = render(tok, messages[1:2], enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_media_parts_become_placeholders(tok):
    """The policy reads text: a screenshot must not fail the call (a 400 is not retried)."""
    content = [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,x"}},
               {"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}},
               {"type": "file", "file": {"filename": "a.pdf", "file_data": "x"}}, {"type": "file", "file": {}}]
    assert render(tok, [{"role": "user", "content": content}], add_generation_prompt=False) == \
        "<|im_start|>user\nLook: [image][audio][file a.pdf][file]<|im_end|>\n"
    refused = [{"type": "refusal", "refusal": "I cannot help with that."}]
    assert "I cannot help with that." in render(tok, [{"role": "user", "content": "x"},
                                                       {"role": "assistant", "content": refused}])


def test_invalid_messages_raise_value_error(tok):
    with pytest.raises(ValueError, match=r"messages\[0\]\.role"):
        render(tok, [{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="video_url"):
        render(tok, [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}])
    with pytest.raises(ValueError, match=r"tool_calls\[0\]"):
        render(tok, [{"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}])


# ---- parse_completion ----


def test_parse_plain_text_is_unchanged():
    assert parse_completion("Hello\nworld\n") == Parsed(content="Hello\nworld\n", reasoning=None, tool_calls=())
    assert parse_completion("") == Parsed(content="", reasoning=None, tool_calls=())
    assert parse_completion("done<|im_end|>").content == "done"
    assert parse_completion("done<|endoftext|>").content == "done"


def test_parse_a_cut_completion_leaves_out_its_unfinished_tool_call():
    """Cut by the cap inside its second call: the first call stands, the second is neither
    a call nor text. Not cut, the same unclosed block is malformed output and stays text."""
    text = ('Two steps.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "argu')
    cut = parse_completion(text, id_prefix="c", cut=True)
    assert cut.content == "Two steps." and [c.name for c in cut.tool_calls] == ["a"]
    whole = parse_completion(text, id_prefix="c")
    assert whole.content.endswith('<tool_call>\n{"name": "b", "argu') and len(whole.tool_calls) == 1
    assert parse_completion("<tool_call>\n{", cut=True) == Parsed(content="", reasoning=None, tool_calls=())


def test_parse_think():
    p = parse_completion("<think>\nplan it\n</think>\n\nThe answer.<|im_end|>")
    assert p == Parsed(content="The answer.", reasoning="plan it", tool_calls=())
    # The opening tag may sit in the prompt (thinking-only models).
    assert parse_completion("plan\n</think>\n\nok") == Parsed(content="ok", reasoning="plan", tool_calls=())
    # An empty think block is no reasoning.
    assert parse_completion("<think>\n\n</think>\n\nok").reasoning is None
    # Unclosed: truncated reasoning stays plain text.
    # cut short while thinking: reasoning, never template markup in the visible text
    assert parse_completion("<think>\nstill thinking") == Parsed(content="", reasoning="still thinking", tool_calls=())
    assert parse_completion("\n<think>\n<tool_call>\n{") == Parsed(content="", reasoning="<tool_call>\n{", tool_calls=())
    assert parse_completion("<think>") == Parsed(content="", reasoning=None, tool_calls=())
    assert parse_completion("ok <think> hm") == Parsed(content="ok <think> hm", reasoning=None, tool_calls=())


def test_parse_tool_calls():
    text = (
        "<think>\nneed ls\n</think>\n\nLet me look.\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "read", "arguments": "{\\"path\\": \\"a.py\\"}"}\n</tool_call><|im_end|>'
    )
    p = parse_completion(text, id_prefix="call_abc")
    assert p.reasoning == "need ls"
    assert p.content == "Let me look."
    assert p.tool_calls == (
        ToolCall(id="call_abc_0", name="bash", arguments='{"command": "ls -la"}'),
        ToolCall(id="call_abc_1", name="read", arguments='{"path": "a.py"}'),
    )
    assert json.loads(p.tool_calls[0].arguments) == {"command": "ls -la"}


def test_parse_malformed_tool_calls_stay_text():
    bad_json = '<tool_call>\n{"name": "bash", "arguments": {"command": }\n</tool_call>'
    assert parse_completion(bad_json) == Parsed(content=bad_json, reasoning=None, tool_calls=())
    for body in ['["bash"]', '{"arguments": {}}', '{"name": "bash", "arguments": [1]}', '{"name": "x", "arguments": "nope"}']:
        text = f"<tool_call>{body}</tool_call>"
        assert parse_completion(text).tool_calls == ()
        assert parse_completion(text).content == text
    unclosed = 'ok\n<tool_call>\n{"name": "bash", "arguments": {}}'
    assert parse_completion(unclosed) == Parsed(content=unclosed, reasoning=None, tool_calls=())
    # A valid call next to a malformed one: the valid one is extracted, the other stays text.
    mixed = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{oops}</tool_call>'
    p = parse_completion(mixed, id_prefix="p")
    assert p.tool_calls == (ToolCall(id="p_0", name="a", arguments="{}"),)
    assert p.content == "<tool_call>{oops}</tool_call>"
    # An unpaired surrogate escape: Python's json reads it, no UTF-8 answer carries it (was a 500).
    for body in ['{"name": "bash", "arguments": {"command": "echo \\ud800"}}',
                 '{"name": "bash", "arguments": "{\\"c\\": \\"\\\\udc00\\"}"}',
                 '{"name": "b\\ud800", "arguments": {}}']:
        text = f"<tool_call>{body}</tool_call>"
        assert parse_completion(text) == Parsed(content=text, reasoning=None, tool_calls=()), body
        orjson.dumps(parse_completion(text).content)


def test_parse_then_render_reproduces_canonical_output(tok):
    completion = (
        "<think>\nCheck files.\n</think>\n\nRunning ls.\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    )
    p = parse_completion(completion + "<|im_end|>", id_prefix="c")
    message = {
        "role": "assistant",
        "content": p.content,
        "reasoning_content": p.reasoning,
        "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in p.tool_calls],
    }
    prompt = render(tok, [{"role": "user", "content": "go"}])
    full = render(tok, [{"role": "user", "content": "go"}, message], add_generation_prompt=False)
    assert full == prompt + completion + "<|im_end|>\n"


def test_call_id_prefix_is_deterministic():
    assert call_id_prefix("run:exec:call:3") == call_id_prefix("run:exec:call:3")
    assert call_id_prefix("run:exec:call:3") != call_id_prefix("run:exec:call:4")
    assert call_id_prefix("x").startswith("call_") and len(call_id_prefix("x")) == 5 + 24


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<tool_call>", "</tool_call>", '{"name": "a", "arguments": {}}',
                                 "{", "}", '"', "\n", "text", "<|im_end|>"]), max_size=12).map("".join))  # fmt: skip
def test_parse_never_raises(text):
    p = parse_completion(text)
    assert isinstance(p.content, str)
    for c in p.tool_calls:
        assert isinstance(json.loads(c.arguments), dict)


_PIECES = tool_conversation() + [
    {"role": "user", "content": "Now also the docs."},
    {"role": "system", "content": "Mid-conversation note."},
    {"role": "assistant", "content": "<think>\nhm\n</think>\n\nok"},
    {"role": "assistant", "content": "", "reasoning_content": "only thinking"},
]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(range(len(_PIECES))), min_size=1, max_size=8), st.booleans(), st.booleans(),
       st.sampled_from([None, True, False]))
def test_render_matches_apply_chat_template(picks, with_tools, gen, thinking):
    """`render` calls gyre's compiled template directly; it must equal transformers'
    apply_chat_template on any conversation, with or without tools and thinking switch."""
    from gyre.serving.chat import normalize_messages

    tok = qtok.build_tokenizer()
    msgs = [_PIECES[i] for i in picks]
    tools = [BASH] if with_tools else None
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    expected = tok.apply_chat_template(normalize_messages(msgs), tools=tools, add_generation_prompt=gen,
                                       tokenize=False, **kwargs)
    assert render(tok, msgs, tools, gen, enable_thinking=thinking) == expected


def test_render_edge_inputs_behave_as_apply_chat_template():
    tok = qtok.build_tokenizer()
    with pytest.raises(ValueError):  # transformers refuses an empty conversation; so does render
        tok.apply_chat_template([], tokenize=False)
    with pytest.raises(ValueError):
        render(tok, [])

    def bash(command: str) -> str:
        """Run a shell command.

        Args:
            command: the command line
        """
        return command

    msgs = [{"role": "user", "content": "hi"}]
    assert render(tok, msgs, [bash]) == tok.apply_chat_template(msgs, tools=[bash], add_generation_prompt=True,
                                                                tokenize=False)
