"""A short supervised warm start of a checkpoint on a task family gyre generates itself.

`warm_start(model_dir, family, steps, ...)` trains the checkpoint in `model_dir` in place:
`steps` AdamW steps of next-token cross-entropy on `batch` (prompt, answer) pairs each,
the prompts rendered with the checkpoint's chat template exactly as the toy harness's one
call reaches the policy (system + user message, generation prompt), the targets the
answer's ids and `<|im_end|>`. It exists so that an RL demo starts from a policy whose
success rate is neither 0 (no group has reward variance, GSPO has nothing to push) nor
near 1 (nothing left to learn): on `majority` with the default model, `STEPS` steps with
the answer label-smoothed by `SMOOTHING` give ~0.15 (`success` in the returned stats, the
mean probability of sampling the right answer, `<|im_end|>` included, on instances drawn apart from the training pairs).

Deterministic: the pairs come from `gyre.env.<family>.examples(steps * batch, seed)`,
batches in order, torch's RNG untouched (nothing is sampled), one CPU thread, so the
same arguments write the same weights. Writes `warm_start.json` (the arguments and the
loss per step) beside the weights.
"""
from __future__ import annotations

import importlib
import json
import time
from pathlib import Path

import torch

STEPS = 200
"""Warm-start steps by default (the learning recipe's `model.warm_start_steps`)."""
SMOOTHING = 0.6
"""Label smoothing of the warm start: the loss weights the answer's log-prob 1 − SMOOTHING
and the mean log-prob over the whole vocabulary SMOOTHING, so the policy learns which digit
answers a row but keeps much of its probability on tokens that are no digit (module
docstring: what that leaves GSPO to learn)."""
FAMILIES = ("majority",)
"""Task families with a warm start: modules of `gyre.env` with `SYSTEM_PROMPT`, `examples`."""


def _family(name: str):
    if name not in FAMILIES:
        raise ValueError(f"unknown warm-start task family {name!r}; known: {', '.join(FAMILIES)}")
    return importlib.import_module(f"gyre.env.{name}")


def _encode(tok, system: str, problem: str, answer: str | None) -> tuple[list[int], list[int]]:
    from gyre.serving.chat import render
    from gyre.serving.tokenizer import IM_END

    text = render(tok, [{"role": "system", "content": system}, {"role": "user", "content": problem}])
    prompt = tok.encode(text, add_special_tokens=False)
    target = [] if answer is None else tok.encode(answer, add_special_tokens=False) + [IM_END]
    return prompt, target


def _batch_logp(model, rows: list[tuple[list[int], list[int]]], smoothing: float = 0.0) -> torch.Tensor:
    """(B,) mean log-prob of each row's target given its prompt; with `smoothing` ε, label
    smoothing toward the uniform distribution at the answer's own tokens: (1 − ε) × that mean
    + ε × the mean over the answer's tokens of the mean log-prob over the vocabulary. The
    output layer runs only at the target positions (on a 151,936-token vocabulary that is
    most of the cost)."""
    width = max(len(p) + len(t) for p, t in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, t) in enumerate(rows):
        ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        attn[i, : len(p) + len(t)] = 1
    hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state  # (B, W, H)
    rows_idx = torch.tensor([i for i, (p, t) in enumerate(rows) for _ in t])  # (N,) row of each target
    cols_idx = torch.tensor([len(p) - 1 + j for p, t in rows for j in range(len(t))])  # (N,) its position − 1
    targets = torch.tensor([x for _, t in rows for x in t])  # (N,)
    # one output-layer matmul for every target: its gradient into the (tied) embedding is
    # one dense (V, H) tensor per step, not one per row
    logp = torch.log_softmax(model.lm_head(hidden[rows_idx, cols_idx]).float(), -1)  # (N, V)
    picked = logp.gather(1, targets[:, None])[:, 0]  # (N,)
    counts = torch.tensor([len(t) for _, t in rows], dtype=picked.dtype)
    mean = torch.zeros(len(rows), dtype=picked.dtype).index_add(0, rows_idx, picked) / counts
    if not smoothing:
        return mean
    from gyre.serving.tokenizer import IM_END

    answer = targets != IM_END  # the answer's own tokens; the end of the message is not smoothed
    uniform = torch.zeros(len(rows), dtype=picked.dtype).index_add(0, rows_idx[answer], logp.mean(-1)[answer])
    return (1 - smoothing) * mean + smoothing * uniform / (counts - 1).clamp(min=1)


@torch.no_grad()
def success_rate(model, tok, family: str = "majority", n: int = 200, seed: int = 1) -> float:
    """Mean probability, at temperature 1, of sampling exactly the right answer (its ids,
    then `<|im_end|>`), over n instances of `family` drawn from the tasks' stream with
    `seed`: an estimate of the success rate a run starts from."""
    fam = _family(family)
    total = 0.0
    for rec in fam.records(n, seed):
        answer = rec["expected"][fam.ANSWER_FILE]
        prompt, target = _encode(tok, fam.SYSTEM_PROMPT, rec["problem_statement"], answer)
        logits = model(input_ids=torch.tensor([prompt + target[:-1]])).logits[0, len(prompt) - 1:].float()
        total += float(torch.log_softmax(logits, -1).gather(1, torch.tensor(target)[:, None]).sum().exp())
    return total / n


def warm_start(model_dir: str | Path, family: str = "majority", steps: int = STEPS, *, lr: float = 1e-2,
               batch: int = 32, smoothing: float = SMOOTHING, seed: int = 0) -> dict:
    """Train the checkpoint in `model_dir` in place (module docstring); returns the stats
    written to `warm_start.json`. Raises ValueError on an unknown family or steps < 0."""
    from gyre.serving.model import load_model, load_tokenizer, weights_readable_as_config

    fam = _family(family)
    if steps < 0:
        raise ValueError(f"warm-start steps must be >= 0, got {steps}")
    out = Path(model_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same summation order on every machine
    try:
        t0 = time.monotonic()
        model = load_model(out)
        tok = load_tokenizer(out)
        rows = [_encode(tok, fam.SYSTEM_PROMPT, p, a) for p, a in fam.examples(steps * batch, seed)]
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        model.train()
        losses = []
        for k in range(steps):
            loss = -_batch_logp(model, rows[k * batch: (k + 1) * batch], smoothing).mean()  # () float32
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(round(loss.item(), 5))
        model.eval()
        success = success_rate(model, tok, family)
        model.save_pretrained(out)
        weights_readable_as_config(out)
    finally:
        torch.set_num_threads(threads)
    stats = {"family": family, "steps": steps, "lr": lr, "batch": batch, "smoothing": smoothing, "seed": seed,
             "loss": losses,
             "success": round(success, 4), "seconds": round(time.monotonic() - t0, 1)}
    (out / "warm_start.json").write_text(json.dumps(stats, indent=1) + "\n")
    return stats
