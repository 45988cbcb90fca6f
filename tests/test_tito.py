"""TITO: normalisation, extension with verbatim id reuse, branches, drift (gyre.serving.tito,
.normalise, .drift, .call_record)."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from gyre.serving.chat import parse_completion, render
from gyre.serving.drift import count_drift
from gyre.serving.normalise import MESSAGE_CHARS, equal_prefix_len, message_key, normalise, normalise_message
from gyre.serving.tito import HEAVY_CHARS, CallStore, Match, Pending
from gyre.serving.tokenizer import IM_END, build_tokenizer

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
    """The assistant message the proxy returns for a completion text (as in handlers.proxy.call)."""
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


def test_attach_defers_a_branch_whose_prompt_can_be_made_off_the_store(tok):
    """`attach` returns an extension's Match at once and a branch or fresh request as
    Pending; `prepare` (what the proxy runs in a worker thread) plus `complete` give what
    `match` / `fresh` give; `heavy` counts content, reasoning and tool-call arguments."""
    store = CallStore(tok)
    turn1 = [SYSTEM, TASK]
    _, c1, answer1 = serve(store, tok, turn1, TOOLS, CALL_TEXT, "e:0", 0)
    tc_id = answer1["tool_calls"][0]["id"]
    turn2 = [*turn1, answer1, {"role": "tool", "tool_call_id": tc_id, "content": "a.txt"}]
    assert isinstance(store.attach(turn2, TOOLS), Match)
    serve(store, tok, turn2, TOOLS, "done", "e:1", 1)
    edited = [SYSTEM, {"role": "user", "content": "List the files, then stop."}]
    pending = store.attach(edited, TOOLS)
    assert isinstance(pending, Pending) and not pending.fresh and not pending.heavy and pending.digest
    prepared = store.prepare(pending)
    assert prepared.prompt_ids.tolist() == encode(tok, render(tok, edited, TOOLS, True))
    got, want = store.complete(pending, prepared), store.match(edited, TOOLS)
    assert (got.parent, got.prefix_len, got.digest, got.messages, got.extended) == \
        (want.parent, want.prefix_len, want.digest, want.messages, False)
    assert got.prompt_ids.tolist() == want.prompt_ids.tolist() and got.parent is c1
    aux = store.attach(turn2, TOOLS, fresh=True)
    assert isinstance(aux, Pending) and aux.fresh and aux.digest == b""
    root = store.complete(aux, store.prepare(aux))
    assert root.parent is None and root.prefix_len == 0
    assert root.prompt_ids.tolist() == store.fresh(turn2, TOOLS).prompt_ids.tolist()
    # Heavy: more than HEAVY_CHARS characters of text, wherever in the messages they are,
    # with MESSAGE_CHARS for each message and tool call.
    at_limit = [{"role": "user", "content": "x" * (HEAVY_CHARS - MESSAGE_CHARS)}]
    assert not store.attach(at_limit, fresh=True).heavy
    assert store.attach([{"role": "user", "content": "x" * (HEAVY_CHARS - MESSAGE_CHARS + 1)}], fresh=True).heavy
    framing = 4 * MESSAGE_CHARS  # 3 messages and a tool call
    split = [{"role": "user", "content": "x" * (HEAVY_CHARS // 2 - framing)},
             {"role": "assistant", "content": "", "reasoning_content": "y" * (HEAVY_CHARS // 4),
              "tool_calls": [{"id": "t", "type": "function",
                              "function": {"name": "bash", "arguments": "z" * (HEAVY_CHARS // 4 + 1)}}]},
             {"role": "tool", "tool_call_id": "t", "content": ""}]
    assert store.attach(split).heavy
    split[2]["content"] = [{"text": "w"}]  # shorter by one: at the limit, though in an untyped part
    split[1]["tool_calls"][0]["function"]["arguments"] = "z" * (HEAVY_CHARS // 4 - 1)
    assert not store.attach(split, fresh=True).heavy
    split[2]["content"] = [{"text": "ww"}]
    assert store.attach(split, fresh=True).heavy
    short_turns = [{"role": "user", "content": "ls"}] * (HEAVY_CHARS // MESSAGE_CHARS + 1)
    assert store.attach(short_turns, fresh=True).heavy  # many short turns: rendering is per message too
    long_tool = [{"type": "function", "function": {"name": "bash", "description": "d" * HEAVY_CHARS}}]
    assert store.attach([{"role": "user", "content": "hi"}], long_tool, fresh=True).heavy
    assert store.attach([{"role": "user", "content": "hi"}], long_tool).heavy


def test_with_another_template_an_extension_is_pending_and_prepared_off_the_store(tok):
    """With a template other than gyre's, an extension needs both conversations rendered
    whole: `attach` returns it as Pending (extends = the call), `prepare` gives the suffix
    and the reference for drift, `complete` the Match `match` gives; a request whose
    rendering is not an extension of the call's becomes a branch from the same rendering."""
    store, twin = CallStore(tok, render=render), CallStore(tok, render=render)
    turn1 = [SYSTEM, TASK]
    _, c1, answer1 = serve(store, tok, turn1, TOOLS, CALL_TEXT, "e:0", 0)
    serve(twin, tok, turn1, TOOLS, CALL_TEXT, "e:0", 0)
    tc_id = answer1["tool_calls"][0]["id"]
    turn2 = [*turn1, answer1, {"role": "tool", "tool_call_id": tc_id, "content": "a.txt"}]
    pending = store.attach(turn2, TOOLS)
    assert isinstance(pending, Pending) and pending.extends is c1 and len(pending.rest) == 1
    prepared = store.prepare(pending)
    assert prepared.prompt_ids is None and prepared.reference_ids.tolist() == encode(tok, render(tok, turn2, TOOLS, True))
    got, want = store.complete(pending, prepared), twin.match(turn2, TOOLS)
    assert got.extended and got.parent is c1 and got.prefix_len == c1.full_len and got.drift == want.drift == 0
    assert got.prompt_ids.tolist() == want.prompt_ids.tolist() and got.messages == want.messages
    # The answer's thinking dropped by a later query: not a string prefix, so a branch.
    think = "<think>\nI should list files.\n</think>\n\nSure."
    _, c2, answer2 = serve(store, tok, [SYSTEM, {"role": "user", "content": "hi"}], TOOLS, think, "e:1", 1)
    later = [SYSTEM, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure."},
             {"role": "user", "content": "thanks"}]
    pending = store.attach(later, TOOLS)
    assert pending.extends is None  # a query after shown reasoning: known to branch without rendering c2's turn
    prepared = store.prepare(pending)
    assert prepared.suffix_ids is None and prepared.prompt_ids.tolist() == encode(tok, render(tok, later, TOOLS, True))
    m = store.complete(pending, prepared)
    assert not m.extended and m.parent is c2 and m.prefix_len == c2.prompt_len
    # The harness drops the reasoning but no new query follows (a tool result): the call's
    # recorded answer, which shows it, is what is rendered, so this extends c3.
    ask = [SYSTEM, {"role": "user", "content": "run ls"}]
    _, c3, answer3 = serve(store, tok, ask, TOOLS, "<think>\nls it\n</think>\n\n" + CALL_TEXT, "e:2", 2)
    dropped = {k: v for k, v in answer3.items() if k != "reasoning_content"}
    follow = [*ask, dropped, {"role": "tool", "tool_call_id": answer3["tool_calls"][0]["id"], "content": "a.txt"}]
    pending = store.attach(follow, TOOLS)
    m = store.complete(pending, store.prepare(pending))
    assert m.extended and m.parent is c3 and m.drift == 0 and m.messages[2] == c3.answer


def test_an_extension_by_long_messages_is_pending_with_gyres_template(tok, monkeypatch):
    """With gyre's template an extension renders only its new messages; when they are long
    (a huge tool output) `attach` returns it as Pending so that `prepare` can render and
    encode them off the loop, and `complete` gives what `match` gives."""
    import gyre.serving.tito

    store, twin = CallStore(tok), CallStore(tok)
    turn1 = [SYSTEM, TASK]
    _, c1, answer1 = serve(store, tok, turn1, TOOLS, CALL_TEXT, "e:0", 0)
    serve(twin, tok, turn1, TOOLS, CALL_TEXT, "e:0", 0)
    big = [*turn1, answer1, {"role": "tool", "tool_call_id": answer1["tool_calls"][0]["id"], "content": "ab " * 500}]
    want = twin.match(big, TOOLS)
    monkeypatch.setattr(gyre.serving.tito, "HEAVY_CHARS", 1_000)
    pending = store.attach(big, TOOLS)
    assert isinstance(pending, Pending) and pending.heavy and pending.extends is c1 and pending.rest == (big[-1],)
    assert isinstance(store.attach(turn1 + [answer1, {"role": "tool", "tool_call_id": "x", "content": "ok"}],
                                   TOOLS), Match)  # short new messages: the Match at once
    got = store.complete(pending, store.prepare(pending))
    assert (got.extended, got.parent, got.prefix_len, got.drift, got.messages, got.query, got.shown) == \
        (True, c1, want.prefix_len, want.drift, want.messages, want.query, want.shown)
    assert got.prompt_ids.tolist() == want.prompt_ids.tolist() == encode(tok, render(tok, big, TOOLS, True))


def test_prepare_reads_no_state_and_calls_recorded_before_complete_count(tok):
    """What the proxy does around its worker thread: `prepare` leaves the store as it
    was (the first-turn cache included), and calls recorded between `attach` and
    `complete` are candidates for the branch's parent like any other."""
    store = CallStore(tok)
    turn1 = [SYSTEM, TASK]
    serve(store, tok, turn1, TOOLS, "first", "e:0", 0)
    edited = [SYSTEM, {"role": "user", "content": "List the files, then stop. Be brief."}]
    pending = store.attach(edited, TOOLS)
    kept = dict(store._first_turns)
    prepared = store.prepare(pending)
    no_tools = store.attach(edited)  # a first turn the store has not seen
    assert store.prepare(no_tools).prompt_ids.tolist() == encode(tok, render(tok, edited, None, True))
    assert store._first_turns == kept and len(kept) == 1 and len(store.calls) == 1
    # Meanwhile a call that shares more of the branch's prompt is served and recorded.
    closer = [SYSTEM, {"role": "user", "content": "List the files, then stop."}]
    _, c1, _ = serve(store, tok, closer, TOOLS, "second", "e:1", 1)
    m = store.complete(pending, prepared)
    assert m.parent is c1 and m.prefix_len > 0 and m.prompt_ids[:m.prefix_len].tolist() == \
        c1.full_ids()[:m.prefix_len].tolist()
    assert m.prefix_len == store.match(edited, TOOLS).prefix_len


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


@pytest.mark.parametrize("incremental", [True, False])
def test_an_empty_think_block_opens_a_branch_as_a_full_one_does(tok, incremental):
    """The engine answers `<think>\n\n</think>\n\nI am good!`; the harness sends the turn
    back as "I am good!" with a new query. The template renders that turn without the
    block the call's ids hold, so the request branches where the block was sampled (as
    with a non-empty block), also when the block lies further back in an extended chain;
    a tool result instead of a query extends, as it does after a full block."""
    store = CallStore(tok) if incremental else CallStore(tok, render=render)
    assert store.incremental == incremental
    turn1 = [SYSTEM, TASK]
    _, c1, answer1 = serve(store, tok, turn1, TOOLS, "<think>\n\n</think>\n\nI am good!", "e:0", 0)
    assert answer1 == {"role": "assistant", "content": "I am good!"}  # nothing of the block is left
    turn2 = [*turn1, {"role": "assistant", "content": "I am good!"}, {"role": "user", "content": "and you?"}]
    m2 = store.match(turn2, TOOLS)
    assert not m2.extended and m2.parent is c1 and m2.prefix_len == c1.prompt_len
    assert m2.prompt_ids.tolist() == encode(tok, render(tok, turn2, TOOLS, True))
    # Further back: an empty block, then a tool round that extends it, then a query.
    _, c3, answer3 = serve(store, tok, turn1, TOOLS, "<think>\n\n</think>\n\n" + CALL_TEXT, "e:2", 2)
    tool_turn = [*turn1, answer3, {"role": "tool", "tool_call_id": answer3["tool_calls"][0]["id"], "content": "a"}]
    m4, c4, answer4 = serve(store, tok, tool_turn, TOOLS, "Listed.", "e:3", 3)
    assert m4.extended and m4.parent is c3
    m5 = store.match([*tool_turn, answer4, {"role": "user", "content": "thanks"}], TOOLS)
    assert not m5.extended and m5.prefix_len == c3.prompt_len


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


@pytest.mark.parametrize("seed", range(20))
def test_shared_len_over_a_tree_equals_the_plain_common_prefix(seed):
    """`_shared_len` (a branch's parent choice, memoised over a tree's ancestors) equals
    the common prefix of each call's full ids with the prompt, in any visiting order, on
    random trees whose calls share long prefixes (ids from a 3-letter alphabet)."""
    from gyre.serving.call_record import CallRecord, _shared_len

    rng = random.Random(seed)
    recs: list[CallRecord] = []
    for i in range(40):
        parent = rng.choice(recs) if recs and rng.random() < 0.9 else None
        prefix = rng.randint(0, parent.full_len) if parent is not None else 0
        own = np.asarray([rng.randrange(3) for _ in range(rng.randint(0, 12))], np.int32)
        recs.append(CallRecord(call=f"e:{i}", seq=i, parent=parent, prefix_len=prefix, own_ids=own, completion_len=0,
                               messages=(), tools=(), answer={}, conv_key=b""))
    for _ in range(5):
        base = rng.choice(recs).full_ids().tolist()
        cut = rng.randint(0, len(base))
        prompt = np.asarray(base[:cut] + [rng.randrange(3) for _ in range(rng.randint(0, 8))], np.int32)
        memo: dict[str, int] = {}
        for rec in rng.sample(recs, len(recs)):
            full = rec.full_ids().tolist()
            plain = next((i for i, (a, b) in enumerate(zip(full, prompt.tolist())) if a != b), min(len(full), len(prompt)))
            assert _shared_len(rec, prompt, memo) == plain


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
    # The id before a sampled span joined with the span's start by the fresh encoding
    # (id 3 = id 5's text and more): not counted with `joins`, counted without.
    ren3 = np.array([1, 2, E, 3, 6, 7, E, 8, 9, E])
    assert count_drift(rec, sam, ren3, lambda r, f: (r, f) == (5, 3)) == 0
    assert count_drift(rec, sam, ren3, lambda r, f: False) == 1


@pytest.mark.parametrize("incremental", [True, False])
@pytest.mark.parametrize("text", ["\nHello", "\n\nHello", "\n", " Hello", "Hello"])
def test_an_answer_opening_with_a_newline_extends_without_drift(tok, incremental, text):
    """The header's "\n" and a completion's leading "\n" encode as one "\n\n" id when the
    conversation is tokenised afresh: a join at the sampled span's edge, not drift."""
    store = CallStore(tok) if incremental else CallStore(tok, render=render)
    turn1 = [SYSTEM, TASK]
    _, c1, answer1 = serve(store, tok, turn1, TOOLS, text, "e:0", 0)
    turn2 = [*turn1, answer1, {"role": "user", "content": "<tool_response>\nok\n</tool_response>"}]
    m = store.match(turn2, TOOLS)
    assert (m.parent, m.extended, m.drift, store.full_drift(m)) == (c1, True, 0, 0)
    assert m.prompt_ids[:c1.full_len].tolist() == c1.full_ids().tolist()


def test_anthropic_harness_noise_still_extends_verbatim(tok):
    """Claude Code's noise (billing line, moving cache marker, string → text block, echoed
    thinking with its signature, re-serialised tool input) leaves the conversation equal."""
    from handlers.proxy.anthropic import anthropic_messages, anthropic_tools, thinking_signature

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


def test_tools_as_the_template_writes_them_key_order_numbers_and_a_cache_control_parameter(tok):
    """The template writes each tool as JSON in the order given, so tools that differ only in
    key order or number type (`1` / `1.0` / `true`, equal in Python) are other tools: a
    call with them is not an extension of a call rendered with the first ones (its prompt is
    what a fresh render gives). A moved `cache_control` marker on a tool or its function is
    noise; a schema property named `cache_control` is the tool's own and reaches the policy."""
    turn2 = [SYSTEM, TASK, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    reordered = [{"function": {"parameters": TOOLS[0]["function"]["parameters"], "description": "run a command",
                               "name": "bash"}, "type": "function"}]
    fn = TOOLS[0]["function"]
    numbered = [{"type": "function", "function": {**fn, "parameters": {**fn["parameters"], "maxProperties": 1}}}]
    floated = [{"type": "function", "function": {**fn, "parameters": {**fn["parameters"], "maxProperties": 1.0}}}]
    for first, then in ((TOOLS, reordered), (numbered, floated)):
        store = CallStore(tok)
        serve(store, tok, [SYSTEM, TASK], first, "ok", "a", 0)
        store.match([SYSTEM, TASK], first)  # the memo holds the first tools' request too
        m1 = store.match(turn2, then)
        assert not m1.extended
        assert m1.prompt_ids.tolist() == encode(tok, render(tok, turn2, then))

    marked = [{**TOOLS[0], "cache_control": {"type": "ephemeral"}}]
    marked_fn = [{"type": "function", "function": {**fn, "cache_control": {"type": "ephemeral"}}}]
    store = CallStore(tok)
    _, rec0, _ = serve(store, tok, [SYSTEM, TASK], marked, "ok", "a", 0)
    m1 = store.match(turn2, marked_fn)
    assert (m1.parent, m1.prefix_len, m1.extended, m1.drift) == (rec0, rec0.full_len, True, 0)
    assert m1.prompt_ids.tolist() == encode(tok, render(tok, turn2, TOOLS))

    own = [{"type": "function", "function": {"name": "http_get", "parameters": {
        "type": "object", "properties": {"url": {"type": "string"}, "cache_control": {"type": "string"}},
        "required": ["url", "cache_control"]}}}]
    m = CallStore(tok).match([SYSTEM, TASK], own)
    assert m.prompt_ids.tolist() == encode(tok, render(tok, [SYSTEM, TASK], own))
    assert '"cache_control": {"type": "string"}' in tok.decode(m.prompt_ids.tolist())


def test_fresh_match_is_a_root_and_leaves_the_store_alone(tok):
    store = CallStore(tok)
    serve(store, tok, [SYSTEM, TASK], TOOLS, "Done.", "a", 0)
    m = store.fresh([SYSTEM, TASK], TOOLS)
    assert (m.parent, m.prefix_len, m.extended) == (None, 0, False) and len(store.calls) == 1
    assert m.prompt_ids.tolist() == encode(tok, render(tok, [SYSTEM, TASK], TOOLS))


# --------------------------------------------------------------------------- incremental rendering and drift

from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gyre.serving.chat import render_appended, render_assistant_turn, uses_gyre_template  # noqa: E402
from gyre.serving.tito import TURN_HEADER, conversation_facts  # noqa: E402

_WORDS = ["ls", "done", "fix", " it", "\n", "\n\n", "a.py", "ok", "café", "{}", "  ", "x"]
_text = st.lists(st.sampled_from(_WORDS), max_size=5).map("".join)
_reasoning = st.one_of(st.none(), st.just(""), st.just("\n"), _text)


@st.composite
def _completion(draw):
    """What the model writes: optional reasoning, text, 0-2 tool calls (Qwen3 form)."""
    parts = [draw(st.sampled_from(["", "", "\n", " "]))]  # a leading newline re-tokenises with the header
    reasoning = draw(_reasoning)
    if reasoning is not None:
        parts.append(f"<think>\n{reasoning}\n</think>\n\n")
    parts.append(draw(_text))
    for _ in range(draw(st.integers(0, 2))):
        cmd = draw(st.sampled_from(["ls", "cat a.py", "pytest -q"]))
        parts.append(f'\n<tool_call>\n{{"name": "bash", "arguments": {{"command": "{cmd}"}}}}\n</tool_call>')
    return "".join(parts)


@st.composite
def _appended(draw, answer):
    """What a harness sends after an answer: tool results for its calls, then any of a user
    message, a wrapped tool response as user text, a mid-conversation system message."""
    out = [{"role": "tool", "tool_call_id": tc["id"], "content": draw(_text)} for tc in answer.get("tool_calls", ())]
    for _ in range(draw(st.integers(0 if out else 1, 2))):
        kind = draw(st.sampled_from(["user", "user", "wrapped", "system", "tool", "assistant"]))
        if kind == "assistant":  # a turn the harness wrote itself (spliced history, a canned reply)
            out.append(answer_of(draw(_completion()), "call_y_0"))
        elif kind == "user":
            out.append({"role": "user", "content": draw(_text) or "go on"})
        elif kind == "wrapped":
            out.append({"role": "user", "content": f"<tool_response>\n{draw(_text)}\n</tool_response>"})
        elif kind == "system":
            out.append({"role": "system", "content": draw(_text)})
        else:
            out.append({"role": "tool", "tool_call_id": "call_foreign", "content": draw(_text)})
    return out


@st.composite
def _session(draw):
    """A start (system? + user task, or a lone user/system message) and per call: the
    completion, how the model sampled it, whether the harness keeps reasoning when echoing."""
    start = []
    if draw(st.booleans()):
        start.append({"role": "system", "content": "You are a careful coding agent."})
    start.append({"role": "user", "content": draw(st.sampled_from(["List the files.", "<tool_response>\nx\n</tool_response>"]))})
    steps = []
    for _ in range(draw(st.integers(1, 4))):
        steps.append((draw(_completion()), draw(st.sampled_from(["plain", "chars", "truncated"])), draw(st.booleans()),
                      draw(st.integers(0, 2**32 - 1))))
    return start, steps, draw(st.booleans())


def _play(store, tok, session):
    """Serve a session through `store`: per call (match, record)."""
    start, steps, with_tools = session
    tools = TOOLS if with_tools else None
    msgs = list(start)
    out = []
    for seq, (text, sampling, keep_reasoning, seed) in enumerate(steps):
        rnd = random.Random(seed)
        m = store.match(msgs, tools)
        if sampling == "chars":  # a sampled split the tokenizer would not produce
            ids = [j for ch in text for j in encode(tok, ch)] + [IM_END]
        else:
            ids = encode(tok, text) + ([] if sampling == "truncated" else [IM_END])
        answer = answer_of(text, f"call_s{seq}_0")
        rec = store.record(m, call=f"e:{seq}", seq=seq, answer=answer, completion_ids=ids)
        out.append((m, rec))
        echoed = dict(answer)
        if not keep_reasoning:
            echoed.pop("reasoning_content", None)
        for tc in echoed.get("tool_calls", ()):  # the harness re-serialises arguments
            tc["function"]["arguments"] = json.dumps(json.loads(tc["function"]["arguments"]), separators=(",", ":"))
        msgs = [*msgs, echoed, *rnd.choice(_FOLLOWS)(answer, rnd)]
    return out


def _follow_tools_then_user(answer, rnd):
    res = [{"role": "tool", "tool_call_id": tc["id"], "content": rnd.choice(_WORDS)} for tc in answer.get("tool_calls", ())]
    return res or [{"role": "user", "content": "go on"}]


def _follow_user(answer, rnd):
    res = [{"role": "tool", "tool_call_id": tc["id"], "content": rnd.choice(_WORDS)} for tc in answer.get("tool_calls", ())]
    return [*res, {"role": "user", "content": rnd.choice(["next", "<tool_response>\nok\n</tool_response>"])}]


def _follow_system(answer, rnd):
    res = [{"role": "tool", "tool_call_id": tc["id"], "content": rnd.choice(_WORDS)} for tc in answer.get("tool_calls", ())]
    return [*res, {"role": "system", "content": "Reminder: " + rnd.choice(_WORDS)}]


def _follow_text_observation(answer, rnd):
    return [{"role": "user", "content": "<returncode>0</returncode>\n" + rnd.choice(_WORDS)}]


def _follow_spliced_assistant(answer, rnd):
    res = [{"role": "tool", "tool_call_id": tc["id"], "content": rnd.choice(_WORDS)} for tc in answer.get("tool_calls", ())]
    spliced = {"role": "assistant", "content": rnd.choice(["", "noted", "<think>\nhm\n</think>\n\nnoted"])}
    return [*res, spliced, {"role": "user", "content": rnd.choice(["next", "<tool_response>\nok\n</tool_response>"])}]


_FOLLOWS = [_follow_tools_then_user, _follow_user, _follow_system, _follow_text_observation, _follow_spliced_assistant]


def _cut(text):
    return text[: text.rfind("<|im_end|>") + len("<|im_end|>")]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(head=st.lists(st.sampled_from(["user", "wrapped", "system", "tool_turn", "assistant"]), max_size=4),
       last=_completion(), data=st.data())
def test_appended_rendering_equals_the_full_render_suffix(tok, head, last, data):
    """For conversations ending with an assistant answer, render_appended is exactly the
    suffix the full render adds, whenever the full render extends the conversation's — and
    conversation_facts predicts when it does not."""
    conv = [{"role": "system", "content": "sys"}]
    for kind in head:
        if kind == "user":
            conv.append({"role": "user", "content": "do it"})
        elif kind == "wrapped":
            conv.append({"role": "user", "content": "<tool_response>\nr\n</tool_response>"})
        elif kind == "system":
            conv.append({"role": "system", "content": "mid"})
        elif kind == "tool_turn":
            conv += [answer_of(CALL_TEXT, "call_h_0"), {"role": "tool", "tool_call_id": "call_h_0", "content": "r"}]
        else:
            conv.append(answer_of(data.draw(_completion()), "call_x_0"))
    answer = answer_of(last, "call_l_0")
    if "reasoning_content" in answer and data.draw(st.booleans()):  # reasoning inline in the content
        answer = {k: v for k, v in answer.items() if k != "reasoning_content"}
        answer["content"] = f"<think>\n{answer_of(last)['reasoning_content']}\n</think>\n\n{answer['content'] or ''}"
    conv.append(answer)
    new = data.draw(_appended(answer))
    tools = data.draw(st.sampled_from([None, TOOLS]))
    query, shown = conversation_facts(conv)
    full = render(tok, conv + new, tools, True)
    prev = _cut(render(tok, conv, tools, False))
    extends = not (shown and any(m["role"] == "user" and not m["content"].startswith("<tool_response>") for m in new))
    assert full.startswith(prev) == extends
    event("extends" if extends else "hidden reasoning: no extension")
    if extends:
        assert full[len(prev):] == render_appended(tok, new, after_query=query)
    # The answer's own turn as the full render has it.
    before = _cut(render(tok, conv[:-1], tools, False)) if len(conv) > 1 else ""
    turn = prev[len(before):] if prev.startswith(before) else None
    if turn is not None:
        assert turn == render_assistant_turn(tok, answer, after_query=conversation_facts(conv[:-1])[0])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(session=_session())
def test_incremental_store_matches_the_full_render_store(tok, session):
    """The same session through the incremental store and through one that renders in full
    (another renderer disables the incremental path): the same parents, prefixes, prompt ids
    and drift, and the drift equals the full-request count."""
    fast, slow = CallStore(tok), CallStore(tok, render=render)
    assert fast.incremental and not slow.incremental
    for (mf, rf), (ms, rs) in zip(_play(fast, tok, session), _play(slow, tok, session)):
        assert (mf.extended, mf.prefix_len, rf.seq) == (ms.extended, ms.prefix_len, rs.seq)
        assert (mf.parent.call if mf.parent else None) == (ms.parent.call if ms.parent else None)
        assert mf.messages == ms.messages and mf.digest == ms.digest
        assert mf.prompt_ids.tolist() == ms.prompt_ids.tolist()
        assert mf.drift == ms.drift == fast.full_drift(mf)
        event("extension" if mf.extended else "branch" if mf.parent else "root")
        if mf.drift:
            event("drift > 0")
        if mf.extended:
            assert mf.prompt_ids.tolist()[len(mf.prompt_ids) - len(encode(tok, "\n<|im_start|>assistant\n")):] == \
                encode(tok, "\n<|im_start|>assistant\n")


def test_a_store_encodes_each_first_turn_once(tok, monkeypatch):
    """Branches and auxiliary calls resending a system prompt and tools take the first
    turn's ids from the store (FIRST_TURNS distinct ones, least recently used dropped), and every prompt
    equals the plain encoding, also where the texts either side of the first <|im_end|>
    would merge if encoded together ("é" + a combining accent)."""
    from gyre.serving.tito import FIRST_TURNS

    encoded: list[str] = []
    plain = CallStore.encode

    def counting(self, text):
        encoded.append(text)
        return plain(self, text)

    monkeypatch.setattr(CallStore, "encode", counting)
    store = CallStore(tok)

    def head_of(conversation):
        whole = render(tok, conversation, TOOLS)
        return whole, whole[: whole.index("<|im_end|>") + len("<|im_end|>")]

    system = {"role": "system", "content": "You are careful. Last word: caf\u00e9"}
    for first_user in ["\u0301accent first", "fix the bug", "<|im_end|>x"]:
        conversation = [system, {"role": "user", "content": first_user}]
        m, f = store.match(conversation, TOOLS), store.fresh(conversation, TOOLS)
        whole, head = head_of(conversation)
        assert m.prompt_ids.tolist() == f.prompt_ids.tolist() == encode(tok, whole)
        assert head.startswith("<|im_start|>system") and "# Tools" in head
        assert encoded.count(head) == 1 and whole not in encoded
    others = [[{"role": "system", "content": f"agent {k}"}, {"role": "user", "content": "go"}]
              for k in range(FIRST_TURNS)]
    for conversation in others:  # FIRST_TURNS new first turns: the first one is dropped
        store.fresh(conversation, TOOLS)
    store.fresh([system, {"role": "user", "content": "again"}], TOOLS)
    store.fresh(others[-1], TOOLS)
    assert encoded.count(head) == 2 and encoded.count(head_of(others[-1])[1]) == 1
    # The least recently used goes first: the system turn, the oldest kept after FIRST_TURNS - 1
    # new ones, then used, stays when one more comes (first in, first out would drop it).
    new = [[{"role": "system", "content": f"new agent {k}"}, {"role": "user", "content": "go"}]
           for k in range(FIRST_TURNS)]
    store.fresh([system, {"role": "user", "content": "newest"}], TOOLS)
    for conversation in new[:-1]:
        store.fresh(conversation, TOOLS)
    store.fresh([system, {"role": "user", "content": "used"}], TOOLS)
    store.fresh(new[-1], TOOLS)
    store.fresh([system, {"role": "user", "content": "still kept"}], TOOLS)
    assert encoded.count(head) == 2


def test_first_turns_are_not_split_off_where_encoding_does_not_split_at_im_end(tok):
    """A tokenizer whose <|im_end|> is `normalized` or `single_word`, or with another added
    token matching over it, does not split at every written <|im_end|>: the store encodes
    such prompts whole."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    systems = {"normalized": "Reply, then write <|im_end|>\u0338 at the end.",
               "single_word": "Reply, then write <|im_end|>x at the end.",
               "<|im_end|>\n": "Reply.",  # the template's own <|im_end|>\n matches it
               "x<|im": "Reply, then write x<|im_end|>\nat the end."}
    for flag, system in systems.items():
        conversation = [{"role": "system", "content": system}, {"role": "user", "content": "fix the bug"}]
        doc = json.loads(tok.backend_tokenizer.to_str())
        if flag.startswith("x") or flag.startswith("<"):  # another added token matching over it
            doc["added_tokens"].append({**next(t for t in doc["added_tokens"] if t["content"] == "<|im_end|>"),
                                        "id": 151_900 + len(flag), "content": flag})
        for t in doc["added_tokens"]:
            if t["content"] == "<|im_end|>" and not flag.startswith(("x", "<")):
                t[flag] = True
        variant = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(doc)))
        variant.chat_template = tok.chat_template
        whole = render(variant, conversation, None)
        assert CallStore(variant).fresh(conversation, None).prompt_ids.tolist() == \
            variant(whole, add_special_tokens=False)["input_ids"], flag


def test_special_token_boundaries_split_encoding(tok):
    """What incremental drift relies on: encoding splits at <|im_end|>."""
    store = CallStore(tok)
    for a, b in [("x<|im_end|>", "\nfoo"), ("a\n\n<|im_end|>", "\n\n<|im_start|>user\n  b"), ("é<|im_end|>", "\u0301x")]:
        assert store.encode(a + b).tolist() == store.encode(a).tolist() + store.encode(b).tolist()
        assert store.encode(a + b).tolist() == encode(tok, a + b)


def test_bpe_join_at_a_turn_boundary_is_not_drift(tok):
    """A completion starting with a newline: the template's "assistant\n" + "\n" re-tokenises
    as one "\n\n" id, which holds sampled text: not drift, in the incremental and the full
    count alike (`count_drift`'s `joins`); the reused ids stay the recorded ones."""
    store = CallStore(tok)
    _, c0, _ = serve(store, tok, [SYSTEM, TASK], TOOLS, "\nHello", "e:0", 0)
    m = store.match([SYSTEM, TASK, {"role": "assistant", "content": "\nHello"}, {"role": "user", "content": "more"}],
                    TOOLS)
    assert m.extended and m.drift == 0 == store.full_drift(m)
    assert m.prompt_ids[:c0.full_len].tolist() == c0.full_ids().tolist()
    fresh = encode(tok, render(tok, [SYSTEM, TASK, {"role": "assistant", "content": "\nHello"},
                                     {"role": "user", "content": "more"}], TOOLS, True))
    assert fresh != m.prompt_ids.tolist()  # a retokenising pipeline would have trained other ids


@pytest.mark.parametrize("answer_text", ["Done.", CALL_TEXT])
def test_corrupted_recorded_ids_show_drift(tok, answer_text):
    """A call whose prompt held a template id that does not re-render (here: planted in
    the ids sent to the engine): the next extensions reuse it and report it as drift.
    An answer opening with an added token (a tool call) takes the turn-drift shortcut
    (only the turn's header is encoded); a plain one is encoded whole; the count is the
    same."""
    store = CallStore(tok)
    shortcut = store._turn_head(render_assistant_turn(tok, answer_of(answer_text), after_query=True)) is not None
    assert shortcut == (answer_text == CALL_TEXT)
    msgs = [SYSTEM, TASK]
    _, c0, a0 = serve(store, tok, msgs, TOOLS, CALL_TEXT, "e:0", 0)
    msgs = [*msgs, a0, {"role": "tool", "tool_call_id": a0["tool_calls"][0]["id"], "content": "a.txt"}]
    m1 = store.match(msgs, TOOLS)
    assert m1.drift == 0
    # The "assistant" id of the generation prompt (a template position, not sampled).
    header = len(m1.prompt_ids) - 2
    assert m1.prompt_ids[header] == encode(tok, "assistant")[0]
    wrong = encode(tok, "user")[0]
    m1.prompt_ids[header] = wrong
    a1 = answer_of(answer_text, "call_e1_0")
    c1 = store.record(m1, call="e:1", seq=1, answer=a1, completion_ids=encode(tok, answer_text) + [IM_END])
    assert c1.turn_drift == 1
    nxt = [*msgs, a1, {"role": "user", "content": "thanks"}]
    m2 = store.match(nxt, TOOLS)
    assert m2.parent is c1 and m2.prompt_ids[header] == wrong
    assert m2.drift == 1 == store.full_drift(m2)
    c2 = store.record(m2, call="e:2", seq=2, answer={"role": "assistant", "content": "ok"},
                      completion_ids=encode(tok, "ok") + [IM_END])
    # The drift stays in the prompt of every later call that reuses those ids.
    m3 = store.match([*nxt, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "bye"}], TOOLS)
    assert m3.parent is c2 and m3.drift == 1 == store.full_drift(m3)
    # Once the store's whole-ids cache is gone (an older call extended again), the
    # recorded ids are read from the call chain: the same prompt, the same drift.
    store._tips.clear()
    m3b = store.match([*nxt, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "bye"}], TOOLS)
    assert m3b.prompt_ids.tolist() == m3.prompt_ids.tolist() and m3b.drift == 1


def test_normalisation_is_reused_only_while_it_is_still_valid(tok):
    """A tool call whose id the store did not know normalises with the harness's
    arguments; once the id is known (restored payload), it is normalised again."""
    store = CallStore(tok)
    resent = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": "bash", "arguments": '{"command":"ls"}'}}]}
    msgs = [SYSTEM, TASK, resent, {"role": "tool", "tool_call_id": "call_x", "content": "a"}]
    m1 = store.match(json.loads(json.dumps(msgs)), TOOLS)
    assert m1.messages[2]["tool_calls"][0]["function"]["arguments"] == '{"command":"ls"}'
    store.tool_args["call_x"] = '{"command": "ls"}'
    m2 = store.match(json.loads(json.dumps(msgs)), TOOLS)
    assert m2.messages[2]["tool_calls"][0]["function"]["arguments"] == '{"command": "ls"}'
    assert m2.digest == m1.digest  # the same message for matching either way
    # An interleaved second conversation (a sub-agent) does not evict the main one's work.
    store.match([SYSTEM, {"role": "user", "content": "sub task"}], TOOLS)
    m3 = store.match(json.loads(json.dumps(msgs)), TOOLS)
    assert m3.digest == m1.digest and [*m3.messages] == [*m2.messages]


def test_the_bundled_tokenizer_renders_incrementally(tok):
    assert uses_gyre_template(tok) and CallStore(tok).incremental
    assert not CallStore(tok, render=render).incremental


def test_equal_prefix_len():
    nan = float("nan")
    a = [{"role": "user", "content": "x"}, {"k": [nan]}, {"role": "tool", "content": "y"}, 4]
    b = [{"role": "user", "content": "x"}, {"k": a[1]["k"]}, {"role": "tool", "content": "z"}, 4]
    assert equal_prefix_len(a, b, 4) == 2  # the same nan object compares equal; "y" != "z"
    assert equal_prefix_len(a, b, 2) == 2 and equal_prefix_len(a, a, 4) == 4 and equal_prefix_len(a, b, 0) == 0
    assert equal_prefix_len([1, 2, 3], [0, 2, 3], 3) == 0
    assert equal_prefix_len([1, 2, 3], [1, 2, 4], 3) == 2 and equal_prefix_len((1, 2), [1, 2], 2) == 2
    assert equal_prefix_len([1], [1], 3) == 1


_PIECES = ["<|im_end|>", "\n", "\n\n", " ", "ls", "café", "cafe\u0301", "\u0338", ">", "<", "<think", "<tool_call",
           "|>", "<|im_", "assistant", "\r\n", "\u00a0"]
_PLANTED = [198, 271, 151644, IM_END, 151667, 151657, 872, 77091, 0]


@st.composite
def _turn_case(draw, store):
    """A rendered turn (the body built from added tokens and awkward text), stored ids that
    are its encoding, a perturbed copy or random ids, with or without the closing
    <|im_end|>, and a sampled mask starting anywhere."""
    body = "".join(draw(st.lists(st.sampled_from([*store._splitting, *_PIECES]), max_size=8)))
    text = TURN_HEADER + body + "<|im_end|>"
    ids = store.encode(text).tolist()
    mode = draw(st.sampled_from(["encoding", "perturbed", "random"]))
    if mode == "perturbed":
        for _ in range(draw(st.integers(0, 3))):
            ids[draw(st.integers(0, len(ids) - 1))] = draw(st.sampled_from(_PLANTED))
        if draw(st.booleans()):
            del ids[draw(st.integers(0, len(ids) - 1))]
    elif mode == "random":
        ids = draw(st.lists(st.sampled_from(_PLANTED), max_size=12))
    if draw(st.booleans()) and (not ids or ids[-1] != IM_END):
        ids.append(IM_END)
    ids = ids or [IM_END]
    n = draw(st.integers(0, len(ids)))
    sampled = [False] * n + [draw(st.booleans()) for _ in range(len(ids) - n)]
    return text, np.asarray(ids, np.int32), np.asarray(sampled, bool)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_turn_drift_shortcut_equals_the_full_count(tok, data):
    """`_turn_drift` (which encodes only the turn's header when the body opens with an
    added token) counts what `count_drift` counts against the whole turn's encoding."""
    store = CallStore(tok)
    text, ids, sampled = data.draw(_turn_case(store))
    event("shortcut" if store._turn_head(text) is not None else "full encoding")
    assert store._turn_drift(ids, sampled, text) == count_drift(ids, sampled, store.encode(text), store._joins)


def test_tool_arguments_nested_deeper_than_orjson_writes_are_compared_as_text(tok):
    """A history whose tool-call arguments nest past orjson's 255 writable levels (valid
    JSON: orjson reads 1,024) keys that message by the arguments' text, so the request
    attaches and the next one extends it (it was a 400)."""
    deep = "[" * 300 + "]" * 300
    echoed = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "old_1", "type": "function", "function": {"name": "bash", "arguments": deep}}]}
    turn1 = [SYSTEM, TASK, echoed, {"role": "tool", "tool_call_id": "old_1", "content": "ok"}]
    store = CallStore(tok)
    m1, c1, answer1 = serve(store, tok, turn1, TOOLS, "done", "e:0", 0)
    assert m1.prompt_ids.tolist() == encode(tok, render(tok, turn1, TOOLS, True))
    m2 = store.match([*turn1, answer1, {"role": "user", "content": "next"}], TOOLS)
    assert m2.extended and m2.parent is c1 and m2.drift == 0
