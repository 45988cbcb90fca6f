"""Progress bars for commands that run for minutes (tqdm), quiet when stderr is no terminal.

`bar(iterable, total=None, desc="")` wraps an iterable: on a terminal it draws a bar with
the count, rate and an estimate of the time left on stderr; in a pipe, a log or a test it
draws nothing and yields the same items. GYRE_PROGRESS=1 forces the bar, 0 hides it.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def enabled() -> bool:
    forced = os.environ.get("GYRE_PROGRESS")
    if forced in ("0", "1"):
        return forced == "1"
    return sys.stderr.isatty()


def bar(iterable: Iterable[T], total: int | None = None, desc: str = "") -> Iterator[T]:
    """`iterable`'s items, with a bar on stderr when `enabled()`."""
    if not enabled():
        yield from iterable
        return
    with tqdm(iterable, total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True) as items:
        yield from items
