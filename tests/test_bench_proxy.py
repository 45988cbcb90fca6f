"""`gyre bench proxy --smoke`: the benchmark's whole code path (nats-server, instant engine,
proxy process, load generator, JetStream count of stored calls) in seconds. The figures
of a smoke run mean nothing; only their presence and the stored-call check are asserted."""
from __future__ import annotations

import contextlib
import io
import json
import os
import time

import orjson
import pytest

from handlers.bench import proxy as bench_proxy
from handlers.bench import proxy_load


def test_bench_proxy_smoke(tmp_path):
    out = tmp_path / "bench.json"
    variants = bench_proxy.VARIANTS + bench_proxy.EXTRA_VARIANTS
    printed = io.StringIO()  # not capsys: main configures structlog on the stderr it finds, which must outlive this test
    with contextlib.redirect_stdout(printed):
        assert bench_proxy.main(["--smoke", "--json", str(out), "--workdir", str(tmp_path / "work"),
                                 "--variants", ",".join(variants)]) == 0
    result = json.loads(out.read_text())
    table = printed.getvalue().splitlines()  # the table BENCHMARKS.md asks every bench to print
    rows = {line.split()[0]: line.split() for line in table if line and line.split()[0] in (*variants, "floor")}
    assert set(rows) == {*variants, "floor"} and table[-1] == f"wrote {out}"
    assert float(rows["chat"][1]) == round(result["chat"]["added_latency_ms_p50"], 2)
    assert result["machine"]["cpus"] >= 1
    assert result["config"]["completion_tokens"] == proxy_load.COMPLETION_TOKENS
    for variant in variants:
        figures = result[variant]
        if figures.get("skipped"):
            continue
        assert set(figures) >= {"added_latency_ms_p50", "added_latency_ms_p99", "calls_per_s"}
        assert figures["errors"] == 0, figures["error_samples"]
        assert figures["unstored"] == 0 and figures["answered"] > 0
        (rep,) = figures["reps"]  # --smoke: one repetition
        assert rep["latency_calls"] > 0 and rep["direct_calls"] > 0 and rep["throughput_calls"] > 0
        assert figures["added_latency_ms_p50"] == rep["added_latency_ms"]["p50"]
        if os.path.exists("/proc/self/stat"):  # the proxy's CPU per answered call (a few ticks in a smoke run)
            assert figures["proxy_cpu_ms_per_call"] >= 0 and figures["proxy_cpu_ms_per_call_saturated"] > 0
    assert not result["chat"].get("skipped") and not result["responses"].get("skipped")
    floor = result["floor"]  # the bare pass-through against the engine, same load
    (rep,) = floor["reps"]
    assert rep["latency_calls"] > 0 and rep["direct_calls"] > 0 and rep["throughput_calls"] > 0
    assert floor["added_latency_ms_p50"] == rep["added_latency_ms"]["p50"]
    assert floor["calls_per_s"] == rep["calls_per_s"] > 0  # the closed loop through the pass-through
    assert floor["errors"] == 0, floor["error_samples"]
    assert not set(floor) & set(bench_proxy.CPU_KEYS)  # no proxy in the floor's path


def test_the_table_shows_failed_and_unstored_calls_and_why_a_variant_was_skipped():
    result = {"chat": {"added_latency_ms_p50": 1.5, "added_latency_ms_p99": 5.0, "calls_per_s": 1200.0,
                       "errors": 7, "unstored": 42},
              "messages": {"skipped": "the proxy answered 404"}, "machine": {}, "wall_s": 1.0}
    rows = {line.split()[0]: line for line in bench_proxy.format_table(result).splitlines()}
    assert rows["chat"].split()[-2:] == ["7", "42"]
    assert rows["messages"].endswith("skipped: the proxy answered 404")


def test_variant_figures_are_medians_over_repetitions():
    def rep(p50, p99, cps, cpu=None, cpu_sat=None):
        return {"added_latency_ms": {"p50": p50, "p90": 0.0, "p99": p99}, "calls_per_s": cps, "errors": 0,
                "error_samples": [], "proxy_cpu_ms_per_call": cpu, "proxy_cpu_ms_per_call_saturated": cpu_sat}

    out = bench_proxy._variant_figures([rep(4.0, 30.0, 500.0, 2.0, 1.5), rep(9.0, 20.0, 450.0, 2.4, None),
                                        rep(5.0, 90.0, 600.0, 2.2, 1.7)])
    assert out["added_latency_ms_p50"] == 5.0 and out["added_latency_ms_p50_min"] == 4.0
    assert out["added_latency_ms_p50_max"] == 9.0
    assert out["added_latency_ms_p99"] == 30.0 and out["calls_per_s"] == 500.0 and len(out["reps"]) == 3
    assert out["proxy_cpu_ms_per_call"] == 2.2 and out["proxy_cpu_ms_per_call_min"] == 2.0
    assert out["proxy_cpu_ms_per_call_max"] == 2.4
    # a repetition without a figure (no /proc, a profiled proxy) is left out of the median
    assert out["proxy_cpu_ms_per_call_saturated"] == 1.6 and out["proxy_cpu_ms_per_call_saturated_max"] == 1.7
    none = bench_proxy._variant_figures([rep(4.0, 30.0, 500.0)])
    assert none["proxy_cpu_ms_per_call"] is None and none["proxy_cpu_ms_per_call_saturated"] is None


@pytest.mark.parametrize("variant", bench_proxy.VARIANTS + bench_proxy.EXTRA_VARIANTS)
def test_every_variant_sends_the_prompt_of_the_direct_path(variant):
    """Call k of a simulated execution, parsed as the proxy parses its API and rendered,
    is the pre-tokenised prompt the direct path sends for k: the two paths carry the same
    tokens. Its answer (the proxy's own frames for the engine's completion) is read back
    into the history the next call extends."""
    from gyre.serving.chat import parse_completion, render
    from gyre.serving.tokenizer import build_tokenizer
    from handlers.proxy.call import CHAT, MESSAGES, RESPONSES
    from handlers.proxy.anthropic import parse_messages_request
    from handlers.proxy.api import Answer, StreamStart
    from handlers.proxy.openai import parse_chat_request
    from handlers.proxy.responses import parse_responses_request
    from schemas.call import SamplingParams

    tok = build_tokenizer()
    w = proxy_load.Workload.build(tok)
    prompts = proxy_load.direct_prompts(tok, w)
    conv = proxy_load.Conversation(variant, w, "e")
    parse = {"chat": parse_chat_request, "messages": parse_messages_request, "responses": parse_responses_request}
    api = {"chat": CHAT, "messages": MESSAGES, "responses": RESPONSES}[conv.api]
    conv.fast_forward(3)
    for k in (3, 4, 5):
        req = parse[conv.api](json.loads(conv.body()), SamplingParams())
        assert tok(render(tok, req.messages, req.tools, True), add_special_tokens=False)["input_ids"] == prompts[k]
        parsed = parse_completion(w.completion_text, id_prefix=api.tool_id_prefix(f"r:e:{k}"))
        start = StreamStart(rid=api.new_id(), created=0, model="gyre", prompt_tokens=len(prompts[k]))
        answer = Answer(content=parsed.content, reasoning=parsed.reasoning, tool_calls=parsed.tool_calls,
                        finish="stop", prompt_tokens=len(prompts[k]), completion_tokens=len(w.completion_ids),
                        rid=start.rid, created=0)
        frames = api.render(answer, req)
        raw = b"".join(api.preamble(start, req) + frames) if req.stream else orjson.dumps(frames)
        conv.answer(raw)
    assert conv.calls == 6


@pytest.mark.parametrize("args, says", [
    (["--reps", "0"], "reps"), (["--duration-s", "0"], "duration_s"), (["--executions", "0"], "executions"),
    (["--concurrency", "-1"], "concurrency"), (["--variants", ","], "--variants"),
    (["--variants", "chat,nope"], "nope"), (["--profile", "/nonexistent-gyre-dir/x.prof"], "--profile")])
def test_bench_arguments_are_checked_before_anything_starts(args, says, capsys):
    """An explicit value is validated, never swapped for the default; the error is a
    one-line usage error (exit 2), before any process starts."""
    with pytest.raises(SystemExit) as exc:
        bench_proxy.main(args)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


async def test_failed_calls_are_counted_not_fatal():
    """A path that answers 500 (or drops the connection) is counted in the run's errors,
    with samples; the run goes on instead of ending the whole bench without figures."""
    import random

    import aiohttp
    from aiohttp import web

    from tests.test_proxy_apis import serve

    async def fail(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    app = web.Application()
    app.router.add_post("/generate", fail)
    runner, url = await serve(app)
    try:
        async with aiohttp.ClientSession() as session:
            prompts = [[1, 2, 3]] * proxy_load.CALLS_PER_EXECUTION
            load = proxy_load.Load(session, "", url, None, prompts, None, "r")
            stats = await load.run_direct(4, 0.01, 0.3, random.Random(0))
            assert stats.errors > 0 and stats.calls == 0 and stats.error_samples[0].startswith("500 ")
            gone = await load.run_direct(2, 0.01, 0.2, random.Random(0), url="http://127.0.0.1:1")
            assert gone.errors > 0 and gone.error_samples[0].startswith("0 ")
    finally:
        await runner.cleanup()


def test_process_cpu_s_reads_a_process_cpu_time():
    if not os.path.exists("/proc/self/stat"):
        assert proxy_load.process_cpu_s(os.getpid()) is None
        return
    before = proxy_load.process_cpu_s(os.getpid())
    deadline = time.process_time() + 0.1
    while time.process_time() < deadline:  # 100 ms of CPU: ten clock ticks
        pass
    after = proxy_load.process_cpu_s(os.getpid())
    assert 0.05 <= after - before <= 5.0
    assert proxy_load.process_cpu_s(None) is None
    assert proxy_load.process_cpu_s(2**22 + 12345) is None  # above pid_max: no such process
