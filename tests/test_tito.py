"""TITO: normalisation, extension with verbatim id reuse, branches, drift (gyre.tito)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from gyre.chat import parse_completion, render
from gyre.tito import CallStore, count_drift, message_key, normalise, normalise_message
from gyre.tokenizer import IM_END, build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                           "parameters": {"type": "object",
                                                          "properties": {"command": {"type": "string"}}}}}]
SYSTEM = {"role": "system", "content": "You are a careful coding agent."}
TASK = {"role": "user", "content": "List the files, then say done."}
# What the model writes: the exact Qwen3 tool-call form the template re-renders.
CALL_TEXT = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la", "path": "caf\u00e9"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def answer_of(text, call_id="call_a_0"):
    """The assistant message the proxy returns for a completion text (as in handlers.proxy)."""
    parsed = parse_completion(text, id_prefix=call_id.rsplit("_", 1)[0])
    msg = {"role": "assistant", "content": parsed.content or (None if parsed.tool_calls else "")}
    if parsed.reasoning:
        msg["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        msg["tool_calls"] = [{"id": tc.id, "type": "function",
                              "function": {"name": tc.name, "arguments": tc.arguments}} for tc in parsed.tool_calls]
    return msg


def serve(store, tok, messages, tools, completion_text, call, seq, *, stop=True, completion_ids=None):
    """Match, 'sample' completion_text, record; returns (match, record, answer)."""
    m = store.match(messages, tools)
    ids = completion_ids if completion_ids is not None else encode(tok, completion_text)
    if stop:
        ids = ids + [IM_END]
    answer = answer_of(completion_text, f"call_{call}_0")
    rec = store.record(m, call=call, seq=seq, answer=answer, completion_ids=ids)
    return m, rec, answer


def test_normalise_content_parts_and_cache_control():
    a = normalise_message({"role": "user", "content": "hello world"})
    b = normalise_message({"role": "user", "content": [{"type": "text", "text": "hello "},
                                                        {"type": "text", "text": "world",
                                                         "cache_control": {"type": "ephemeral"}}],
                           "cache_control": {"type": "ephemeral"}})
    assert a == b == {"role": "user", "content": "hello world"}
    assert normalise_message({"role": "assistant", "content": None}) == {"role": "assistant", "content": ""}


def test_tool_arguments_restored_from_cache_and_compared_as_json():
    raw = '{"command": "ls -la", "path": "café"}'
    resent = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "bash",
                                                         "arguments": '{"path":"caf\\u00e9","command":"ls -la"}'}}]}
    restored = normalise([resent], {"call_1": raw})[0]
    assert restored["tool_calls"][0]["function"]["arguments"] == raw
    # Different JSON is not restored; unknown ids keep the harness's text but compare as JSON.
    edited = json.loads(json.dumps(resent))
    edited["tool_calls"][0]["function"]["arguments"] = '{"command": "rm -rf /"}'
    assert normalise([edited], {"call_1": raw})[0]["tool_calls"][0]["function"]["arguments"] == '{"command": "rm -rf /"}'
    unknown = normalise([resent], {})[0]
    assert message_key(unknown) == message_key(restored)


def test_extension_reuses_ids_verbatim_despite_reserialised_arguments(tok):
    store = CallStore(tok)
    turn1 = [SYSTEM, TASK]
    m1, c1, answer1 = serve(store, tok, turn1, TOOLS, CALL_TEXT, "e:0", 0)
    assert m1.parent is None and m1.prefix_len == 0 and not m1.extended
    prompt1 = encode(tok, render(tok, turn1, TOOLS, True))
    assert m1.prompt_ids.tolist() == prompt1
    full1 = prompt1 + encode(tok, CALL_TEXT) + [IM_END]
    assert c1.full_ids().tolist() == full1
    tc_id = answer1["tool_calls"][0]["id"]
    assert store.tool_args[tc_id] == '{"command": "ls -la", "path": "café"}'

    # The harness re-serialises the arguments: no spaces, other key order, \\u escapes,
    # and sends the system prompt as a list of parts with a cache marker.
    echoed = {"role": "assistant", "content": None, "tool_calls": [
        {"id": tc_id, "type": "function",
         "function": {"name": "bash", "arguments": '{"path":"caf\\u00e9","command":"ls -la"}'}}]}
    system_parts = {"role": "system", "content": [{"type": "text", "text": SYSTEM["content"],
                                                   "cache_control": {"type": "ephemeral"}}]}
    result = {"role": "tool", "tool_call_id": tc_id, "content": "a.txt\nb.txt"}
    turn2 = [system_parts, TASK, echoed, result]
    m2 = store.match(turn2, TOOLS)
    assert m2.extended and m2.parent is c1
    assert m2.prefix_len == len(full1)
    assert m2.prompt_ids[: len(full1)].tolist() == full1  # verbatim
    canonical = [SYSTEM, TASK, answer1, result]
    suffix = render(tok, canonical, TOOLS, True)[len(render(tok, [SYSTEM, TASK, answer1], TOOLS, False)) - 1:]
    assert suffix.startswith("\n<|im_start|>user\n<tool_response>")
    assert m2.new_prompt_ids.tolist() == encode(tok, suffix)
    # The model wrote the canonical form, so the reused ids equal a fresh tokenisation.
    assert m2.prompt_ids.tolist() == encode(tok, render(tok, canonical, TOOLS, True))
    assert m2.drift == 0


def test_truncated_completion_gets_im_end_and_sampled_tokens_are_not_drift(tok):
    store = CallStore(tok)
    turn1 = [SYSTEM, TASK]
    text = "Let me look around first."
    # The model sampled "around" as single characters: not how the tokenizer splits it.
    odd = encode(tok, "Let me look ") + [j for ch in "around" for j in encode(tok, ch)] + encode(tok, " first.")
    assert odd != encode(tok, text)
    _, c1, answer1 = serve(store, tok, turn1, TOOLS, text, "e:0", 0, stop=False, completion_ids=odd)
    assert not c1.stopped
    turn2 = [*turn1, {"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
    m2 = store.match(turn2, TOOLS)
    assert m2.extended and m2.parent is c1 and m2.prefix_len == c1.full_len
    assert m2.new_prompt_ids[0] == IM_END  # the template closes the truncated turn
    assert m2.new_prompt_ids[1:].tolist() == encode(tok, "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n")
    fresh = encode(tok, render(tok, turn2, TOOLS, True))
    assert m2.prompt_ids.tolist() != fresh  # the sampled split differs ...
    assert m2.drift == 0  # ... but only inside the model-sampled span


def test_branch_at_longest_common_token_prefix(tok):
    store = CallStore(tok)
    turn1 = [SYSTEM, TASK]
    _, c1, answer1 = serve(store, tok, turn1, TOOLS, CALL_TEXT, "e:0", 0)
    tc_id = answer1["tool_calls"][0]["id"]
    turn2 = [*turn1, answer1, {"role": "tool", "tool_call_id": tc_id, "content": "a.txt"}]
    m2, c2, _ = serve(store, tok, turn2, TOOLS, "done", "e:1", 1)
    assert m2.parent is c1
    # A retry with an edited task: shares only the system turn and the user turn's head.
    edited = [SYSTEM, {"role": "user", "content": "List the files, then stop."}]
    m3 = store.match(edited, TOOLS)
    fresh = encode(tok, render(tok, edited, TOOLS, True))
    full2 = c2.full_ids().tolist()
    lcp = next(i for i, (a, b) in enumerate(zip(fresh, full2)) if a != b)
    assert not m3.extended and m3.prompt_ids.tolist() == fresh
    assert m3.prefix_len == lcp and 0 < lcp < c1.prompt_len
    assert m3.parent is c1  # the call that first held the shared ids
    assert m3.drift == 0
    # Other tools: never an extension; a different first turn shares only <|im_start|>.
    m4 = store.match(turn2, [])
    assert not m4.extended
    m5 = store.match([{"role": "user", "content": "unrelated"}], None)
    assert m5.parent is c1 and m5.prefix_len == 1
    assert CallStore(tok).match(turn1, TOOLS).parent is None


def test_dropped_thinking_opens_a_branch(tok):
    store = CallStore(tok)
    turn1 = [SYSTEM, TASK]
    text = "<think>\nI should list files.\n</think>\n\nSure."
    _, c1, answer1 = serve(store, tok, turn1, TOOLS, text, "e:0", 0)
    assert answer1["reasoning_content"] == "I should list files."
    # A new user query: the template drops the earlier thinking, so no string prefix.
    turn2 = [*turn1, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "thanks"}]
    m2 = store.match(turn2, TOOLS)
    assert not m2.extended and m2.parent is c1
    assert m2.prefix_len == c1.prompt_len  # diverges where <think> was sampled
    assert m2.prompt_ids.tolist() == encode(tok, render(tok, turn2, TOOLS, True))


def test_three_turn_chain_segments_and_masks(tok):
    store = CallStore(tok)
    msgs = [SYSTEM, TASK]
    recs = []
    for seq in range(3):
        m, rec, answer = serve(store, tok, msgs, TOOLS, f"step {seq}", f"e:{seq}", seq)
        if seq:
            assert m.extended and m.parent is recs[-1] and m.drift == 0
        recs.append(rec)
        msgs = [*msgs, answer, {"role": "user", "content": f"continue {seq}"}]
    last = recs[-1]
    assert last.full_ids().tolist() == encode(tok, render(tok, msgs[:-1], TOOLS, False))[:last.full_len]
    mask = last.sampled_mask(last.full_len)
    assert int(mask.sum()) == sum(r.completion_len for r in recs)
    for r in recs:
        assert mask[r.prompt_len:r.full_len].all() and not mask[r.prompt_len - 1]


def test_count_drift_by_hand():
    E = IM_END
    rec = np.array([1, 2, E, 5, 6, 7, E, 8, 9, E])
    sam = np.array([0, 0, 0, 0, 1, 1, 1, 0, 0, 0], bool)
    # chunk 0 equal; chunk 1: sampled from index 1, the re-render is longer (ignored);
    # chunk 2: one id differs and one is missing.
    ren = np.array([1, 2, E, 5, 4, 4, 4, E, 8, 0])
    assert count_drift(rec, sam, ren) == 2
    # Template part before the sampled span differs: counted.
    ren2 = np.array([1, 2, E, 3, 6, 7, E, 8, 9, E])
    assert count_drift(rec, sam, ren2) == 1
    # An extra rendered chunk counts in full.
    assert count_drift(rec, sam, np.concatenate([rec, [4, 4, E]])) == 3


def test_anthropic_harness_noise_still_extends_verbatim(tok):
    """Claude Code's noise (billing line, moving cache marker, string → text block, echoed
    thinking with its signature, re-serialised tool input) leaves the conversation equal."""
    from handlers.proxy_anthropic import anthropic_messages, anthropic_tools, thinking_signature

    store = CallStore(tok)
    tools = anthropic_tools([{"name": "bash", "input_schema": {"type": "object"},
                              "cache_control": {"type": "ephemeral"}}])
    body0 = {"system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
             "messages": [{"role": "user", "content": "List the files."}]}
    text = "<think>\nLook first.\n</think>\n\n" + CALL_TEXT
    m0, rec0, answer = serve(store, tok, anthropic_messages(body0), tools, text, "a", 0)
    tc = answer["tool_calls"][0]
    assert "billing" not in tok.decode(m0.prompt_ids.tolist())
    body1 = {"system": [{"type": "text", "text": "x-anthropic-billing-header: cch=2;"},
                        {"type": "text", "text": "You are Claude Code."}],
             "messages": [{"role": "user", "content": [{"type": "text", "text": "List the files."}]},
                          {"role": "assistant", "content": [
                              {"type": "thinking", "thinking": "Look first.", "signature": thinking_signature("Look first.")},
                              {"type": "tool_use", "id": tc["id"], "name": "bash",
                               "input": {"path": "caf\u00e9", "command": "ls -la"}}]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tc["id"],
                                                        "content": [{"type": "text", "text": "a.txt"}],
                                                        "cache_control": {"type": "ephemeral"}}]}]}
    m1 = store.match(anthropic_messages(body1), tools)
    assert (m1.parent, m1.prefix_len, m1.extended, m1.drift) == (rec0, rec0.full_len, True, 0)
    assert m1.prompt_ids[:rec0.full_len].tolist() == rec0.full_ids().tolist()


def test_fresh_match_is_a_root_and_leaves_the_store_alone(tok):
    store = CallStore(tok)
    serve(store, tok, [SYSTEM, TASK], TOOLS, "Done.", "a", 0)
    m = store.fresh([SYSTEM, TASK], TOOLS)
    assert (m.parent, m.prefix_len, m.extended) == (None, 0, False) and len(store.calls) == 1
    assert m.prompt_ids.tolist() == encode(tok, render(tok, [SYSTEM, TASK], TOOLS))
