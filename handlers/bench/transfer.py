"""`gyre bench transfer` (BENCHMARKS.md): a weight snapshot pulled over Mooncake versus a
plain loopback socket copy of the same bytes between the same two processes.

- The core: a process (`python -m handlers.bench.transfer _core MIB`) holding a state dict
  of fp32 tensors of mixed sizes (`mib` MiB, seeded), exposed through the Mooncake backend
  (handlers.transfer.mooncake), and a socket server that sends the same snapshot buffer.
- The satellite: this process. Per repetition, in alternating order, it pulls the snapshot
  with Mooncake into a preallocated receive buffer, as the socket copy reads into one (timed:
  handshake and bytes; the manifest checksums are verified after the timed window) and copies it over the socket (`socket_copy`, below, printed with the
  figures), then verifies the socket's bytes against the manifest too (untimed).
- Mooncake binds every interface: the bench runs itself inside a private network namespace
  (`unshare -n`, lo up) and refuses where it cannot make one.

Keys: `weights_gb_per_s` {`mooncake`, `socket`} (10^9 bytes per second, medians, with
`_min`/`_max`), `ratio` (mooncake / socket, the median of each repetition's ratio),
`verify_s` (checksums of the whole snapshot on the reader), `profile` (where a Mooncake pull's
time goes: handshake, allocating and registering the reader's buffer, the reads, the
progress messages,
and the CPU seconds of reader and core per GB for both paths), `snapshot_mib`, `reps`,
`machine`. Target: ratio ≥ 0.8 (acceptance ≥ 0.5).
"""
from __future__ import annotations

import argparse
import inspect
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import orjson

SLICE = 4 << 20


# -- the socket baseline (printed with the figures) ---------------------------------------------
def socket_send(conn: socket.socket, buf: memoryview) -> None:
    """The core's side: the snapshot's buffer with sendall in 4 MiB slices."""
    for start in range(0, len(buf), SLICE):
        conn.sendall(buf[start:start + SLICE])


def socket_copy(port: int, into: bytearray) -> float:
    """The satellite's side: recv_into a preallocated buffer; returns the seconds from
    connect to the last byte."""
    view, got = memoryview(into), 0
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        while got < len(into):
            k = sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError(f"socket copy short: {got} of {len(into)} bytes")
            got += k
        elapsed = time.perf_counter() - started
        sock.sendall(b"\x01")
    return elapsed


def state_dict(mib: int, seed: int = 0) -> dict[str, np.ndarray]:
    """fp32 tensors of mixed sizes (a model's shape: a few large, many small), `mib` MiB."""
    rs = np.random.default_rng(seed)
    total = (mib << 20) // 4
    sizes, left, i = [], total, 0
    while left > 0:
        k = min(left, max(1024, int(total * (0.25 if i < 2 else 0.04) * rs.uniform(0.5, 1.0))))
        sizes.append(k)
        left -= k
        i += 1
    return {f"layers.{i}.weight": rs.standard_normal(k, dtype=np.float32) for i, k in enumerate(sizes)}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# -- the core process ----------------------------------------------------------------------------------
def core(mib: int) -> None:
    from handlers.transfer.mooncake import MooncakeTransfer

    transfer = MooncakeTransfer(lease_s=120.0, timeout_s=300.0)
    ref = transfer.expose("weights-v1", state_dict(mib))
    warm = transfer.expose("warmup", state_dict(4, seed=1))
    buf = memoryview(transfer._snapshots["weights-v1"][1])
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                socket_send(conn, buf)
                conn.recv(1)

    threading.Thread(target=serve, daemon=True).start()
    print(orjson.dumps({"key": ref.key, "digest": ref.digest, "warm_key": warm.key, "warm_digest": warm.digest,
                        "port": server.getsockname()[1]}).decode(), flush=True)
    for line in sys.stdin:
        if line.strip() == "cpu":
            print(orjson.dumps({"cpu_s": _cpu()}).decode(), flush=True)
        else:
            break
    transfer.close()


# -- the satellite: the measurement ------------------------------------------------------------------
def run_bench(mib: int, reps: int, log=print) -> dict:
    from gyre.transfer.interface import TransferRef
    from gyre.transfer.manifest import Manifest, verify
    from handlers.bench.proxy import machine
    from handlers.transfer.mooncake import MooncakeTransfer

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, "-m", "handlers.bench.transfer", "_core", str(mib)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        while line and not line.startswith("{"):
            line = proc.stdout.readline()
        info = orjson.loads(line)

        def core_cpu() -> float:
            proc.stdin.write("cpu\n")
            proc.stdin.flush()
            reply = proc.stdout.readline()
            while not reply.startswith("{"):
                reply = proc.stdout.readline()
            return orjson.loads(reply)["cpu_s"]

        reader = MooncakeTransfer(lease_s=120.0, timeout_s=300.0)
        ref = TransferRef(info["key"], info["digest"])
        reader.pull(TransferRef(info["warm_key"], info["warm_digest"]), "satellite")  # the session's first contact
        total_bytes = manifest_bytes(reader, ref)
        into = bytearray(total_bytes)  # preallocated, as the socket copy's buffer is
        rows: list[dict] = []
        for rep in range(reps):
            row: dict = {}
            order = ("mooncake", "socket") if rep % 2 == 0 else ("socket", "mooncake")
            for path in order:
                cpu0, core0 = _cpu(), core_cpu()
                if path == "mooncake":
                    timings: dict = {}
                    tensors = reader.pull(ref, "satellite", timings=timings, into=into)
                    seconds = timings["handshake_s"] + timings["fetch_s"]
                    total = sum(int(a.nbytes) for a in tensors.values())
                    row["profile"] = {k: timings[k] for k in ("handshake_s", "alloc_s", "register_s", "read_s",
                                                              "progress_s", "verify_s")}
                    row["profile"]["slices"] = timings["slices"]
                    row["verify_s"] = timings["verify_s"]
                    del tensors
                else:
                    buf = bytearray(total_bytes)
                    seconds = socket_copy(info["port"], buf)
                    total = len(buf)
                cpu1, core1 = _cpu(), core_cpu()
                row[path] = total / 1e9 / seconds
                row[f"{path}_cpu_per_gb"] = {"satellite": (cpu1 - cpu0) / (total / 1e9),
                                             "core": (core1 - core0) / (total / 1e9)}
                if path == "socket":  # the same bytes: verified against the manifest, untimed
                    verify(Manifest.from_json(_manifest_json(reader, ref)), buf)
                    del buf
            row["ratio"] = row["mooncake"] / row["socket"]
            rows.append(row)
            log(f"rep {rep + 1}/{reps}: mooncake {row['mooncake']:.3f} GB/s, socket {row['socket']:.3f} GB/s, "
                f"ratio {row['ratio']:.2f}")
        reader.close()
    finally:
        try:
            proc.stdin.write("quit\n")
            proc.stdin.flush()
            proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
    return figures(rows, mib, reps, machine())


def _manifest_json(reader, ref) -> bytes:
    """The snapshot's manifest, asked of the core over the control protocol (no bytes)."""
    from handlers.transfer.loopback import _recv_frame, _say, _send_frame, parse_key

    host, port, name = parse_key(ref.key, reader.scheme)
    with socket.create_connection((host, port), timeout=30) as sock:
        _send_frame(sock, {"name": name, "reader": "bench-manifest"})
        head = _recv_frame(sock)
        _say(sock, b"\x00")
    return head["manifest"].encode()


def manifest_bytes(reader, ref) -> int:
    from gyre.transfer.manifest import Manifest

    return Manifest.from_json(_manifest_json(reader, ref)).total_bytes


def _stat(values: list[float], key: str, digits: int = 4) -> dict:
    return {key: round(statistics.median(values), digits), f"{key}_min": round(min(values), digits),
            f"{key}_max": round(max(values), digits)}


def figures(rows: list[dict], mib: int, reps: int, machine: dict) -> dict:
    gbps = {}
    for path in ("mooncake", "socket"):
        gbps.update(_stat([r[path] for r in rows], path))
    profile = {k: round(statistics.median(r["profile"][k] for r in rows), 4)
               for k in ("handshake_s", "alloc_s", "register_s", "read_s", "progress_s", "verify_s", "slices")}
    for path in ("mooncake", "socket"):
        for side in ("satellite", "core"):
            profile[f"{path}_{side}_cpu_s_per_gb"] = round(statistics.median(r[f"{path}_cpu_per_gb"][side]
                                                                             for r in rows), 3)
    return {"weights_gb_per_s": gbps, **_stat([r["ratio"] for r in rows], "ratio", 3),
            **_stat([r["verify_s"] for r in rows], "verify_s"), "profile": profile, "snapshot_mib": mib,
            "reps": reps, "target_ratio": 0.8, "acceptance_ratio": 0.5, "machine": machine,
            "socket_baseline_code": inspect.getsource(socket_send) + "\n" + inspect.getsource(socket_copy)}


def format_table(doc: dict) -> str:
    g, p = doc["weights_gb_per_s"], doc["profile"]
    lines = [f"gyre bench transfer: {doc['snapshot_mib']} MiB fp32 snapshot, core → satellite, {doc['reps']} reps "
             "(median [min–max])",
             f"  mooncake (TCP)  {g['mooncake']:.3f} GB/s [{g['mooncake_min']:.3f}–{g['mooncake_max']:.3f}]",
             f"  socket          {g['socket']:.3f} GB/s [{g['socket_min']:.3f}–{g['socket_max']:.3f}]",
             f"  ratio           {doc['ratio']:.2f} [{doc['ratio_min']:.2f}–{doc['ratio_max']:.2f}]  "
             f"(target ≥ 0.8, acceptance ≥ 0.5)",
             f"  verify_s        {doc['verify_s']:.3f} s (xxh3 of every tensor, reader)",
             f"  profile (mooncake pull): handshake {p['handshake_s']:.4f} s, buffer {p['alloc_s']:.4f} s, "
             f"register {p['register_s']:.4f} s, "
             f"reads {p['read_s']:.3f} s in {p['slices']:.0f} slices, progress {p['progress_s']:.4f} s",
             f"  CPU s per GB: mooncake satellite {p['mooncake_satellite_cpu_s_per_gb']:.2f} / core "
             f"{p['mooncake_core_cpu_s_per_gb']:.2f}; socket satellite {p['socket_satellite_cpu_s_per_gb']:.2f} / core "
             f"{p['socket_core_cpu_s_per_gb']:.2f}",
             "  socket baseline code:", *("    " + line for line in doc["socket_baseline_code"].splitlines())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_core"]:
        core(int(argv[1]))
        return 0
    p = argparse.ArgumentParser(prog="gyre bench transfer", description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON to PATH")
    p.add_argument("--mib", type=int, default=256, help="snapshot size in MiB (default 256)")
    p.add_argument("--reps", type=int, default=3, help="repetitions, interleaved (default 3, as BENCHMARKS.md fixes)")
    a = p.parse_args(argv)
    from handlers.transfer.mooncake import MooncakeUnavailable, available, namespace_command, private_namespace

    if not private_namespace():
        if os.environ.get("GYRE_BENCH_NAMESPACE") == "1":
            print("gyre bench transfer: still not in a private network namespace", file=sys.stderr)
            return 2
        why = available()
        inner = ["--mib", str(a.mib), "--reps", str(a.reps)]
        if a.json:  # the namespace shares the file system: write where the caller asked
            inner += ["--json", str(Path(a.json).resolve())]
        try:
            cmd = namespace_command([sys.executable, "-m", "handlers.bench.transfer", *inner])
        except MooncakeUnavailable as exc:
            why = why or str(exc)
        if why:
            print(f"gyre bench transfer: {why}", file=sys.stderr)
            return 2
        env = dict(os.environ, GYRE_BENCH_NAMESPACE="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]),
                   GLOG_minloglevel="2")
        return subprocess.run(cmd, env=env).returncode
    import logging

    from handlers.daemon import configure_logging

    configure_logging("bench", level=logging.WARNING)
    doc = run_bench(a.mib, a.reps, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_table(doc))
    if a.json:
        Path(a.json).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
