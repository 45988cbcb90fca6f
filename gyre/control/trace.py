"""The scheduler's trace (`trace.jsonl`): every fact a policy consumed and every action it
took, with the clock. docs/traces.md describes the format; this module writes and reads it.

One JSON object per line:
- line 1, the header: `{"trace": 1, "mode": ..., "config": {PolicyConfig fields},
  "options": {the mode's options}}`: enough to build a fresh policy of the same kind;
- a fact: `{"t": seconds, "fact": KIND, ...its fields}`;
- an action: `{"t": seconds, "action": KIND, ...its fields}`, after the fact that led to
  it, in the order the policy returned them. A dispatch's executions are
  `[execution, group, engine]` triples, a route's `[execution, engine]` pairs (engine null:
  paused).

`replay(lines)` feeds the facts of a trace to a fresh policy and compares its actions with
the recorded ones.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from typing import IO, Any

from gyre.control import facts as F
from gyre.control.policy import Policy, PolicyConfig

VERSION = 1


def header(policy: Policy) -> dict:
    return {"trace": VERSION, "mode": policy.mode, "config": policy.cfg.to_dict(), "options": policy.options()}


def encode(item: F.Fact | F.Action, t: float | None = None) -> dict:
    """The trace object of a fact, or of an action taken at `t`."""
    out: dict[str, Any]
    if isinstance(item, F.Fact):
        out = {"t": item.t, "fact": item.KIND}
        fields = [f.name for f in dataclasses.fields(item) if f.name != "t"]
    else:
        out = {"t": t, "action": item.KIND}
        fields = [f.name for f in dataclasses.fields(item)]
    for name in fields:
        value = getattr(item, name)
        if isinstance(item, F.Dispatch) and name == "executions":
            value = [[p.execution, p.group, p.engine] for p in value]
        elif isinstance(item, F.Reroute) and name == "routes":
            value = [[r.execution, r.engine] for r in value]
        out[name] = value
    return out


def decode(obj: dict) -> F.Fact | F.Action:
    """A fact or an action from its trace object (the action's `t` is dropped)."""
    kind = obj.get("fact") or obj.get("action")
    cls = F.KINDS.get(kind)
    if cls is None:
        raise ValueError(f"unknown trace kind {kind!r}")
    kwargs = {k: v for k, v in obj.items() if k not in ("fact", "action")}
    if "action" in obj:
        kwargs.pop("t", None)
    if cls is F.Dispatch:
        kwargs["executions"] = tuple(F.Placed(execution=e, group=g, engine=n) for e, g, n in kwargs["executions"])
    elif cls is F.Reroute:
        kwargs["routes"] = tuple(F.Route(execution=e, engine=n) for e, n in kwargs["routes"])
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in kwargs.items() if k in names})


class Writer:
    """Appends a trace to an open text file: `Writer(file, policy)`, then `write(item)`
    for every fact fed and action taken (a simulation's `observe`)."""

    def __init__(self, file: IO[str], policy: Policy) -> None:
        self.file = file
        self.t = 0.0
        file.write(json.dumps(header(policy)) + "\n")

    def write(self, item: F.Fact | F.Action) -> None:
        if isinstance(item, F.Fact):
            self.t = item.t
            self.file.write(json.dumps(encode(item)) + "\n")
        else:
            self.file.write(json.dumps(encode(item, self.t)) + "\n")


def read(lines: Iterable[str]) -> tuple[dict, Iterator[F.Fact | F.Action]]:
    """The header and the items of a trace."""
    it = (json.loads(line) for line in lines if line.strip())
    head = next(it, None)
    if not head or head.get("trace") != VERSION:
        raise ValueError(f"not a gyre trace (version {VERSION}) header: {head!r}")
    return head, (decode(obj) for obj in it)


def policy_from(head: dict) -> Policy:
    """A fresh policy as the header describes it."""
    from gyre.control.modes import make_policy

    config = dict(head["config"])
    config["cells"] = tuple(config["cells"])
    return make_policy(head["mode"], PolicyConfig(**config), **head.get("options", {}))


@dataclasses.dataclass(frozen=True)
class Mismatch:
    fact_index: int
    fact: F.Fact
    recorded: list
    replayed: list


def replay(lines: Iterable[str], *, items: Iterable[F.Fact | F.Action] | None = None) -> list[Mismatch]:
    """Feed a trace's facts to a fresh policy; the facts after which its actions differ from
    the recorded ones (empty: the trace replays exactly). `items` replaces the trace's own
    facts and actions (a what-if: one fact changed)."""
    head, recorded = read(lines)
    if items is not None:
        recorded = iter(items)
    policy = policy_from(head)
    out: list[Mismatch] = []
    fact: F.Fact | None = None
    expected: list = []
    index = -1

    def flush() -> None:
        if fact is not None:
            got = policy.on(fact)
            if got != expected:
                out.append(Mismatch(index, fact, list(expected), got))

    for item in recorded:
        if isinstance(item, F.Fact):
            flush()
            fact, expected, index = item, [], index + 1
        else:
            expected.append(item)
    flush()
    return out
