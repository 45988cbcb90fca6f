"""`gyre bench proxy --smoke`: the benchmark's whole code path (nats-server, instant engine,
proxy process, load generator, JetStream count of stored calls) in seconds. The figures
of a smoke run mean nothing; only their presence and the stored-call check are asserted."""
from __future__ import annotations

import json

from handlers import bench_proxy


def test_bench_proxy_smoke(tmp_path):
    out = tmp_path / "bench.json"
    assert bench_proxy.main(["--smoke", "--json", str(out), "--workdir", str(tmp_path / "work")]) == 0
    result = json.loads(out.read_text())
    assert result["machine"]["cpus"] >= 1
    assert result["config"]["completion_tokens"] == bench_proxy.COMPLETION_TOKENS
    for variant in bench_proxy.VARIANTS:
        figures = result[variant]
        if figures.get("skipped"):
            continue
        assert set(figures) >= {"added_latency_ms_p50", "added_latency_ms_p99", "calls_per_s"}
        assert figures["errors"] == 0, figures["error_samples"]
        assert figures["unstored"] == 0 and figures["answered"] > 0
        assert figures["latency_calls"] > 0 and figures["direct_calls"] > 0 and figures["throughput_calls"] > 0
    assert not result["chat"].get("skipped")
