"""Seeded synthetic executions shaped like Claude Code runs, as `call.completed` event lists.

Used by `gyre bench trajectories` (BENCHMARKS.md) and by tests that need realistic trees.

Shape of one execution (all lengths in tokens, drawn log-uniformly in their range):
- a *main line*: the root call's prompt is a system prompt (`system_tokens`) plus a task
  message; every later call's prompt is one tool result (`tool_result_tokens`); every
  completion is `completion_tokens` long and ends with `<|im_end|>`;
- `compactions` (uniform 0–3): after a main call, a summary call (role `main-summary`)
  sends the segment's conversation again with a compaction instruction and answers with a
  summary; the main line then restarts: its next call carries the summary as a new user
  message after the system prompt;
- `sub_agents` (uniform 0–6) of `sub_agent_calls` (uniform 5–40) calls each (role
  `sub-agent`), spawned after a main call (their calls come before the next main call);
- the main line grows until the execution holds `target_tokens` distinct ids (sum of all
  calls' new prompt + completion ids), within one tool result. Sub-agents take at most
  `sub_agent_share` of the target (their lengths are scaled down, never below the ranges'
  minimum, so a small target with many sub-agents can overshoot).

parent_call / prefix_len follow the proxy's matching rules (gyre.serving.tito): a call extending
its predecessor in the same agent line has parent = predecessor, prefix_len = its full
length (the proxy's *extension*); a call that starts a new conversation is a *branch* at
the longest common token prefix with an earlier call:
- a summary call is a branch, not an extension: its compaction instruction is a new real
  user query, so the chat template (Qwen3's, and gyre's) re-renders every earlier assistant
  turn of the segment without its `<think>…</think>`; the proxy then records it at the
  longest common prefix — the segment's first prompt (parent = the segment's first call,
  prefix_len = that call's prompt end) — and its prompt is the segment again, completions
  without their reasoning, plus the instruction (tests/test_tito.py
  `test_dropped_thinking_opens_a_branch` shows the proxy doing this);
- a compaction restart shares the main system prompt plus `<|im_start|>user\\n` with the
  main root (parent = main root, prefix_len = system + 3);
- the first sub-agent shares `<|im_start|>system\\n` with the main root (prefix_len = 3);
  later sub-agents share the sub-agent system prompt plus `<|im_start|>user\\n` with the
  first sub-agent's root.
So the leaves are: the last main call of every segment, each summary call, each
sub-agent's last call (1 + 2 · compactions + sub_agents). The re-sent segments count in the
execution's distinct ids (they are new tree nodes), so the main line is shorter when there
are compactions.

Token ids are random BPE ids between chat-template special tokens; log-probs are random
(≤ 0); all completions carry policy version `version`. Deterministic in `seed`.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from gyre.serving.tokenizer import (IM_END, IM_START, NUM_BPE_RANKS, THINK, THINK_END, TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE,
                            TOOL_RESPONSE_END)
from schemas import ids as event_ids
from schemas.call import CallCompleted, CallTokens, SamplingParams

_NL, _SYSTEM, _USER, _ASSISTANT = 198, 8948, 872, 77091  # "\n", "system", "user", "assistant"
_SYSTEM_HEAD = (IM_START, _SYSTEM, _NL)
_SYSTEM_TAIL = (IM_END, _NL)
_USER_HEAD = (IM_START, _USER, _NL)
_TURN_TAIL = (IM_END, _NL, IM_START, _ASSISTANT, _NL)  # closes the message, opens the answer
_TOOL_HEAD = (_NL, IM_START, _USER, _NL, TOOL_RESPONSE)  # after a completion that ended with <|im_end|>
_TOOL_TAIL = (TOOL_RESPONSE_END,) + _TURN_TAIL


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SynthSpec:
    """Sizes of one synthetic execution; (lo, hi) ranges are inclusive, in tokens or counts.

    target_tokens: distinct ids per execution to aim for (prompt + completion, all calls).
    completion_tokens / tool_result_tokens / system_tokens / task_tokens: log-uniform ranges.
    compactions / sub_agents / sub_agent_calls: uniform integer ranges.
    summary_instruction_tokens: prompt of a summary call (the compaction instruction).
    sub_agent_share: at most this fraction of target_tokens goes to sub-agents, in (0, 1).
    version: policy version of every completion. temperature: sampling temperature recorded.
    """

    target_tokens: int = 50_000
    completion_tokens: tuple[int, int] = (50, 2000)
    tool_result_tokens: tuple[int, int] = (100, 5000)
    system_tokens: tuple[int, int] = (2000, 8000)
    task_tokens: tuple[int, int] = (100, 1000)
    summary_instruction_tokens: tuple[int, int] = (100, 300)
    compactions: tuple[int, int] = (0, 3)
    sub_agents: tuple[int, int] = (0, 6)
    sub_agent_calls: tuple[int, int] = (5, 40)
    sub_agent_share: float = 0.5
    version: int = 0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.target_tokens < 1:
            raise ValueError(f"SynthSpec.target_tokens must be >= 1, got {self.target_tokens}")
        for name in ("completion_tokens", "tool_result_tokens", "system_tokens", "task_tokens",
                     "summary_instruction_tokens", "sub_agent_calls"):
            lo, hi = getattr(self, name)
            if not 16 <= lo <= hi and name != "sub_agent_calls":
                raise ValueError(f"SynthSpec.{name} must satisfy 16 <= lo <= hi, got {(lo, hi)}")
            if name == "sub_agent_calls" and not 1 <= lo <= hi:
                raise ValueError(f"SynthSpec.sub_agent_calls must satisfy 1 <= lo <= hi, got {(lo, hi)}")
        for name in ("compactions", "sub_agents"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"SynthSpec.{name} must satisfy 0 <= lo <= hi, got {(lo, hi)}")
        if not 0.0 < self.sub_agent_share < 1.0:
            raise ValueError(f"SynthSpec.sub_agent_share must be in (0, 1), got {self.sub_agent_share}")
        if self.version < 0 or not self.temperature > 0:
            raise ValueError("SynthSpec.version must be >= 0 and temperature > 0")


@dataclasses.dataclass(frozen=True, slots=True)
class SynthShape:
    """What was drawn for one execution (for reports and tests)."""

    main_calls: int
    compactions: int
    sub_agent_calls: tuple[int, ...]
    tokens: int


class _Writer:
    """Emits calls in seq order and tracks each call's full length."""

    def __init__(self, run: str, execution: str, spec: SynthSpec, rng: np.random.Generator) -> None:
        self.run, self.execution, self.spec, self.rng = run, execution, spec, rng
        self.calls: list[CallCompleted] = []
        self.full: list[int] = []
        self.parts: list[tuple[np.ndarray, np.ndarray]] = []  # (prompt, completion) per seq
        self.tokens = 0

    def chunk(self, head: tuple[int, ...], n: int, tail: tuple[int, ...]) -> np.ndarray:
        """Exactly n ids (n > len(head) + len(tail)): head, random BPE ids, tail."""
        body = self.rng.integers(0, NUM_BPE_RANKS, n - len(head) - len(tail), dtype=np.int64)
        return np.concatenate([np.asarray(head, np.int64), body, np.asarray(tail, np.int64)])

    def completion(self, n: int) -> np.ndarray:
        """n sampled ids: <think> … </think> text <tool_call> … </tool_call> <|im_end|>."""
        out = self.rng.integers(0, NUM_BPE_RANKS, n, dtype=np.int64)
        if n >= 8:
            out[0], out[n // 3] = THINK, THINK_END
            out[n - 1 - n // 4], out[n - 2] = TOOL_CALL, TOOL_CALL_END
        out[-1] = IM_END
        return out

    def emit(self, parent: int | None, prefix_len: int, prompt: np.ndarray, n_completion: int, role: str) -> int:
        """Append one call; returns its seq."""
        seq = len(self.calls)
        completion = self.completion(n_completion)
        logprobs = -self.rng.exponential(0.7, n_completion)
        self.calls.append(CallCompleted(
            event_id=event_ids.call(self.run, self.execution, seq), call=f"{self.execution}:{seq}",
            execution=self.execution, seq=seq,
            parent_call=None if parent is None else f"{self.execution}:{parent}", prefix_len=prefix_len,
            tokens=CallTokens(prompt_ids=tuple(prompt.tolist()), completion_ids=tuple(completion.tolist()),
                              logprobs=tuple(logprobs.tolist())),
            sampling=SamplingParams(temperature=self.spec.temperature, max_tokens=self.spec.completion_tokens[1]),
            finish_reason="stop", versions=((0, n_completion, self.spec.version),), cell="cell0", role=role,
            api="messages", timings={"queue_s": 0.0, "engine_s": 0.0, "total_s": 0.0},
        ))
        self.full.append(prefix_len + prompt.shape[0] + n_completion)
        self.parts.append((prompt, completion))
        self.tokens += prompt.shape[0] + n_completion
        return seq

    def resent(self, segment: list[int]) -> np.ndarray:
        """A segment's conversation after its first prompt as the template renders it once a
        new user query follows: every completion without its reasoning (ids up to and
        including `</think>`), every later prompt unchanged."""
        out = []
        for k, seq in enumerate(segment):
            prompt, completion = self.parts[seq]
            if k:
                out.append(prompt)
            out.append(completion[_visible_from(completion.shape[0]):])
        return np.concatenate(out)


def _visible_from(n: int) -> int:
    """Index of the first id after `</think>` in an n-id synthetic completion (0: no reasoning)."""
    return n // 3 + 1 if n >= 8 else 0


def _resent_len(turns: list[tuple[int, int]]) -> int:
    """Length of `_Writer.resent` for a segment of (prompt, completion) turns."""
    return sum((r if k else 0) + c - _visible_from(c) for k, (r, c) in enumerate(turns))


def _loguniform(rng: np.random.Generator, lo_hi: tuple[int, int], size=None):
    lo, hi = lo_hi
    return np.exp(rng.uniform(np.log(lo), np.log(hi + 1), size)).astype(np.int64).clip(lo, hi)


def synth_execution(execution: str, spec: SynthSpec = SynthSpec(), seed: int = 0, *,
                    run: str = "synth") -> tuple[list[CallCompleted], SynthShape]:
    """One synthetic execution: its `call.completed` events in seq order, and what was drawn.

    Event ids are `schemas.ids.call(run, execution, seq)`, call ids `<execution>:<seq>`.
    Same (execution, spec, seed, run) → identical events (up to `emitted_at`).
    """
    rng = np.random.default_rng(seed)
    w = _Writer(run, execution, spec, rng)
    r_lo, r_hi = spec.tool_result_tokens
    c_lo, c_hi = spec.completion_tokens
    n_compact = int(rng.integers(spec.compactions[0], spec.compactions[1] + 1))
    n_sub = int(rng.integers(spec.sub_agents[0], spec.sub_agents[1] + 1))
    sub_calls = rng.integers(spec.sub_agent_calls[0], spec.sub_agent_calls[1] + 1, n_sub)
    sys_main = int(_loguniform(rng, spec.system_tokens))
    sys_sub = max(int(_loguniform(rng, spec.system_tokens)) // 2, 16)
    task = int(_loguniform(rng, spec.task_tokens))

    # Sub-agent turns (tool result, completion) per sub-agent, scaled down to their share.
    subs = [(_loguniform(rng, spec.tool_result_tokens, n), _loguniform(rng, spec.completion_tokens, n)) for n in sub_calls]

    def sub_size() -> int:
        return sum(int(a[1:].sum() + b.sum()) for a, b in subs) + n_sub * task + (sys_sub if n_sub else 0)

    cap = spec.sub_agent_share * spec.target_tokens
    if sub_size() > cap:
        f = cap / sub_size()
        subs = [(np.maximum((a * f).astype(np.int64), r_lo), np.maximum((b * f).astype(np.int64), c_lo)) for a, b in subs]

    # Compactions: instruction + summary, then the restarted line re-reads the summary.
    summaries = [(int(_loguniform(rng, spec.summary_instruction_tokens)), int(_loguniform(rng, spec.completion_tokens)))
                 for _ in range(n_compact)]
    restart_extra = 40  # "This session is being continued…" around the summary

    # Main-line turns (tool result, completion) until the target is reached, ≥ 2 per segment.
    def fill(turns: list[tuple[int, int]], budget: int, min_turns: int) -> None:
        while True:
            r, c = int(_loguniform(rng, spec.tool_result_tokens)), int(_loguniform(rng, spec.completion_tokens))
            if not turns:
                r = 0  # the root's prompt is the system prompt and the task
            if budget - (r + c) < r_lo + c_lo and len(turns) + 1 >= min_turns:
                rest = max(budget, r_lo + c_lo)  # the last turn takes what is left
                c = int(np.clip(max(min(c, rest // 3), rest - r_hi), c_lo, c_hi))
                r = int(np.clip(rest - c, r_lo, r_hi)) if turns else 0
                turns.append((r, c))
                return
            turns.append((r, c))
            budget -= r + c

    budget = spec.target_tokens - sub_size() - sys_main - task - sum(i + s for i, s in summaries)
    turns: list[tuple[int, int]] = []
    # Each compacted segment is sent again (shorter by its reasoning): draw the main line as if
    # it were sent twice, then give what is left to the last segment, which is never re-sent.
    fill(turns, budget * (n_compact + 1) // (2 * n_compact + 1), n_compact + 2)
    n_main = len(turns)
    compact_after = sorted({max(0, round(n_main * (k + 1) / (n_compact + 1)) - 1) for k in range(n_compact)})
    compact_after = [t for t in compact_after if t < n_main - 1]
    for k, t in enumerate(compact_after):
        turns[t + 1] = (summaries[k][1] + restart_extra, turns[t + 1][1])  # the restart re-reads the summary
    starts = [0] + [t + 1 for t in compact_after]
    resent = sum(_resent_len(turns[a:t + 1]) for a, t in zip(starts, compact_after))
    deficit = budget - resent - sum(r + c for r, c in turns)
    if deficit >= r_lo + c_lo:
        fill(turns, deficit, 0)
    elif deficit < 0 and len(turns) - 1 not in [t + 1 for t in compact_after] and len(turns) > 1:
        r, c = turns[-1]
        turns[-1] = (int(np.clip(r + deficit, r_lo, r_hi)), c)
    n_main = len(turns)
    spawn_after = sorted(int(t) for t in rng.integers(0, n_main, n_sub))

    # Emit in time order.
    root_prompt = np.concatenate([w.chunk(_SYSTEM_HEAD, sys_main, _SYSTEM_TAIL), w.chunk(_USER_HEAD, task, _TURN_TAIL)])
    root = prev = w.emit(None, 0, root_prompt, turns[0][1], "main")
    first_sub: int | None = None
    restart_len = None
    segment = [root]  # the main calls since the last (re)start
    n_summaries = 0
    sub_index = 0
    for t in range(n_main):
        r, c = turns[t]
        if t == 0:
            pass
        elif restart_len is not None:
            # Branch: the restarted conversation shares system prompt + <|im_start|>user\n with the root.
            prev = w.emit(root, sys_main + len(_USER_HEAD), w.chunk((), restart_len, _TURN_TAIL), c, "main")
            segment = [prev]
            restart_len = None
        else:
            prev = w.emit(prev, w.full[prev], w.chunk(_TOOL_HEAD, r, _TOOL_TAIL), c, "main")
            segment.append(prev)
        while spawn_after and spawn_after[0] == t:
            spawn_after.pop(0)
            results, completions = subs[sub_index]
            sub_index += 1
            if first_sub is None:
                # Branch: shares only <|im_start|>system\n with the main root.
                prompt = np.concatenate([w.chunk((), sys_sub - len(_SYSTEM_HEAD), _SYSTEM_TAIL),
                                         w.chunk(_USER_HEAD, task, _TURN_TAIL)])
                sub_prev = first_sub = w.emit(root, len(_SYSTEM_HEAD), prompt, int(completions[0]), "sub-agent")
            else:
                # Branch: same sub-agent system prompt (+ <|im_start|>user\n) as the first sub-agent.
                sub_prev = w.emit(first_sub, sys_sub + len(_USER_HEAD), w.chunk((), task - len(_USER_HEAD), _TURN_TAIL),
                                  int(completions[0]), "sub-agent")
            for k in range(1, completions.shape[0]):
                sub_prev = w.emit(sub_prev, w.full[sub_prev], w.chunk(_TOOL_HEAD, int(results[k]), _TOOL_TAIL),
                                  int(completions[k]), "sub-agent")
        if compact_after and compact_after[0] == t:
            compact_after.pop(0)
            instruction, summary = summaries[n_summaries]
            n_summaries += 1
            first = segment[0]
            prompt = np.concatenate([w.resent(segment), w.chunk(_TOOL_HEAD[:4], instruction, _TURN_TAIL)])
            w.emit(first, w.full[first] - w.parts[first][1].shape[0], prompt, summary, "main-summary")
            restart_len = turns[t + 1][0]
    shape = SynthShape(main_calls=sum(1 for call in w.calls if call.role == "main"), compactions=n_summaries,
                       sub_agent_calls=tuple(int(n) for n in sub_calls), tokens=w.tokens)
    return w.calls, shape


def synth_executions(n: int, spec: SynthSpec = SynthSpec(), seed: int = 0, *, run: str = "synth",
                     prefix: str = "x") -> list[tuple[list[CallCompleted], SynthShape]]:
    """n executions `<prefix><i>` of `spec`, execution i seeded by (seed, i)."""
    return [synth_execution(f"{prefix}{i}", spec, int(np.random.SeedSequence([seed, i]).generate_state(1)[0]), run=run)
            for i in range(n)]
