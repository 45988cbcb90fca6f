"""Roles of calls per harness profile (gyre.serving.roles), from the request facts HARNESSES.md records."""
from __future__ import annotations

import dataclasses

import json

import pytest

from gyre.serving.roles import CallFacts, classify, detect_profile, profile_for_harness

CC = {"x-claude-code-session-id": "s1", "anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"}
CODEX = {"session-id": "th-1", "thread-id": "th-1", "x-codex-turn-metadata": json.dumps({"request_kind": "turn",
                                                                                         "turn_id": "t1"})}
SYSTEM = {"role": "system", "content": "prompt"}


def facts(headers, *messages, api="messages", model="claude-sonnet-4", tools=3, json_output=False, body_meta=None):
    return CallFacts(api=api, headers=headers, model=model, messages=[SYSTEM, *messages], tools=tools,
                     json_output=json_output, body_meta=body_meta or {})


def user(text):
    return {"role": "user", "content": text}


def test_detect_profile_from_headers():
    assert detect_profile(CC, "messages") == "claude-code"
    assert detect_profile({"anthropic-version": "2023-06-01", "anthropic-beta": "x-1, claude-code-20250219"},
                          "messages") == "claude-code"
    assert detect_profile({"anthropic-version": "2023-06-01", "anthropic-beta": "x-1"}, "messages") == "generic"
    assert detect_profile(CODEX, "responses") == "codex"
    assert detect_profile({"session-id": "a", "originator": "codex_exec"}, "responses") == "codex"
    assert detect_profile({"x-stainless-lang": "python", "x-stainless-retry-count": "0"}, "chat") == "mini-swe-agent"
    assert detect_profile({"x-stainless-lang": "python"}, "responses") == "generic"
    assert detect_profile({}, "chat") == "generic"


def test_profile_for_harness_names():
    assert profile_for_harness("claude-code") == "claude-code"
    assert profile_for_harness("codex") == "codex"
    assert profile_for_harness("mini-swe-agent-text") == "mini-swe-agent"
    assert profile_for_harness("toy") == "generic"
    assert profile_for_harness("") is None and profile_for_harness(None) is None


def test_claude_code_main_sub_agent_and_summaries():
    main = classify(facts(CC, user("fix it")))
    assert (main.role, main.harness, main.meta) == ("main", "claude-code", {"harness": "claude-code",
                                                                            "session_id": "s1"})
    sub_headers = {**CC, "x-claude-code-agent-id": "a-1"}
    sub = classify(facts(sub_headers, user("delegated task")))
    assert sub.role == "sub-agent" and sub.meta["agent_id"] == "a-1"
    compact = user("fix it\n\nYour task is to create a detailed summary of the conversation so far, paying ...")
    request = classify(facts(CC, user("fix it"), {"role": "assistant", "content": "done"}, compact))
    assert request.role == "main-summary" and request.meta["request_kind"] == "compaction"
    after = classify(facts(CC, user("This session is being continued from a previous conversation that ran out "
                                    "of context.\n\nSummary:\n1. ..."), {"role": "assistant", "content": "ok"},
                           {"role": "tool", "tool_call_id": "t", "content": "x"}))
    assert after.role == "main-summary" and "request_kind" not in after.meta
    assert classify(facts(sub_headers, user("task"), compact)).role == "sub-agent-summary"
    # An earlier user message quoting the instruction is not a compaction request.
    assert classify(facts(CC, compact, {"role": "assistant", "content": "x"}, user("next"))).role == "main"


def test_auxiliary_calls():
    title = classify(facts(CC, user("fix it"), tools=0, json_output=True))
    assert title.role == "auxiliary" and title.meta["request_kind"] == "title"
    # JSON output with tools is a main call (a harness may constrain a tool-using agent).
    assert classify(facts(CC, user("fix it"), tools=2, json_output=True)).role == "main"
    assert classify(facts(CC, user("quota"), model="claude-haiku-4-5-20251001", tools=0)).role == "auxiliary"
    # The main agent run on haiku (`--model haiku`) sends its tools: main, trained
    assert classify(facts(CC, user("fix it"), model="claude-haiku-4-5-20251001")).role == "main"
    assert classify(facts(CC, user("fix it"), {"role": "assistant", "content": "x"}, user(
        "go\n\nYour task is to create a detailed summary of the conversation so far"), model="haiku")).role \
        == "main-summary"
    # Claude Code's Explore sub-agent runs on haiku: with its agent-id header it is a sub-agent
    explore = facts(CC, user("explore"), model="claude-haiku-4-5-20251001")
    explore = dataclasses.replace(explore, headers={**explore.headers, "x-claude-code-agent-id": "a7"})
    assert classify(explore).role == "sub-agent"
    counted = classify(facts(CC, user("fix it"), api="count_tokens"))
    assert counted.role == "auxiliary" and counted.meta["request_kind"] == "count_tokens"
    # Elsewhere a schema-constrained call without tools is the agent's own (structured-output
    # agents send nothing else): trained, not auxiliary.
    assert classify(facts({}, user("x"), api="chat", tools=0, json_output=True)).role == "main"
    assert classify(facts(CODEX, user("x"), api="responses", tools=0, json_output=True)).role == "main"


def test_codex_compaction_and_continuation():
    turn = classify(facts(CODEX, user("do it"), api="responses", model="gpt-5"))
    assert turn.role == "main" and turn.meta == {"harness": "codex", "session_id": "th-1", "request_kind": "turn",
                                                 "turn_id": "t1"}
    by_header = {**CODEX, "x-codex-turn-metadata": json.dumps({"request_kind": "compaction"})}
    assert classify(facts(by_header, user("do it"), api="responses", tools=0)).role == "main-summary"
    by_text = classify(facts({"session-id": "th-1", "originator": "codex_exec"}, user("do it"),
                             user("You are performing a CONTEXT CHECKPOINT COMPACTION."), api="responses", tools=0))
    assert by_text.role == "main-summary" and by_text.meta["request_kind"] == "compaction"
    after = classify(facts(CODEX, user("do it"), user("Another language model started to solve this problem and "
                                                      "produced a summary ..."), api="responses"))
    assert after.role == "main-summary"
    assert classify(facts({**CODEX, "x-openai-subagent": "review"}, user("x"), api="responses")).role == "sub-agent"


def test_configured_profile_wins_and_mini_is_always_main():
    # Configured as mini-swe-agent: Claude-looking text does not make a summary.
    f = facts({}, user("Your task is to create a detailed summary of the conversation so far"), api="chat")
    assert classify(f, "mini-swe-agent").role == "main"
    assert classify(f, "claude-code").role == "main-summary"
    assert classify(facts({}, user("x"), body_meta={"session_id": "b"}), "generic").meta == {
        "harness": "generic", "session_id": "b"}
    with pytest.raises(ValueError, match="unknown harness profile"):
        classify(f, "aider")


@pytest.mark.parametrize("headers,body_meta,key", [
    ({**CC, "x-claude-code-session-id": "s" * 5000}, {}, "session_id"),
    ({"anthropic-version": "2023-06-01"}, {"session_id": "A" * 1_000_000}, "session_id"),
    ({**CODEX, "x-codex-turn-metadata": json.dumps({"request_kind": "turn", "turn_id": "t" * 9000})}, {}, "turn_id"),
])
def test_metadata_values_are_cut_to_meta_chars(headers, body_meta, key):
    """Metadata rides on every `call.completed`, which must fit the bus (a 1 MB session id
    in an Anthropic body made an event no publish could carry)."""
    from gyre.serving.roles import META_CHARS

    c = classify(facts(headers, user("hi"), api="responses" if "session-id" in headers else "messages",
                       body_meta=body_meta))
    assert len(c.meta[key]) == META_CHARS and all(len(v) <= META_CHARS for v in c.meta.values())
