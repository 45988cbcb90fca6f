"""The engine-host interface: how a cell holds the engine it serves with.

A cell (handlers/cell.py) holds its engine only through an `EngineHost`: the embedded
engine behind SGLang's native HTTP API (`handlers.engines.embedded.EmbeddedHost`), the
scripted engine (`handlers.engines.scripted.ScriptedEngine`, for tests of real harnesses a
random model cannot drive), and later a cluster backend (SGLang). The recipe's
`engine.kind` picks one (`handlers.engines.hosts.make_host`).

Contract:
- `start(host, port)` binds the HTTP server (0 = a free port) and returns its base URL, also
  `url`; `stop()` unbinds it. The server stays bound in every role.
- `set_serving(on)`: whether `/generate` and `/health` answer (off: 503, so the proxy waits
  or reroutes); `serving` reads it.
- `version`: the policy version of the weights served (the last loaded while released).
- `drain(timeout_s)`: abort the calls in flight and wait up to `timeout_s` for them to end,
  each execution's prefix KV kept (a cell leaving rollout, before it hands that KV over);
  returns whether none is left.
- `release()` frees the engine's state, its weights and every prefix KV cache (DESIGN.md
  "Cells and engines": a cell leaving rollout), aborting the calls in flight; `released`
  says so; until a load, no call is served.
- `load_tensors(tensors, version)`: load a verified snapshot (named arrays, gyre.transfer)
  between two decode steps; `load_weights(path, version)`: a checkpoint directory. Either
  always loads into a released engine, whatever the version. Raise
  `gyre.serving.engine.WeightLoadError` when the weights do not fit, leaving the engine as it was.
- `export_kv(execution)` / `import_kv(execution, blocks)`: an execution's prefix KV cache as
  `gyre.serving.kv.KvBlocks` (None / False for an engine that keeps none).
- `set_kv_hold(hold)`: after `start`, `await hold(execution, cell, route)` runs before a
  request that names where its execution's KV blocks come from (`gyre_kv_from`, the proxy's
  hint for a moved execution) and returns once they are imported or will not come (the
  cell's handlers.transfer.kv_move.KvMoves.hold). An engine that keeps no KV ignores the
  hook and the hint.
- `counters()`: monotonic counts over the engine's life, which a test or a metric reads
  (also on the server's `GET /get_model_info`): `prefill_tokens` (prompt ids run through the
  model; a cached or imported prefix is not), `kv_imported_tokens` (positions of imported KV
  blocks kept), `kv_dropped` (imported blocks of another policy version dropped).
The blocking methods (`drain`, `release`, the loads, the KV ones) are thread-safe; callers run
them in worker threads.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

from gyre.serving.kv import KvBlocks


@runtime_checkable
class EngineHost(Protocol):
    url: str

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str: ...

    async def stop(self) -> None: ...

    def set_serving(self, on: bool) -> None: ...

    @property
    def serving(self) -> bool: ...

    @property
    def version(self) -> int: ...

    @property
    def released(self) -> bool: ...

    def drain(self, timeout_s: float = 10.0) -> bool: ...

    def release(self) -> None: ...

    def load_tensors(self, tensors: Mapping[str, object], version: int) -> None: ...

    def load_weights(self, path: str | Path, version: int) -> None: ...

    def export_kv(self, execution: str, block_tokens: int = 64) -> KvBlocks | None: ...

    def import_kv(self, execution: str, blocks: KvBlocks) -> bool: ...

    def set_kv_hold(self, hold: Callable[[str, str, int], Awaitable[None]]) -> None: ...

    def counters(self) -> dict[str, int]: ...
