"""`gyre bench learning`'s CI variant: on the learning recipe's fixed seed the policy gets
better through the whole system (runner, proxy, engine, evaluator, builder, trainer,
weight publishing), its control run (learning rate 0) stays flat, and runs with the same
seed repeat the same rewards.

Real processes throughout: `gyre run learning` in its own process with every daemon and
a private nats-server, as `gyre bench learning` runs it, only with fewer steps."""
from __future__ import annotations

from handlers.bench.learning import measure, run_once

STEPS = 6
WINDOW = 3


def test_learning_rises_against_a_flat_control_and_repeats(tmp_path):
    f = measure(steps=STEPS, window=WINDOW, workdir=tmp_path)
    learning, control = f, f["control"]
    assert len(learning["reward_per_step"]) == len(control["reward_per_step"]) == STEPS
    # the policy really trained on every step, and the control computed gradients too
    assert learning["tokens_trained"] > 0 and all(g > 0 for g in learning["grad_norm_per_step"])
    assert len(control["grad_norm_per_step"]) == STEPS
    assert learning["rise"] >= 0.15, learning
    assert abs(control["rise"]) < 0.05, control
    # step 0 of both runs: the same weights and the same per-call seeds, so the same rewards
    assert learning["reward_per_step"][0] == control["reward_per_step"][0]
    # a second learning run on the same seed repeats the first two steps (after an update too)
    again = run_once(tmp_path / "model", tmp_path / "runs", "again", steps=2, seed=f["seed"])
    assert [round(r, 4) for r in again["rewards_per_step"]] == learning["reward_per_step"][:2]
    assert again["grad_norm_per_step"] == learning["grad_norm_per_step"][:2]
