"""The Mooncake path, in the default run: tests/ns_mooncake.py's tests run with pytest inside
a private network namespace (tests/namespace.py), and each must pass there."""
from __future__ import annotations

from pathlib import Path

from tests.namespace import missing, run_module, skip_or_fail

HERE = Path(__file__).resolve().parent


def test_mooncake_tests_pass_inside_a_private_network_namespace(tmp_path):
    why = missing()
    if why is not None:
        skip_or_fail(why)
    outcomes = run_module(HERE / "ns_mooncake.py", tmp_path, timeout_s=400)
    assert outcomes, "no test ran inside the namespace"
    bad = {name: outcome for name, outcome in outcomes.items() if outcome != "passed"}
    assert not bad, "\n\n".join(f"{name}: {outcome}" for name, outcome in bad.items())


def test_mooncake_refuses_to_start_outside_a_private_network_namespace():
    import pytest

    from handlers.transfer import make_backend
    from handlers.transfer.mooncake import MooncakeUnavailable, available, private_namespace

    why = available()
    if why is not None:
        skip_or_fail(why)
    if private_namespace():
        pytest.skip("this process already runs in a private network namespace")
    with pytest.raises(MooncakeUnavailable, match="private network namespace.*transfer_cluster = true"):
        make_backend("mooncake")
