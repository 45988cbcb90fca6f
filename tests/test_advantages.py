"""Group-relative advantages against hand-worked numbers (DESIGN.md "Learning")."""
from __future__ import annotations

import math

import pytest

from gyre.trajectory.advantages import group_advantages


def test_two_executions():
    # mean 0.5, std = sqrt((0.25 + 0.25) / 1) = 0.70711 → A = ±0.70711
    a = group_advantages({"e1": 1.0, "e2": 0.0})
    assert a["e1"] == pytest.approx(1 / math.sqrt(2))
    assert a["e2"] == pytest.approx(-1 / math.sqrt(2))


def test_placeholder_counts_and_excluded_leaves():
    # Remaining: a=1, b=0, c=0.5, p=0 (placeholder); d excluded.
    # mean = 1.5 / 4 = 0.375; squared deviations .390625 + .140625 + .015625 + .140625 = .6875
    # std = sqrt(.6875 / 3) = 0.4787136; A_a = .625 / std = 1.3055824, A_b = -.375 / std = -0.7833495,
    # A_c = .125 / std = 0.2611165. p and d get no entry.
    a = group_advantages({"a": 1.0, "b": 0.0, "c": 0.5, "d": None, "p": 0.0}, placeholders={"p"})
    assert set(a) == {"a", "b", "c"}
    assert a["a"] == pytest.approx(1.3055824, abs=1e-6)
    assert a["b"] == pytest.approx(-0.7833495, abs=1e-6)
    assert a["c"] == pytest.approx(0.2611165, abs=1e-6)


def test_placeholder_only_in_set():
    # e=1 and placeholder p=0: mean .5, std .70711 → A_e = .70711
    a = group_advantages({"e": 1.0}, placeholders=["p"])
    assert a == {"e": pytest.approx(1 / math.sqrt(2))}


def test_zero_variance_and_too_few_give_zero():
    assert group_advantages({"a": 0.7, "b": 0.7, "c": 0.7}) == {"a": 0.0, "b": 0.0, "c": 0.0}
    assert group_advantages({"a": 1.0, "b": None}) == {"a": 0.0}
    assert group_advantages({"a": 1.0}) == {"a": 0.0}
    assert group_advantages({"a": 0.0}, placeholders={"p"}) == {"a": 0.0}  # std 0
    assert group_advantages({}) == {}


def test_advantages_sum_to_zero_without_placeholders():
    a = group_advantages({f"e{i}": r for i, r in enumerate([0.1, 0.9, 0.4, 0.4, 1.0])})
    assert sum(a.values()) == pytest.approx(0.0, abs=1e-12)


def test_non_finite_reward_raises():
    with pytest.raises(ValueError):
        group_advantages({"a": float("nan"), "b": 0.0})
