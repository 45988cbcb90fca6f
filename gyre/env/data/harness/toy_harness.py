"""gyre's toy harness: a real OpenAI Chat Completions client in one file (stdlib only).

Reads the task from --task-file, asks the model through $OPENAI_BASE_URL with
$OPENAI_API_KEY (non-streaming `POST /chat/completions`), optionally asks once more with
the first answer in the history (so the second call's prompt extends the first call's
prompt + answer, like an agent loop), and writes the last answer's text, unchanged, to
`answer.txt` in the working directory. Exit 0 on success, 1 when a call fails.

    python toy_harness.py --task-file TASK.md --model MODEL [--calls 2] [--max-tokens N]
"""
import argparse
import json
import os
import sys
import urllib.error
import urllib.request

FOLLOW_UP = "Now give your final answer only."


def chat(base_url, key, body, timeout_s):
    req = urllib.request.Request(
        base_url.rstrip("/") + "/chat/completions", data=json.dumps(body).encode("utf-8"), method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read().decode("utf-8"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task-file", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--calls", type=int, default=2, choices=(1, 2))
    p.add_argument("--max-tokens", type=int, default=0, help="0 = let the server decide")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per call")
    a = p.parse_args(argv)
    base_url = os.environ.get("OPENAI_BASE_URL", "")
    key = os.environ.get("OPENAI_API_KEY", "")
    if not base_url or not key:
        print("toy_harness: OPENAI_BASE_URL and OPENAI_API_KEY must be set", file=sys.stderr)
        return 1
    with open(a.task_file, encoding="utf-8") as fh:
        task = fh.read()
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
                {"role": "user", "content": task}]
    answer = ""
    for i in range(a.calls):
        body = {"model": a.model, "messages": messages}
        if a.max_tokens > 0:
            body["max_tokens"] = a.max_tokens
        try:
            reply = chat(base_url, key, body, a.timeout)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            detail = exc.read().decode("utf-8", "replace")[:500] if isinstance(exc, urllib.error.HTTPError) else ""
            print(f"toy_harness: call {i} failed: {exc} {detail}", file=sys.stderr)
            return 1
        answer = (reply.get("choices") or [{}])[0].get("message", {}).get("content") or ""
        print(f"toy_harness: call {i}: {answer!r}", flush=True)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
    with open("answer.txt", "w", encoding="utf-8") as fh:
        fh.write(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
