"""Call trees and kept trajectories (DESIGN.md "Trajectory processing", "Staleness")."""
from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.trajectory.tree import ROLE_PRIORITY, CallTree, build_tree, trajectories
from schemas import CallCompleted, CallTokens, SamplingParams


def mk(seq, parent, prefix_len, prompt, completion, *, lp=None, spans=None, version=0, role="main",
       status="ok", temperature=1.0, execution="e0"):
    lp = [-0.1 * (i + 1) - seq for i in range(len(completion))] if lp is None else lp
    spans = ((0, len(completion), version),) if spans is None else spans
    return CallCompleted(
        event_id=f"r:{execution}:call:{seq}", call=f"{execution}:{seq}", execution=execution, seq=seq,
        parent_call=None if parent is None else f"{execution}:{parent}", prefix_len=prefix_len,
        tokens=CallTokens(prompt_ids=tuple(prompt), completion_ids=tuple(completion), logprobs=tuple(lp)),
        sampling=SamplingParams(temperature=temperature), finish_reason="stop", versions=spans, cell="c0",
        role=role, status=status,
    )


def by_leaf(kept):
    return {t.leaf: t for t in kept}


def test_chain_gives_one_trajectory_with_policy_mask():
    a = mk(0, None, 0, [1, 2], [3, 4], lp=[-0.5, -0.25], version=0, temperature=0.7)
    b = mk(1, 0, 4, [5], [6, 7], lp=[-1.0, -2.0], version=1)
    tree = build_tree("e0", [a, b])
    assert tree.leaves() == ["e0:1"]
    (t,) = trajectories(tree)
    assert t.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert t.input_ids.dtype == np.int32
    assert t.loss_mask.tolist() == [False, False, True, True, False, True, True]
    assert t.behaviour_logprobs.tolist() == [0, 0, -0.5, -0.25, 0, -1.0, -2.0]
    assert t.behaviour_logprobs.dtype == np.float32
    assert t.versions.tolist() == [-1, -1, 0, 0, -1, 1, 1]
    assert np.allclose(t.temperatures, [1, 1, 0.7, 0.7, 1, 1, 1])
    assert t.role == "main" and t.execution == "e0" and t.n_trained == 4


def test_branch_trains_each_policy_token_once():
    # A = [1,2 | 3,4]; B extends all of A; C branches after A's prompt (a retry).
    a = mk(0, None, 0, [1, 2], [3, 4])
    b = mk(1, 0, 4, [5], [6, 7])
    c = mk(2, 0, 2, [8], [9])
    tree = build_tree("e0", [a, b, c])
    assert sorted(tree.leaves()) == ["e0:1", "e0:2"]
    kept = by_leaf(trajectories(tree, j_max=None))
    assert kept["e0:2"].input_ids.tolist() == [1, 2, 8, 9]
    assert kept["e0:1"].input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert kept["e0:1"].n_trained + kept["e0:2"].n_trained == 5  # 3,4 | 6,7 | 9


def test_shared_prefix_is_masked_in_the_later_trajectory():
    # Both children extend all of A: A's completion is trained by whichever is kept first.
    a = mk(0, None, 0, [1], [2, 3])
    b = mk(1, 0, 3, [4], [5])
    c = mk(2, 0, 3, [6], [7, 8, 9])
    kept = trajectories(build_tree("e0", [a, b, c]), j_max=None, rng=random.Random(1))
    first, second = kept
    assert first.loss_mask[1:3].all() and not second.loss_mask[1:3].any()
    assert first.n_trained + second.n_trained == 2 + 1 + 3


def test_out_of_order_and_redelivery_give_the_same_trajectories():
    calls = [
        mk(0, None, 0, [1, 2], [3, 4]),
        mk(1, 0, 4, [5], [6, 7]),
        mk(2, 0, 2, [8], [9]),
        mk(3, 1, 7, [10], [11], role="main-summary"),
        mk(4, 2, 3, [12], [13, 14], role="sub-agent"),
    ]
    ref = [(t.leaf, t.input_ids.tolist(), t.loss_mask.tolist()) for t in trajectories(build_tree("e0", calls), j_max=None)]
    for perm in itertools.permutations(calls):
        tree = CallTree("e0")
        for c in perm:
            assert tree.add(c) is True
            assert tree.add(c) is False  # redelivery: no change
        assert tree.pending == 0 and len(tree) == 5
        got = [(t.leaf, t.input_ids.tolist(), t.loss_mask.tolist()) for t in trajectories(tree, j_max=None)]
        assert got == ref


def test_child_is_held_until_its_parent_arrives():
    tree = CallTree("e0")
    tree.add(mk(2, 1, 5, [9], [10]))
    tree.add(mk(1, 0, 3, [5], [6]))
    assert tree.pending == 2 and len(tree) == 0 and trajectories(tree) == []
    tree.add(mk(0, None, 0, [1, 2], [3]))
    assert tree.pending == 0 and tree.leaves() == ["e0:2"]
    (t,) = trajectories(tree)
    assert t.input_ids.tolist() == [1, 2, 3, 5, 6, 9, 10]


def test_auxiliary_and_failed_calls_are_never_trained():
    a = mk(0, None, 0, [1], [2])
    aux = mk(1, None, 0, [50], [51], role="auxiliary")
    aborted = dataclasses.replace(mk(2, 0, 2, [3], [4]), status="aborted")
    child_of_aborted = mk(3, 2, 4, [5], [6])
    tree = build_tree("e0", [a, aux, aborted, child_of_aborted])
    # A is still a leaf: an aborted call does not cover it; the aborted call is context only.
    assert sorted(tree.leaves()) == ["e0:0", "e0:3"]
    kept = by_leaf(trajectories(tree, j_max=None))
    t = kept["e0:3"]
    assert t.input_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert t.loss_mask[3] == False and t.versions[3] == -1 and t.behaviour_logprobs[3] == 0  # noqa: E712
    assert sum(k.n_trained for k in kept.values()) == 2  # tokens 2 and 6


def test_staleness_masks_and_counts():
    a = mk(0, None, 0, [1], [2, 3, 4], spans=((0, 1, 0), (1, 2, 2), (2, 3, 3)))
    tree = build_tree("e0", [a])
    (t,) = trajectories(tree, max_staleness=1, trained_step=3)
    assert t.loss_mask.tolist() == [False, False, True, True]  # version 0 is 3 behind
    assert t.n_stale == 1
    assert tree.stale_tokens(3, 1) == 1
    assert trajectories(tree, max_staleness=0, trained_step=4) == []  # nothing trainable: nothing kept
    with pytest.raises(ValueError):
        trajectories(tree, max_staleness=1)


def test_role_priority_and_j_max():
    root = mk(0, None, 0, [1], [2])
    calls = [root, mk(1, 0, 2, [3], [4], role="sub-agent"), mk(2, 0, 2, [5], [6, 7, 8, 9], role="sub-agent-summary"),
             mk(3, 0, 2, [10], [11], role="main-summary")]
    tree = build_tree("e0", calls)
    # Children of other roles extending the whole root leave it a `main` leaf of its own.
    assert [t.role for t in trajectories(tree, j_max=None)] == ["main", "main-summary", "sub-agent",
                                                                "sub-agent-summary"]
    assert [t.role for t in trajectories(tree, j_max=1)] == ["main"]
    many = build_tree("e0", [root] + [mk(i, 0, 2, [i], [i + 100]) for i in range(1, 9)])
    assert len(trajectories(many)) == 5  # J_max default
    assert len(trajectories(many, j_max=None)) == 8
    with pytest.raises(ValueError):
        trajectories(many, j_max=0)


def test_a_compaction_extending_the_main_line_keeps_a_main_leaf():
    """Claude Code's compaction request is the whole history + the summary instruction in
    the last user message: with no thinking shown it extends the main line's last call
    exactly (a `main-summary` child). That call stays a `main` leaf, so J_max = 1 keeps the
    main line whole, and the summary's leaf trains only the summary."""
    calls = [mk(0, None, 0, [1, 2], [3, 4]), mk(1, 0, 4, [5], [6, 7]),
             mk(2, 1, 7, [8], [9, 10, 11], role="main-summary"),  # the compaction request
             mk(3, 0, 2, [12], [13], role="main-summary")]  # the continuation after it (a branch)
    tree = build_tree("e0", calls)
    assert tree.leaves() == ["e0:1", "e0:2", "e0:3"]
    for seed in range(20):
        (t,) = trajectories(tree, j_max=1, rng=random.Random(seed))
        assert t.leaf == "e0:1" and t.role == "main" and t.n_trained == 4
    kept = by_leaf(trajectories(tree, j_max=None))
    assert [t.role for t in kept.values()][0] == "main"
    assert kept["e0:2"].loss_mask.tolist() == [False] * 7 + [False, True, True, True]


def test_leaf_choice_is_proportional_to_unmasked_tokens():
    # Two independent roots: 1 and 3 trainable tokens → picked first 25% / 75% of the time.
    tree = build_tree("e0", [mk(0, None, 0, [1], [2]), mk(1, None, 0, [3], [4, 5, 6])])
    firsts = [trajectories(tree, j_max=1, rng=random.Random(s))[0].leaf for s in range(2000)]
    share = firsts.count("e0:1") / len(firsts)
    assert 0.71 < share < 0.79


def test_default_rng_is_deterministic_per_execution():
    root = mk(0, None, 0, [1], [2])
    calls = [root] + [mk(i, 0, 2, [i], [i + 100] * i) for i in range(1, 9)]
    a = [t.leaf for t in trajectories(build_tree("e0", calls))]
    b = [t.leaf for t in trajectories(build_tree("e0", list(reversed(calls))))]
    assert a == b


def test_invalid_calls_are_dropped_with_their_descendants():
    tree = build_tree("e0", [mk(0, None, 0, [1], [2]), mk(1, 0, 5, [3], [4]), mk(2, 1, 4, [5], [6])])
    assert tree.invalid == {"e0:1", "e0:2"}
    assert tree.leaves() == ["e0:0"]
    # Spans are checked by the schema for inline tokens; out-of-store tokens are checked here.
    bad_spans = dataclasses.replace(mk(3, None, 0, [], []), versions=((0, 1, 0),), tokens_ref="obj/k")
    tree.add(bad_spans, CallTokens(prompt_ids=(1,), completion_ids=(2, 3), logprobs=(-1.0, -1.0)))
    assert "e0:3" in tree.invalid


def test_foreign_execution_and_missing_tokens_raise():
    tree = CallTree("e0")
    with pytest.raises(ValueError):
        tree.add(mk(0, None, 0, [1], [2], execution="e1"))
    ref = CallCompleted(event_id="x", call="e0:0", execution="e0", seq=0, parent_call=None, prefix_len=0,
                        tokens=CallTokens(), tokens_ref="obj/key", sampling=SamplingParams(),
                        finish_reason="stop", versions=((0, 2, 0),), cell="c0")
    with pytest.raises(ValueError):
        tree.add(ref)
    assert tree.add(ref, CallTokens(prompt_ids=(1,), completion_ids=(2, 3), logprobs=(-1.0, -1.0))) is True
    assert trajectories(tree)[0].n_trained == 2


# -- properties over random trees ---------------------------------------------------------------
@st.composite
def random_calls(draw):
    n = draw(st.integers(1, 12))
    calls, fulls = [], []
    for seq in range(n):
        parent = draw(st.one_of(st.none(), st.integers(0, seq - 1))) if seq else None
        prefix = 0 if parent is None else draw(st.integers(0, len(fulls[parent])))
        prompt = draw(st.lists(st.integers(0, 1000), min_size=1, max_size=4))
        completion = draw(st.lists(st.integers(0, 1000), min_size=0, max_size=5))
        role = draw(st.sampled_from(ROLE_PRIORITY + ("auxiliary",)))
        version = draw(st.integers(0, 3))
        calls.append(mk(seq, parent, prefix, prompt, completion, role=role, version=version))
        fulls.append((fulls[parent][:prefix] if parent is not None else []) + prompt + completion)
    order = draw(st.permutations(list(range(n))))
    return calls, fulls, order


@settings(max_examples=150, deadline=None)
@given(random_calls(), st.integers(0, 10_000), st.sampled_from([None, 1, 2, 5]))
def test_random_trees(data, seed, j_max):
    calls, fulls, order = data
    tree = build_tree("e0", [calls[i] for i in order])
    kept = trajectories(tree, j_max=j_max, rng=random.Random(seed), max_staleness=1, trained_step=3)
    assert j_max is None or len(kept) <= j_max
    prio = [ROLE_PRIORITY.index(t.role) for t in kept]
    assert prio == sorted(prio)  # a role is exhausted before a lower one is drawn
    for t in kept:
        seq = int(t.leaf.split(":")[1])
        assert t.input_ids.tolist() == fulls[seq]
        assert t.n_trained >= 1
        assert (t.versions[t.loss_mask] >= 2).all()  # staleness bound: 3 - v <= 1
        assert (t.versions[t.loss_mask] >= 0).all()
    if j_max is None:
        # Every trainable token reachable from a leaf is trained exactly once.
        ids, policy, *_ = tree.arrays()
        trainable = policy & ~tree.stale_mask(3, 1)
        reachable = np.zeros_like(trainable)
        for leaf in tree.leaves():
            r = tree.path_ranges(leaf)
            for s, e in r:
                reachable[s:e] = True
        assert sum(t.n_trained for t in kept) == int((trainable & reachable).sum())


def test_greedy_call_trains_under_temperature_one():
    # A `temperature: 0` request is greedy decoding; its behaviour log-probs are under T = 1
    # (gyre.serving.engine, SGLang), so the trainer must use T = 1 there, not divide the logits by 0.
    import torch

    from gyre.learning.trainer import head_logprobs

    # SGLang samples any T below 1e-6 greedily too (`GREEDY_BELOW`); a float32 temperature
    # that small would underflow to 0 in the trainer.
    for temperature in (0.0, 1e-300, 1e-39, 9e-7):
        a = mk(0, None, 0, [1, 2], [3, 4], lp=[-0.5, -0.25], temperature=temperature)
        assert a.sampling.logprob_temperature == 1.0
        (t,) = trajectories(build_tree("e0", [a]))
        assert t.temperatures.tolist() == [1, 1, 1, 1]
        head = torch.nn.Linear(4, 8, bias=False)
        lp = head_logprobs(head, torch.randn(2, 4), torch.tensor([3, 4]), torch.as_tensor(t.temperatures[t.loss_mask]))
        assert torch.isfinite(lp).all()
    assert mk(0, None, 0, [1], [2], temperature=1e-6).sampling.logprob_temperature == 1e-6


@pytest.mark.parametrize("temperature", [-0.5, float("nan"), float("inf")])
def test_call_with_impossible_temperature_is_refused(temperature):
    from schemas.base import SchemaError

    with pytest.raises(SchemaError, match="temperature"):
        mk(0, None, 0, [1], [2], temperature=temperature).check()
