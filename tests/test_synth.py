"""Synthetic Claude-Code-shaped executions (gyre.trajectory.synth): shape, sizes, proxy-like structure."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import schemas
from gyre.trajectory.microstep import common_prefix
from gyre.trajectory.synth import SynthSpec, synth_execution, synth_executions
from gyre.serving.tokenizer import IM_END, IM_START, THINK, THINK_END
from gyre.trajectory.tree import build_tree, trajectories


def _fulls(calls):
    """Full sequence of every call, rebuilt the way CallTree does (parent[:prefix] + prompt + completion)."""
    full = {}
    for c in calls:
        head = full[c.parent_call][:c.prefix_len] if c.parent_call else []
        full[c.call] = head + list(c.tokens.prompt_ids) + list(c.tokens.completion_ids)
    return full


@pytest.mark.parametrize("seed", range(6))
def test_shape_and_proxy_structure(seed):
    spec = SynthSpec(target_tokens=50_000)
    calls, shape = synth_execution("e0", spec, seed, run="r1")
    by_id = {c.call: c for c in calls}
    full = _fulls(calls)
    assert [c.seq for c in calls] == list(range(len(calls)))
    assert calls[0].parent_call is None and calls[0].role == "main"
    assert spec.compactions[0] <= shape.compactions <= spec.compactions[1]
    assert len(shape.sub_agent_calls) <= 6 and all(5 <= n <= 40 for n in shape.sub_agent_calls)
    roles = [c.role for c in calls]
    assert roles.count("main-summary") == shape.compactions
    assert roles.count("sub-agent") == sum(shape.sub_agent_calls)
    assert roles.count("main") == shape.main_calls
    assert sum(len(c.tokens.prompt_ids) + len(c.tokens.completion_ids) for c in calls) == shape.tokens
    assert abs(shape.tokens - 50_000) <= 0.1 * 50_000
    for c in calls:
        assert c.event_id == schemas.ids.call("r1", "e0", c.seq)
        assert schemas.decode("call.completed", schemas.encode(c)) == c  # a valid wire event
        n = len(c.tokens.completion_ids)
        assert 50 <= n <= 2000 and c.tokens.completion_ids[-1] == IM_END
        assert c.versions == ((0, n, 0),)
        if c.parent_call is None:
            continue
        parent = by_id[c.parent_call]
        assert parent.seq < c.seq
        plen = len(full[parent.call])
        if c.role == "main-summary":
            # A new user query: the template drops the segment's reasoning, so the summary call
            # branches where the parent's completion began with <think> and re-sends the segment.
            completion = parent.tokens.completion_ids
            assert parent.role == "main" and c.prefix_len == plen - len(completion)
            assert completion[0] == THINK and THINK not in c.tokens.prompt_ids
            visible = completion[completion.index(THINK_END) + 1:]
            assert c.tokens.prompt_ids[:len(visible)] == visible
        elif c.prefix_len == plen:
            # Extension: the next turn of the same line (a tool result).
            assert c.role == parent.role
            assert c.tokens.prompt_ids[1] == IM_START
            assert 100 <= len(c.tokens.prompt_ids) <= 5000
        else:
            # Branch at the longest common prefix: the next ids differ from the parent's.
            assert 3 <= c.prefix_len < plen
            assert full[c.call][:c.prefix_len] == full[parent.call][:c.prefix_len]
            assert full[c.call][c.prefix_len] != full[parent.call][c.prefix_len]
    tree = build_tree("e0", calls)
    assert not tree.invalid and tree.pending == 0 and tree.n_tokens == shape.tokens
    leaves = tree.leaves()
    assert len(leaves) == 1 + 2 * shape.compactions + len(shape.sub_agent_calls)
    assert [tree.role(leaf) for leaf in leaves].count("main") == 1 + shape.compactions  # one per segment
    for leaf in leaves:
        assert tree.full_ids(leaf).tolist() == full[leaf]


def test_deterministic_and_sizes():
    a = synth_executions(3, SynthSpec(target_tokens=200_000), seed=7)
    b = synth_executions(3, SynthSpec(target_tokens=200_000), seed=7)
    for (ca, sa), (cb, sb) in zip(a, b):
        assert sa == sb
        assert [(c.call, c.parent_call, c.prefix_len, c.role, c.tokens) for c in ca] == \
               [(c.call, c.parent_call, c.prefix_len, c.role, c.tokens) for c in cb]
        assert abs(sa.tokens - 200_000) <= 0.05 * 200_000
    c = synth_executions(3, SynthSpec(target_tokens=200_000), seed=8)
    assert [s for _, s in c] != [s for _, s in a]


def test_j_max_keeps_main_lines_before_sub_agents():
    calls, shape = synth_execution("e0", SynthSpec(target_tokens=50_000), 3)
    kept = trajectories(build_tree("e0", calls), j_max=None)
    roles = [t.role for t in kept]
    assert roles[0] == "main" and roles.count("main-summary") == shape.compactions
    assert roles.count("sub-agent") == len(shape.sub_agent_calls)


def test_spec_validation():
    with pytest.raises(ValueError, match="target_tokens"):
        SynthSpec(target_tokens=0)
    with pytest.raises(ValueError, match="sub_agent_share"):
        SynthSpec(sub_agent_share=1.5)
    with pytest.raises(ValueError, match="compactions"):
        SynthSpec(compactions=(2, 1))


def test_bench_trajectories_smoke(tmp_path):
    """`gyre bench trajectories` end to end on tiny sizes (CI exercises the code path).

    Run as a subprocess: the command configures process-wide logging."""
    import json

    from gyre.serving.model import ModelSpec, init_model
    from handlers.bench.trajectories import expand_all

    model = init_model(tmp_path / "model", ModelSpec(layers=1, hidden=16, heads=2, kv_heads=1, head_dim=8,
                                                     intermediate=32))  # the real vocabulary, a tiny body
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "handlers.cli", "bench", "trajectories", "--sizes", "1000,1500",
                           "--executions", "2", "--reps", "1", "--fwd-bwd-executions", "1", "--model", str(model),
                           "--json", str(out)], cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fwd_bwd_saving_jmax5" in done.stdout and "builder_tokens_per_s" in done.stdout
    doc = json.loads(out.read_text())
    for key in ("trained_tokens", "trained_tokens_by_size", "fwd_bwd_s", "fwd_bwd_s_min", "fwd_bwd_s_max",
                "fwd_bwd_s_by_size", "fwd_bwd_saving_jmax5", "token_saving_jmax5", "builder_tokens_per_s",
                "builder_tokens_per_s_min", "builder_tokens_per_s_max", "builder_tokens_per_s_by_size", "machine"):
        assert key in doc, key
    assert set(doc["trained_tokens"]) == {"jmax1", "jmax5", "uncapped"}
    for sizes in doc["trained_tokens_by_size"].values():
        assert sizes["jmax1"] <= sizes["jmax5"] <= sizes["uncapped"]
    assert doc["builder_tokens_per_s"] > 0 and set(doc["machine"]) >= {"cores", "python", "torch"}
    assert "forward-backward ran on 1 of the 2" in doc["notes"][0]

    # The uncapped expansion repeats shared prefixes: never fewer trained tokens than J = None.
    calls, _ = synth_execution("e0", SynthSpec(target_tokens=50_000), 0)
    tree = build_tree("e0", calls)
    expanded = expand_all(tree)
    assert len(expanded) == len(tree.leaves())
    assert sum(t.n_trained for t in expanded) >= sum(t.n_trained for t in trajectories(tree, j_max=None))


@pytest.mark.parametrize("seed", [0, 2])
def test_branch_points_are_the_longest_common_prefix_and_summaries_resend_their_segment(seed):
    """What the proxy would record: every call attaches at its longest common token prefix
    with any earlier call, and a summary call re-sends exactly its segment — the segment's
    completions without reasoning and its later prompts — then the instruction."""
    calls, shape = synth_execution("e0", SynthSpec(target_tokens=50_000), seed)
    assert shape.compactions >= 1
    full = {k: np.asarray(v) for k, v in _fulls(calls).items()}
    for i, c in enumerate(calls):
        if c.parent_call is not None:
            assert c.prefix_len == max(common_prefix(full[c.call], full[p.call]) for p in calls[:i]), c.call
    by_id = {c.call: c for c in calls}

    def visible(completion):
        return list(completion[completion.index(THINK_END) + 1:])

    for s in (c for c in calls if c.role == "main-summary"):
        segment = [by_id[s.parent_call]]
        for c in calls[segment[0].seq + 1:s.seq]:
            if c.role == "main" and c.parent_call == segment[-1].call:
                segment.append(c)
        # The segment runs from the line's (re)start — the root or a restart, itself a branch —
        # to the main call the compaction followed.
        first = segment[0]
        assert first.parent_call is None or first.prefix_len < len(full[first.parent_call])
        assert segment[-1] is [c for c in calls[:s.seq] if c.role == "main"][-1]
        expected = visible(segment[0].tokens.completion_ids)
        for c in segment[1:]:
            expected += list(c.tokens.prompt_ids) + visible(c.tokens.completion_ids)
        prompt = list(s.tokens.prompt_ids)
        assert prompt[:len(expected)] == expected
        assert 100 <= len(prompt) - len(expected) <= 300  # the compaction instruction
