"""Trainer on a tiny Qwen3 (real vocabulary size, CPU): log-probs, GSPO step, weights."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from gyre.trajectory.microstep import Sample, from_bytes, pack, to_bytes
from gyre.learning.trainer import Trainer, TrainerConfig
from gyre.trajectory.tree import Trajectory

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB = 151936


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen3")
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=2048,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    return out


def traj(execution, n, trained_at, seed, temperature=1.0):
    rs = np.random.default_rng(seed)
    mask = np.zeros(n, dtype=bool)
    mask[trained_at] = True
    return Trajectory(
        execution=execution, leaf=f"{execution}:{seed}", role="main",
        input_ids=rs.integers(0, VOCAB, n).astype(np.int32), loss_mask=mask,
        behaviour_logprobs=np.where(mask, -20.0, 0).astype(np.float32),
        versions=np.where(mask, 0, -1).astype(np.int32),
        temperatures=np.where(mask, temperature, 1.0).astype(np.float32),
    )


def microstep(adv=(1.0, -0.5)):
    # Execution A: two trajectories (one at T = 0.7); execution B: one trajectory.
    a = Sample("A", adv[0], (traj("A", 12, [4, 5, 6, 9], 1), traj("A", 9, [3, 4, 8], 2, temperature=0.7)))
    b = Sample("B", adv[1], (traj("B", 10, [2, 3, 4, 5, 6], 3, temperature=1.3),))
    (ms,) = pack([a, b], 10_000)
    return ms


def on_policy(trainer, ms):
    return dataclasses.replace(ms, behaviour_logprobs=trainer.logprobs(ms))


def test_on_policy_ratio_is_one_and_gradient_is_finite(model_dir):
    trainer = Trainer(model_dir, TrainerConfig())
    ms = on_policy(trainer, microstep())
    stats = trainer.accumulate(ms)
    assert stats["ratio_min"] == pytest.approx(1.0, abs=1e-6) and stats["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert stats["tokens"] == 12 and stats["trajectories"] == 3 and stats["clipped"] == 0
    # On policy each trajectory contributes −A·|K|/N_e: A: −1·(4 + 3)/7, B: +0.5·5/5 → −0.5.
    assert stats["loss_sum"] == pytest.approx(-0.5, abs=1e-5)
    before = trainer.state_dict_hash()
    step = trainer.apply(num_executions=2)
    assert step.loss == pytest.approx(-0.25, abs=1e-5)
    assert np.isfinite(step.grad_norm) and step.grad_norm > 0
    assert step.tokens == 12 and step.microsteps == 1 and step.executions == 2 and not step.skipped
    assert step.policy_version == 1 == trainer.policy_version
    assert trainer.state_dict_hash() != before  # weights changed with weight_decay 0
    assert all(p.grad is None for p in trainer.model.parameters())


def test_head_at_loss_positions_equals_full_head(model_dir):
    trainer = Trainer(model_dir, TrainerConfig())
    ms = microstep()
    got = trainer.logprobs(ms)
    with torch.no_grad():
        for i in range(ms.n_trajectories):
            a, b = int(ms.cu_seqlens[i]), int(ms.cu_seqlens[i + 1])
            ids = torch.as_tensor(ms.input_ids[a:b], dtype=torch.long)
            logits = trainer.model(input_ids=ids[None]).logits[0]  # (L, V)
            temps = torch.as_tensor(ms.temperatures[a:b])
            full = torch.log_softmax(logits[:-1] / temps[1:, None], dim=-1).gather(1, ids[1:, None])[:, 0]
            pos = np.flatnonzero(ms.loss_mask[a:b])
            np.testing.assert_allclose(got[a + pos], full.numpy()[pos - 1], atol=2e-5)
    assert (got[~ms.loss_mask] == 0).all()


def test_chunked_head_gives_the_same_gradient(model_dir):
    ms = microstep()
    whole = Trainer(model_dir, TrainerConfig(behaviour_logprobs="recompute"))
    chunked = Trainer(model_dir, TrainerConfig(behaviour_logprobs="recompute", head_chunk_tokens=2))
    s1, s2 = whole.accumulate(ms), chunked.accumulate(ms)
    assert s1["loss_sum"] == pytest.approx(s2["loss_sum"], abs=1e-6)
    for p, q in zip(whole.model.parameters(), chunked.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=2e-5, rtol=1e-4)


def test_zero_advantages_give_zero_gradient(model_dir):
    trainer = Trainer(model_dir, TrainerConfig())
    trainer.accumulate(on_policy(trainer, microstep(adv=(0.0, 0.0))))
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in trainer.model.parameters())
    before = trainer.state_dict_hash()
    step = trainer.apply(2)
    assert step.grad_norm == 0.0 and trainer.state_dict_hash() == before


def test_gradients_are_divided_by_num_executions(model_dir):
    ms = from_bytes(to_bytes(microstep()))  # via the wire format
    one, two = (Trainer(model_dir, TrainerConfig(behaviour_logprobs="recompute", grad_clip=1e9)) for _ in range(2))
    one.accumulate(ms)
    two.accumulate(ms)
    g1, g2 = one.apply(1).grad_norm, two.apply(2).grad_norm
    assert g1 == pytest.approx(2 * g2, rel=1e-6)


def test_recompute_ignores_recorded_logprobs(model_dir):
    trainer = Trainer(model_dir, TrainerConfig(behaviour_logprobs="recompute"))
    stats = trainer.accumulate(microstep())  # recorded log-probs are −20; the model gives ≈ −12
    assert stats["ratio_mean"] == pytest.approx(1.0)
    proxy = Trainer(model_dir, TrainerConfig()).accumulate(microstep())
    assert proxy["ratio_max"] > 2.0  # the proxy log-probs are used as π_old


def test_save_writes_a_loadable_checkpoint(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = Trainer(model_dir, TrainerConfig(), policy_version=4)
    trainer.accumulate(on_policy(trainer, microstep()))
    trainer.apply(2)
    old = os.umask(0o022)  # the usual umask, under which the weights' 0600 stands out
    try:
        out = trainer.save(tmp_path / "v5")
    finally:
        os.umask(old)
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    assert (out / "model.safetensors").stat().st_mode & 0o777 == (out / "config.json").stat().st_mode & 0o777
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    for (n, p), (m, q) in zip(trainer.model.state_dict().items(), loaded.state_dict().items()):
        assert n == m and torch.equal(p, q)
    assert trainer.policy_version == 5


def test_config_validation():
    with pytest.raises(ValueError, match="grad_clip"):
        TrainerConfig(grad_clip=0)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        TrainerConfig(behaviour_logprobs="guess")
    with pytest.raises(ValueError, match="lr"):
        TrainerConfig(lr=-1)
    with pytest.raises(ValueError, match="shared_prefix_min_tokens"):
        TrainerConfig(shared_prefix_min_tokens=-1)


def test_head_logprobs_gradcheck_against_autograd():
    from gyre.learning.trainer import head_logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(6, 11, bias=True).double()
    h = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 3, 10, 3, 7])
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5], dtype=torch.float64)
    for chunk in (1, 2, 64):
        assert torch.autograd.gradcheck(
            lambda h, w, b: head_logprobs(_Lin(w, b), h, targets, temps, chunk),
            (h, head.weight, head.bias),
        )
    ref = torch.log_softmax(head(h) / temps[:, None], dim=-1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(head_logprobs(head, h, targets, temps, 2), ref)


class _Lin:
    def __init__(self, weight, bias):
        self.weight, self.bias = weight, bias


# -- shared prefixes ----------------------------------------------------------------
def shared_microstep(first_trained, second_trained=(175, 180, 209), third_trained=(171, 172, 199), *, third_len=200):
    """Execution A: three trajectories over a common 100-token prefix (a system prompt);
    the second and third share 70 more tokens; execution B: one unrelated trajectory."""
    rs = np.random.default_rng(7)
    pre, mid = rs.integers(0, VOCAB, 100), rs.integers(0, VOCAB, 70)
    ids = (np.concatenate([pre, rs.integers(0, VOCAB, 50)]), np.concatenate([pre, mid, rs.integers(0, VOCAB, 40)]),
           np.concatenate([pre, mid, rs.integers(0, VOCAB, third_len - 170)]))
    a = Sample("A", 1.0, tuple(_traj_of("A", x, t, k, temperature=0.8 if k == 1 else 1.0)
                               for k, (x, t) in enumerate(zip(ids, (first_trained, second_trained, third_trained)))))
    b = Sample("B", -0.5, (traj("B", 60, [10, 11, 40, 59], 3, temperature=1.3),))
    (ms,) = pack([a, b], 10_000)
    return ms


def _traj_of(execution, ids, trained_at, k, temperature=1.0):
    mask = np.zeros(len(ids), dtype=bool)
    mask[list(trained_at)] = True
    return Trajectory(execution=execution, leaf=f"{execution}:{k}", role="main", input_ids=ids.astype(np.int32),
                      loss_mask=mask, behaviour_logprobs=np.where(mask, -12.0, 0).astype(np.float32),
                      versions=np.where(mask, 0, -1).astype(np.int32),
                      temperatures=np.where(mask, temperature, 1.0).astype(np.float32))


def _sharing_pair(model_dir, **kw):
    shared = Trainer(model_dir, TrainerConfig(behaviour_logprobs="recompute", **kw))
    plain = Trainer(model_dir, TrainerConfig(behaviour_logprobs="recompute", **{**kw, "shared_prefix_min_tokens": 0}))
    return shared, plain


def _assert_same_step(shared, plain, ms):
    np.testing.assert_allclose(shared.logprobs(ms), plain.logprobs(ms), atol=2e-5)
    s1, s0 = shared.accumulate(ms), plain.accumulate(ms)
    for key in ("loss_sum", "tokens", "trajectories", "clipped", "ratio_mean"):
        assert s1[key] == pytest.approx(s0[key], abs=1e-5), key
    n = 0
    for (name, p), q in zip(shared.model.named_parameters(), plain.model.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=2e-6, rtol=1e-4, msg=name)
            n += 1
    assert n == len(list(plain.model.parameters()))
    return s1, s0


def test_shared_prefix_gives_the_same_loss_and_gradients(model_dir):
    # The first trajectory trains 40 positions inside the shared prefix (it was kept first),
    # plus two after it; the later ones train only after the prefix, as the builder masks.
    ms = shared_microstep(list(range(20, 60)) + [140, 149])
    shared, plain = _sharing_pair(model_dir)
    s1, s0 = _assert_same_step(shared, plain, ms)
    # Cut lengths: 149, 209, 199 (A) and 59 (B) = 616 positions run one by one. Shared: the
    # 100-token prefix once, then 49 for the first, 70 shared by the other two, 39 + 29; B alone.
    assert s0["positions"] == 616 and s0["shared_positions"] == 0
    assert s1["positions"] == 100 + 49 + 70 + 39 + 29 + 59 and s1["shared_positions"] == 616 - 346
    assert s1["tokens"] == 42 + 3 + 3 + 4


def test_shared_prefix_with_loss_in_every_branch_and_a_path_ending_at_the_fork(model_dir):
    # Uncapped-style: all three train the same prefix positions (each trajectory keeps its own
    # head rows, so the loss counts them once per trajectory); the third ends exactly where
    # the second and third fork (cut length 170) and a fourth is an exact copy of the first.
    ms = shared_microstep([30, 31, 99, 100, 149], [30, 31, 99, 100, 175, 209], [30, 31, 99, 100, 170], third_len=171)
    ms4 = pack([Sample("A", 1.0, tuple(_traj_of("A", ms.input_ids[int(ms.cu_seqlens[i]):int(ms.cu_seqlens[i + 1])],
                                                 np.flatnonzero(ms.loss_mask[int(ms.cu_seqlens[i]):int(ms.cu_seqlens[i + 1])]), i)
                                        for i in (0, 1, 2, 0)))], 10_000)[0]
    for m in (ms, ms4):
        shared, plain = _sharing_pair(model_dir, head_chunk_tokens=3)
        s1, s0 = _assert_same_step(shared, plain, m)
        assert s1["shared_positions"] > 0 and s1["tokens"] == s0["tokens"]


def test_short_common_prefixes_are_not_shared(model_dir):
    ms = shared_microstep(list(range(20, 60)) + [140, 149])
    # 101: the 100 tokens common to all three are too short; the second and third still share 170.
    shared, plain = _sharing_pair(model_dir, shared_prefix_min_tokens=101)
    s1, _ = _assert_same_step(shared, plain, ms)
    assert s1["positions"] == 149 + 170 + 39 + 29 + 59
    shared, plain = _sharing_pair(model_dir, shared_prefix_min_tokens=171)  # nothing long enough
    s1, _ = _assert_same_step(shared, plain, ms)
    assert s1["positions"] == 616 and s1["shared_positions"] == 0


def test_output_head_runs_only_at_loss_positions_when_sharing(model_dir, monkeypatch):
    import gyre.learning.trainer as trainer_mod

    rows = []
    real = trainer_mod.head_logprobs

    def counting(head, h, targets, temps, chunk=512):
        rows.append(h.shape[0])
        return real(head, h, targets, temps, chunk)

    monkeypatch.setattr(trainer_mod, "head_logprobs", counting)
    ms = shared_microstep(list(range(20, 60)) + [140, 149])
    shared = Trainer(model_dir, TrainerConfig(behaviour_logprobs="recompute"))
    stats = shared.accumulate(ms)
    assert sum(rows) == ms.n_trained == stats["tokens"] == 52
    assert stats["shared_positions"] > 0


def test_prefix_forest_worked_example():
    from gyre.learning.trainer import prefix_forest

    s = [np.array(x) for x in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9], [7, 7], [1, 2, 3, 4, 5, 8, 8], [1, 2, 3, 4, 5])]
    roots = prefix_forest(s, 2)

    def shape(n):
        return (n.start, n.end, n.rows, [shape(c) for c in n.children])

    # 0, 1, 3, 4 share [1 2 3]; 0, 3, 4 share [1 2 3 4 5] (2 more tokens); 4 ends at the fork.
    assert [shape(r) for r in roots] == [
        (0, 3, [4, 0, 3, 1], [(3, 5, [4, 0, 3], [(5, 5, [4], []), (5, 6, [0], []), (5, 7, [3], [])]), (3, 5, [1], [])]),
        (0, 2, [2], []),
    ]
    assert sum(r.positions() for r in roots) == 3 + 2 + 0 + 1 + 2 + 2 + 2 == 12  # of 6 + 5 + 2 + 7 + 5 = 25
    # min_shared 3: the 2-token step [4 5] is not a node of its own; its branches recompute it.
    (top, lone) = prefix_forest(s, 3)
    assert shape(top) == (0, 3, [4, 0, 3, 1], [(3, 5, [4], []), (3, 6, [0], []), (3, 7, [3], []), (3, 5, [1], [])])
    assert prefix_forest(s[:1], 2)[0].children == [] and prefix_forest([], 2) == []


def test_cached_prefix_attention_matches_masked_sdpa():
    from gyre.learning.trainer import _CachedPrefixAttention

    torch.manual_seed(0)
    P, S, H, D = 13, 7, 3, 8
    q = torch.randn(1, H, S, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, H, P + S, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, H, P + S, D, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(S, P + S, dtype=torch.bool).tril(P)  # query i sees the prefix and branch keys ≤ i
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    assert torch.autograd.gradcheck(
        lambda q, k, v: _CachedPrefixAttention.apply(q, k[:, :, :P], v[:, :, :P], k[:, :, P:], v[:, :, P:], 0.3), (q, k, v))
    got = _CachedPrefixAttention.apply(q, k[:, :, :P], v[:, :, :P], k[:, :, P:], v[:, :, P:], 0.3)
    torch.testing.assert_close(got, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(model_dir):
    ms = microstep()
    cpu = Trainer(model_dir, TrainerConfig(behaviour_logprobs="recompute"))
    gpu = Trainer(model_dir, TrainerConfig(behaviour_logprobs="recompute", device="cuda"))
    np.testing.assert_allclose(gpu.logprobs(ms), cpu.logprobs(ms), atol=1e-4)
    s_cpu, s_gpu = cpu.accumulate(ms), gpu.accumulate(ms)
    assert s_gpu["loss_sum"] == pytest.approx(s_cpu["loss_sum"], abs=1e-4)
    a, b = cpu.apply(2), gpu.apply(2)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_shared_prefix_matches_cpu(model_dir):
    ms = shared_microstep(list(range(20, 60)) + [140, 149])
    cpu = Trainer(model_dir, TrainerConfig(behaviour_logprobs="recompute", shared_prefix_min_tokens=0))
    gpu = Trainer(model_dir, TrainerConfig(behaviour_logprobs="recompute", device="cuda"))
    np.testing.assert_allclose(gpu.logprobs(ms), cpu.logprobs(ms), atol=1e-4)
    s_cpu, s_gpu = cpu.accumulate(ms), gpu.accumulate(ms)
    assert s_gpu["loss_sum"] == pytest.approx(s_cpu["loss_sum"], abs=1e-4) and s_gpu["shared_positions"] > 0
    for p, q in zip(gpu.model.parameters(), cpu.model.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-4, rtol=1e-3)


def test_lone_trajectories_batched_give_the_same_loss_and_gradients(model_dir, monkeypatch):
    """Short trajectories that share no prefix run right-padded in one batch (one forward,
    one head call, one backward): the same log-probs, stats and gradients as one by one."""
    import gyre.learning.trainer as trainer_mod

    a = Sample("A", 1.0, (traj("A", 12, [4, 5, 6, 9], 1), traj("A", 9, [3, 4, 8], 2, temperature=0.7)))
    b = Sample("B", -0.5, (traj("B", 10, [2, 3, 4, 5, 6], 3, temperature=1.3), traj("B", 30, [29], 4)))
    (ms,) = pack([a, b], 10_000)
    calls = []
    real = trainer_mod.head_logprobs
    monkeypatch.setattr(trainer_mod, "head_logprobs", lambda *args, **kw: calls.append(1) or real(*args, **kw))

    def trainer(lone):
        return Trainer(model_dir, TrainerConfig(behaviour_logprobs="recompute", shared_prefix_min_tokens=0,
                                                lone_batch_positions=lone))

    batched, alone = trainer(2048), trainer(0)
    s1, s0 = _assert_same_step(batched, alone, ms)
    # cut lengths 9, 8, 6, 29; loss positions 4 + 3 + 5 + 1
    assert s1["positions"] == s0["positions"] == 52 and s1["tokens"] == s0["tokens"] == 13
    for lone, heads in ((2048, 1), (40, 2), (0, 4)):  # 40: [9, 8, 6] padded to 27 ≤ 40; 29 > 40 / 2 alone
        t = trainer(lone)
        calls.clear()
        t.accumulate(ms)
        assert len(calls) == heads, lone
