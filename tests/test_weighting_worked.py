"""The two-level average (DESIGN.md "Learning") on a worked example, through gspo and the trainer.

Worked example. A step with two executions, |E| = 2:
- execution A (A_A = +1): root call  prompt [11, 12] → completion [13, 14];
  call 1 extends all of it: prompt [15] → completion [16];
  call 2 branches after the root's prompt: prompt [17] → completion [18].
  Leaves: call 1 (path 11 12 13 14 15 16, policy 13 14 16) and call 2 (path 11 12 17 18,
  policy 18). Kept uncapped: |K| = 3 and 1 whichever comes first, so N_A = 4.
- execution B (A_B = −0.5): one call prompt [21, 22] → completion [23, 24]; N_B = 2.

On policy every ratio is 1, so the loss is
    L = −(1/|E|) Σ_e (1/N_e) Σ_τ Σ_{t∈K_τ} A_e = −(1/2)·(4/4·1 + 2/2·(−0.5)) = −0.25
and its gradient is Σ_t w_t ∇log π(y_t) with per-token weights
    w_t = −A_e / (|E|·N_e):  A's four tokens −1/8 each, B's two tokens +0.5/4 = +1/8 each.
Each execution's weights add up to −A_e/|E| (−1/2 and +1/4) whatever its length or branching;
a flat token average would give −1/6 and +0.5/6 instead.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from gyre.learning.gspo import gspo_loss
from gyre.trajectory.microstep import Sample, pack
from gyre.learning.trainer import Trainer, TrainerConfig
from gyre.trajectory.tree import build_tree, trajectories
from schemas import CallCompleted, CallTokens, SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")

A_A, A_B, E = 1.0, -0.5, 2
WEIGHTS = {13: -1 / 8, 14: -1 / 8, 16: -1 / 8, 18: -1 / 8, 23: 1 / 8, 24: 1 / 8}


def _call(execution, seq, parent, prefix, prompt, completion):
    return CallCompleted(
        event_id=f"r:{execution}:call:{seq}", call=f"{execution}:{seq}", execution=execution, seq=seq,
        parent_call=None if parent is None else f"{execution}:{parent}", prefix_len=prefix,
        tokens=CallTokens(prompt_ids=tuple(prompt), completion_ids=tuple(completion),
                          logprobs=tuple(-1.0 for _ in completion)),
        sampling=SamplingParams(), finish_reason="stop", versions=((0, len(completion), 0),), cell="c0")


def samples() -> list[Sample]:
    a = build_tree("A", [_call("A", 0, None, 0, [11, 12], [13, 14]), _call("A", 1, 0, 4, [15], [16]),
                         _call("A", 2, 0, 2, [17], [18])])
    b = build_tree("B", [_call("B", 0, None, 0, [21, 22], [23, 24])])
    return [Sample("A", A_A, tuple(trajectories(a, j_max=None))), Sample("B", A_B, tuple(trajectories(b, j_max=None)))]


def test_kept_trajectories_of_the_example():
    a, b = samples()
    paths = sorted(t.input_ids.tolist() for t in a.trajectories)
    assert paths == [[11, 12, 13, 14, 15, 16], [11, 12, 17, 18]]
    assert sorted(t.n_trained for t in a.trajectories) == [1, 3] and a.n_e == 4
    assert b.n_e == 2 and b.trajectories[0].input_ids[b.trajectories[0].loss_mask].tolist() == [23, 24]


@pytest.mark.parametrize("token_budget", [100, 4])  # one micro-step, or A's trajectories split apart
def test_gspo_weights_are_averaged_per_execution_then_across(token_budget):
    got: dict[int, float] = {}
    loss_total = 0.0
    for ms in pack(samples(), token_budget):
        logp = torch.full((ms.n_tokens,), -2.0, dtype=torch.float64, requires_grad=True)
        loss, _ = gspo_loss(logp, logp.detach(), torch.as_tensor(ms.loss_mask), torch.as_tensor(ms.seq_index()),
                            torch.as_tensor(ms.advantages, dtype=torch.float64),
                            torch.as_tensor(ms.n_e, dtype=torch.float64))
        loss.backward()
        loss_total += float(loss.detach())
        for tok, g in zip(ms.input_ids.tolist(), (logp.grad / E).tolist()):
            if g:
                assert tok not in got  # each token trained once
                got[tok] = g
    assert loss_total / E == pytest.approx(-0.25)
    assert got == pytest.approx(WEIGHTS)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen3-worked")
    cfg = Qwen3Config(vocab_size=256, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, intermediate_size=32, max_position_embeddings=64,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    return out


def test_trainer_gradient_is_the_worked_weighted_sum(model_dir):
    trainer = Trainer(model_dir, TrainerConfig())
    microsteps = pack(samples(), 4)
    assert len(microsteps) >= 2
    on_policy = [dataclasses.replace(ms, behaviour_logprobs=trainer.logprobs(ms)) for ms in microsteps]
    for ms in on_policy:
        trainer.accumulate(ms)
    grads = {n: p.grad.detach().clone() / E for n, p in trainer.model.named_parameters() if p.grad is not None}

    # Reference: Σ_t w_t ∇log π(y_t) with the hand-worked weights, from a plain full-vocabulary forward.
    ref_model = trainer.model
    ref_model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float32)
    for s in samples():
        for t in s.trajectories:
            ids = torch.as_tensor(t.input_ids, dtype=torch.long)
            logits = ref_model(input_ids=ids[None]).logits[0].float()  # (T, V)
            logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]  # (T−1,) predicts ids[1:]
            for pos in np.flatnonzero(t.loss_mask):
                total = total + WEIGHTS[int(t.input_ids[pos])] * logp[pos - 1]
    total.backward()
    assert sum(float(p.grad.norm()) for p in ref_model.parameters() if p.grad is not None) > 1e-3  # not vacuous
    for n, p in ref_model.named_parameters():
        if p.grad is None:
            continue
        assert torch.allclose(grads[n], p.grad, atol=1e-6, rtol=1e-4), n
    ref_model.zero_grad(set_to_none=True)

    # And the step loss the trainer reports is the worked −0.25.
    trainer2 = Trainer(model_dir, TrainerConfig())
    for ms in on_policy:
        trainer2.accumulate(ms)
    assert trainer2.apply(num_executions=E).loss == pytest.approx(-0.25, abs=1e-6)
