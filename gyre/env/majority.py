"""The `majority` task family: a verifiable toy task that a small policy learns in minutes.

An instance is a row of `LENGTH` digits in which one digit (the answer) appears `MAJORITY`
times and the others are drawn from the nine remaining digits; the problem statement asks
which digit appears most often, and the answer is that digit alone. Instances differ in
their answers (each of the ten digits is the answer of about a tenth of them), so a
constant answer scores about 0.1; the exact answer is checked in the evaluator's process
(`Task.expected`, `answer.txt`, which the toy harness writes).

Why this task: the embedded model is tiny (two layers of width 64 on Qwen's 151,936-token
vocabulary). What it learns fastest is its output distribution (that an answer is a digit,
then `<|im_end|>`); what depends on the prompt comes slower. When most of the prompt is
the answer digit, the attention average at the answer position already carries it and the
tied output layer can read it back, so the dependence on the prompt forms within a few
hundred updates. A label-smoothed supervised warm start (`gyre.learning.warm_start`) leaves
the policy knowing the answer but often answering with no digit (success 5%–50%), and
GSPO takes it from there.

Pure and seeded: `records(n, seed)` (the bundled `majority.jsonl` is `records(N_TASKS, 0)`,
`python -m gyre.env.majority` prints it), `examples(n, seed)` (warm-start pairs from a
stream of their own, never the bundled tasks' stream).
"""
from __future__ import annotations

import json
import random
import sys

SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly."
"""The toy harness's system message (gyre/env/data/harness/toy_harness.py): the warm start
renders its prompts exactly as the harness's calls reach the policy."""
LENGTH = 12
MAJORITY = 9
N_TASKS = 512
ANSWER_FILE = "answer.txt"


def instance(rng: random.Random) -> tuple[str, str]:
    """One instance: (digits as a string of LENGTH characters, the answer digit)."""
    answer = rng.randrange(10)
    others = [d for d in range(10) if d != answer]
    digits = [answer] * MAJORITY + [rng.choice(others) for _ in range(LENGTH - MAJORITY)]
    rng.shuffle(digits)
    return "".join(map(str, digits)), str(answer)


def problem_statement(digits: str) -> str:
    """The task text the harness sends as the user message."""
    return "Which digit appears most often: " + " ".join(digits) + "?"


def records(n: int = N_TASKS, seed: int = 0) -> list[dict]:
    """n task records (gyre.env.tasks format) drawn with `seed`: ids `majority-0000`…,
    an exact answer in `answer.txt`, no hidden tests."""
    rng = random.Random(f"majority:tasks:{seed}")
    out = []
    for i in range(n):
        digits, answer = instance(rng)
        out.append({"instance_id": f"majority-{i:04d}", "problem_statement": problem_statement(digits),
                    "expected": {ANSWER_FILE: answer}, "timeout_s": 60, "difficulty": "easy",
                    "tags": ["majority", "toy"]})
    return out


def examples(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """n (problem statement, answer) pairs for a supervised warm start, drawn from a
    stream seeded apart from `records`'."""
    rng = random.Random(f"majority:warm-start:{seed}")
    return [(problem_statement(d), a) for d, a in (instance(rng) for _ in range(n))]


def main() -> int:
    for rec in records():
        sys.stdout.write(json.dumps(rec, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
