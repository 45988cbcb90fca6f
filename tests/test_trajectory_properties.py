"""Properties of trajectory processing over random trees (DESIGN.md "Trajectory processing", "Learning").

Every new id in a generated execution is unique, so a trained token is identified by its id:
- no policy token is trained twice, and no context token is trained;
- J_max is never exceeded;
- results are identical for any event order (redeliveries included);
- every execution's total loss weight is the same, whatever its length or branching.
"""
from __future__ import annotations

import itertools
import random

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.learning.gspo import gspo_loss
from gyre.trajectory.microstep import Sample, pack
from gyre.trajectory.tree import ROLE_PRIORITY, CallTree, trajectories
from schemas import CallCompleted, CallTokens, SamplingParams

TRAINED_STEP, MAX_STALENESS = 3, 1


@st.composite
def executions(draw, name="e0", max_calls=10):
    """(calls, trainable ids): a random tree with unique ids; trainable = ids a leaf may train."""
    counter = itertools.count(1)
    n = draw(st.integers(1, max_calls))
    calls, fulls, trainable = [], [], set()
    for seq in range(n):
        parent = draw(st.one_of(st.none(), st.integers(0, seq - 1))) if seq else None
        prefix = 0 if parent is None else draw(st.integers(0, len(fulls[parent])))
        prompt = [next(counter) for _ in range(draw(st.integers(0, 3)))]
        completion = [next(counter) for _ in range(draw(st.integers(0, 4)))]
        role = draw(st.sampled_from(ROLE_PRIORITY + ("auxiliary",)))
        status = draw(st.sampled_from(["ok", "ok", "ok", "aborted", "error"]))
        # One or two version spans over the completion.
        cut = draw(st.integers(0, len(completion)))
        v1, v2 = draw(st.integers(0, 3)), draw(st.integers(0, 3))
        spans = ((0, cut, v1), (cut, len(completion), v2))
        calls.append(CallCompleted(
            event_id=f"r:{name}:call:{seq}", call=f"{name}:{seq}", execution=name, seq=seq,
            parent_call=None if parent is None else f"{name}:{parent}", prefix_len=prefix,
            tokens=CallTokens(prompt_ids=tuple(prompt), completion_ids=tuple(completion),
                              logprobs=tuple(-0.5 for _ in completion)),
            sampling=SamplingParams(), finish_reason="stop", versions=spans, cell="c0", role=role, status=status))
        head = fulls[parent][:prefix] if parent is not None else []
        fulls.append(head + prompt + completion)
        if status == "ok" and role in ROLE_PRIORITY:
            for i, tok in enumerate(completion):
                version = v1 if i < cut else v2
                first_of_sequence = parent is None and not prompt and i == 0
                if TRAINED_STEP - version <= MAX_STALENESS and not first_of_sequence:
                    trainable.add(tok)
    return calls, trainable


def keep(tree, j_max, seed):
    return trajectories(tree, j_max=j_max, rng=random.Random(seed), max_staleness=MAX_STALENESS,
                        trained_step=TRAINED_STEP)


def signature(kept):
    return [(t.leaf, t.role, t.input_ids.tolist(), t.loss_mask.tolist(), t.versions.tolist(), t.n_stale) for t in kept]


@settings(max_examples=200, deadline=None)
@given(executions(), st.sampled_from([None, 1, 2, 3, 5]), st.integers(0, 1000))
def test_each_policy_token_trained_at_most_once_and_no_context(data, j_max, seed):
    calls, trainable = data
    tree = CallTree("e0")
    for c in calls:
        tree.add(c)
    kept = keep(tree, j_max, seed)
    assert j_max is None or len(kept) <= j_max
    trained = [int(tok) for t in kept for tok in t.input_ids[t.loss_mask]]
    assert len(trained) == len(set(trained))  # never twice
    assert set(trained) <= trainable  # never a context, auxiliary, failed or stale token
    assert all(t.n_trained >= 1 for t in kept)
    if j_max is None:
        # Uncapped: everything trainable on some leaf's path is trained (once).
        reachable = {int(tok) for leaf in tree.leaves() for tok in tree.full_ids(leaf)}
        assert set(trained) == trainable & reachable


@settings(max_examples=100, deadline=None)
@given(executions(), st.randoms(use_true_random=False), st.sampled_from([None, 1, 5]), st.integers(0, 1000))
def test_any_event_order_gives_identical_results(data, shuffler, j_max, seed):
    calls, _ = data
    ref = signature(keep(_tree(calls), j_max, seed))
    events = calls + [shuffler.choice(calls) for _ in range(3)]  # redeliveries
    shuffler.shuffle(events)
    tree = _tree(events)
    assert tree.pending == 0
    assert signature(keep(tree, j_max, seed)) == ref


def _tree(events):
    tree = CallTree("e0")
    for c in events:
        tree.add(c)
    return tree


@settings(max_examples=60, deadline=None)
@given(st.lists(executions(max_calls=8), min_size=1, max_size=4), st.integers(1, 12), st.sampled_from([1, 5, None]))
def test_every_execution_weighs_the_same(data, token_budget, j_max):
    # On policy (r = 1) with A_e = 1, d loss_sum / d logp_t = −1/N_e at each trained token, so each
    # execution's weights add up to −1 (−1/|E| after the trainer's division), however many tokens,
    # trajectories or micro-steps it has.
    samples = []
    for k, (calls, _) in enumerate(data):
        name = f"x{k}"
        tree = CallTree(name)
        for c in calls:
            tree.add(_rename(c, name))
        kept = keep(tree, j_max, k)
        if kept:
            samples.append(Sample(execution=name, advantage=1.0, trajectories=tuple(kept)))
    totals: dict[str, float] = {}
    for ms in pack(samples, token_budget):
        logp = torch.full((ms.n_tokens,), -1.0, dtype=torch.float64, requires_grad=True)
        loss, _ = gspo_loss(logp, logp.detach(), torch.as_tensor(ms.loss_mask), torch.as_tensor(ms.seq_index()),
                            torch.as_tensor(ms.advantages, dtype=torch.float64), torch.as_tensor(ms.n_e, dtype=torch.float64))
        loss.backward()
        grad = logp.grad.numpy()
        seq = ms.seq_index()
        for i, execution in enumerate(ms.executions):
            rows = np.isin(seq, np.flatnonzero(ms.traj_execution == i))
            totals[execution] = totals.get(execution, 0.0) + float(grad[rows].sum())
    assert set(totals) == {s.execution for s in samples}
    for total in totals.values():
        assert abs(total + 1.0) < 1e-9


def _rename(call: CallCompleted, name: str) -> CallCompleted:
    import dataclasses

    seq = call.seq
    parent = None if call.parent_call is None else f"{name}:{call.parent_call.split(':')[1]}"
    return dataclasses.replace(call, execution=name, call=f"{name}:{seq}", parent_call=parent,
                               event_id=f"r:{name}:call:{seq}")
