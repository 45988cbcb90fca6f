"""The warm start's loss: next-token log-probs of the answer and `<|im_end|>`, label-smoothed
toward the whole vocabulary at the answer's own tokens only (gyre.learning.warm_start)."""
from __future__ import annotations

import pytest
import torch

from gyre.env import majority
from gyre.learning import warm_start as ws
from gyre.serving.model import init_model, load_model, load_tokenizer
from gyre.serving.tokenizer import IM_END


@pytest.fixture(scope="module")
def model_and_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("ws") / "model"
    init_model(out)
    model, tok = load_model(out), load_tokenizer(out)
    rows = [ws._encode(tok, majority.SYSTEM_PROMPT, p, a) for p, a in majority.examples(3, seed=7)]
    return model, rows


def _by_hand(model, rows, eps):
    """Each row on its own, from the full logits: (1 − ε) · mean target log-prob + ε · mean
    over the answer's tokens (not `<|im_end|>`) of the mean log-prob over the vocabulary."""
    out = []
    for prompt, target in rows:
        logits = model(input_ids=torch.tensor([prompt + target[:-1]])).logits[0, len(prompt) - 1:].float()
        logp = torch.log_softmax(logits, -1)
        picked = logp.gather(1, torch.tensor(target)[:, None])[:, 0]
        answer = [i for i, t in enumerate(target) if t != IM_END]
        out.append((1 - eps) * picked.mean() + eps * logp[answer].mean(-1).mean())
    return torch.stack(out)


@pytest.mark.parametrize("eps", [0.0, ws.SMOOTHING])
def test_the_batched_loss_equals_each_row_by_hand(model_and_rows, eps):
    model, rows = model_and_rows
    assert all(t[-1] == IM_END and len(t) == 2 for _, t in rows)  # a digit, then the end of the message
    with torch.no_grad():
        got = ws._batch_logp(model, rows, eps)
        want = _by_hand(model, rows, eps)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    if eps:  # the smoothing really enters
        assert not torch.allclose(got, ws._batch_logp(model, rows, 0.0), atol=1e-5, rtol=0)
