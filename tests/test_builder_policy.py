"""Builder policy: groups finalise when all scored; steps seal; facts are idempotent."""
import numpy as np
import structlog.testing

import schemas
from gyre.trajectory.builder import BuilderPolicy
from schemas import ids


def _info(e, g, step=0, group_size=2, step_groups=2):
    return schemas.ExecutionInfo(execution=e, task="t", group=g, step=step, harness="toy",
                                 group_size=group_size, step_groups=step_groups)


def _call(e, seq, prompt, completion, parent=None, prefix=0, version=0, role="main"):
    return schemas.CallCompleted(
        event_id=ids.call("r", e, seq), call=f"{e}:{seq}", execution=e, seq=seq, parent_call=parent,
        prefix_len=prefix, tokens=schemas.CallTokens(prompt_ids=prompt, completion_ids=completion,
                                                     logprobs=[-0.5] * len(completion)),
        sampling=schemas.SamplingParams(), finish_reason="stop", versions=[(0, len(completion), version)],
        cell="cell0", role=role)


def _score(e, g, reward, outcome="reward", attempt=0, **kw):
    return schemas.ExecutionScored(event_id=ids.scored("r", e, attempt), info=_info(e, g, **kw), outcome=outcome,
                                   reward=reward if outcome == "reward" else (0.0 if outcome == "placeholder" else None),
                                   attempt=attempt)


def test_group_then_step_seal_and_exact_tokens():
    p = BuilderPolicy(token_budget=10_000)
    # e0: two chained calls; the second extends the first (prefix = 3 + 2 ids).
    assert p.add_call(_call("e0", 0, [1, 2, 3], [10, 11]))
    assert p.add_call(_call("e0", 1, [4], [12, 13, 14], parent="e0:0", prefix=5))
    assert not p.add_call(_call("e0", 1, [4], [12, 13, 14], parent="e0:0", prefix=5))  # redelivered
    p.add_call(_call("e1", 0, [1, 2, 3], [20]))
    ms, sealed = p.add_score(_score("e0", "g0", 1.0))
    assert ms == [] and sealed is None
    ms, sealed = p.add_score(_score("e1", "g0", 0.0))
    assert sealed is None and len(ms) == 1
    m = ms[0]
    # One trajectory per execution; e0's path is its last call's full sequence.
    seqs = np.split(m.input_ids, m.cu_seqlens[1:-1])
    by_exec = {m.executions[m.traj_execution[i]]: s.tolist() for i, s in enumerate(seqs)}
    assert by_exec["e0"] == [1, 2, 3, 10, 11, 4, 12, 13, 14]
    assert by_exec["e1"] == [1, 2, 3, 20]
    # Loss only on sampled completion ids, each exactly once.
    trained = m.input_ids[m.loss_mask].tolist()
    assert sorted(trained) == sorted([10, 11, 12, 13, 14, 20])
    # Advantages ±1/std: rewards (1, 0), mean .5, std (ddof=1) = .7071.
    adv = dict(zip([m.executions[i] for i in m.traj_execution], m.advantages.tolist()))
    assert np.isclose(adv["e0"], 0.5 / np.std([1, 0], ddof=1)) and np.isclose(adv["e1"], -adv["e0"])
    # Second group: zero variance → nothing packed, counted, step sealed.
    p.add_call(_call("e2", 0, [5], [30]))
    p.add_call(_call("e3", 0, [5], [31]))
    p.add_score(_score("e2", "g1", 0.5))
    ms, sealed = p.add_score(_score("e3", "g1", 0.5))
    assert ms == []
    assert sealed is not None and sealed.step == 0 and sealed.microsteps == 1
    assert sealed.executions == 4 and sealed.zero_variance_groups == 1
    assert np.isclose(sealed.reward_mean, 0.5)
    # A call after its group was finalised is counted as late, not trained.
    assert not p.add_call(_call("e3", 1, [6], [32], parent="e3:0", prefix=2))
    assert p.late_calls == 1


def test_placeholder_and_excluded_leave_E():
    p = BuilderPolicy()
    p.add_call(_call("a", 0, [1], [2]))
    p.add_call(_call("b", 0, [1], [3]))
    p.add_score(_score("a", "g", 1.0, group_size=4, step_groups=1))
    p.add_score(_score("b", "g", 0.0, group_size=4, step_groups=1))
    p.add_score(_score("c", "g", None, outcome="placeholder", group_size=4, step_groups=1))
    ms, sealed = p.add_score(_score("d", "g", None, outcome="excluded", group_size=4, step_groups=1))
    assert sealed.executions == 2 and sealed.excluded == 1
    assert set(ms[0].executions) == {"a", "b"}


def test_a_call_whose_parent_never_arrived_is_named_when_its_group_is_finalised():
    """A call waits in its tree for its parent; when the group is finalised without it (the
    parent's `call.completed` was lost), the builder says so instead of dropping it unseen."""
    p = BuilderPolicy()
    p.add_call(_call("a", 0, [1], [2]))
    p.add_call(_call("a", 2, [1, 2, 4], [5], parent="a:1", prefix=3))
    p.add_call(_call("b", 0, [1], [3]))
    with structlog.testing.capture_logs() as logs:
        p.add_score(_score("a", "g", 1.0))
        p.add_score(_score("b", "g", 0.0))
    orphaned = [e for e in logs if e["event"] == "builder.calls.orphaned"]
    assert [(e["execution"], e["calls"]) for e in orphaned] == [("a", 1)]
