"""`gyre bench chaos`'s parts that need no run: the supervisor restarts what exited (and tells
a crash from a kill), the recovery time read from a restarted daemon's log, and which part
of a log its current process wrote. The whole bench runs in `gyre bench chaos` itself; the
same kills and audit run in tests/test_crash_daemons.py (slow)."""
from __future__ import annotations

import time

from handlers.bench import chaos


def test_the_supervisor_restarts_a_killed_and_a_crashed_daemon_after_its_delay(tmp_path, monkeypatch):
    (tmp_path / "logs").mkdir()
    monkeypatch.setitem(chaos.MODULES, "zen", ("this",))  # prints and exits 0: a crash to a supervisor
    monkeypatch.setitem(chaos.MODULES, "sleeper", ("chaos_sleeper",))  # runs until killed
    (tmp_path / "chaos_sleeper.py").write_text("import time\ntime.sleep(120)\n")
    sup = chaos.Supervisor(tmp_path, restart_s=0.3)
    sup.env["PYTHONPATH"] = str(tmp_path)
    sup.start("zen")
    sup.start("sleeper")
    try:
        deadline = time.monotonic() + 20
        while sup.procs["zen"].poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        assert sup.procs["sleeper"].poll() is None
        sup.kill9("sleeper")
        sup.tend()  # both noticed; neither restarted before restart_s
        assert set(sup.exited) == {"zen", "sleeper"} and sup.crashes == [("zen", 0)]
        time.sleep(0.4)
        sup.tend()
        assert not sup.exited and len(sup.restarts["zen"]) == len(sup.restarts["sleeper"]) == 2
        assert sup.procs["sleeper"].poll() is None
    finally:
        sup.stop()
    assert "Beautiful is better than ugly" in sup.log("zen")


def test_recovery_is_the_time_to_the_restarted_daemons_first_handled_message(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "builder.log").write_text(
        '{"event":"daemon.metrics","timestamp":"2026-12-07T10:00:00Z"}\n'
        '{"event":"bus.message.handled","timestamp":"2026-12-07T10:00:05Z"}\n'
        '{"event":"daemon.metrics","timestamp":"2026-12-07T10:00:11Z"}\n'
        '{"event":"bus.message.handled","timestamp":"2026-12-07T10:00:14.5Z"}\n')
    sup = chaos.Supervisor(tmp_path)
    wall = 1796637610.0  # 2026-12-07T10:00:10Z
    assert chaos.recovery(sup, [{"daemon": "builder", "wall": wall}, {"daemon": "proxy", "wall": wall}]) == {
        "builder": {"p50": 4.5, "max": 4.5, "n": 1}}
    log = sup.log("builder")
    assert chaos.current_process(log).startswith('{"event":"daemon.metrics","timestamp":"2026-12-07T10:00:11Z"}')
    assert chaos.current_process("no start line\n") == "no start line\n"
