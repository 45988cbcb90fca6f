"""Encoding a 3 MB tool output (40,000 `ls -l` lines) with gyre's encoder, all NFC and with one
decomposed character (U+0301) on its last line (gyre.serving.tokenizer.FastEncoder: only the run of
lines that is not NFC goes to the HF encoder).

    .venv/bin/python -m handlers.bench.probes.nfd_encode_cost      (from the repository root)
"""
import argparse
import random
import time

from gyre.serving import tokenizer as q


def main() -> None:
    tok = q.build_tokenizer()
    enc = q.fast_encoder(tok)
    rng = random.Random(0)
    lines = [f"-rw-r--r-- 1 agent agent {rng.randint(100, 99999)} Nov {rng.randint(1, 30)} "
             f"src/mod_{i}.py  # value error test" for i in range(40000)]
    base = "<|im_start|>user\n<tool_response>\n" + "\n".join(lines) + "\n"
    for tail in ("cafe.txt\n", "cafe\u0301.txt\n"):
        text = base + tail + "</tool_response><|im_end|>\n<|im_start|>assistant\n"
        t = time.perf_counter()
        ids = enc.array(text)
        dt = time.perf_counter() - t
        kind = 'NFD' if len(tail) > 9 else 'NFC'
        print(f"{len(text)/1e6:.1f} MB, {kind} tail: {len(ids):,} ids in {dt*1e3:.0f} ms")


if __name__ == "__main__":
    argparse.ArgumentParser(prog="python -m handlers.bench.probes.nfd_encode_cost",
                            description=__doc__.split("\n\n")[0]).parse_args()
    main()
