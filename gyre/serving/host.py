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
- `release()` frees the engine's state, its weights and every prefix KV cache (DESIGN.md
  "Cells and engines": a cell leaving rollout), aborting the calls in flight; `released`
  says so; until a load, no call is served.
- `load_tensors(tensors, version)`: load a verified snapshot (named arrays, gyre.transfer)
  between two decode steps; `load_weights(path, version)`: a checkpoint directory. Either
  always loads into a released engine, whatever the version. Raise
  `gyre.serving.engine.WeightLoadError` when the weights do not fit, leaving the engine as it was.
- `export_kv(execution)` / `import_kv(execution, blocks)`: an execution's prefix KV cache as
  `gyre.serving.kv.KvBlocks` (None / False for an engine that keeps none).
- `counters()`: monotonic counts a test or a metric reads (`prefilled_tokens`: prompt ids
  run through the model; `kv_dropped`: imported KV blocks of another version dropped).
The blocking methods (`release`, the loads, the KV ones) are thread-safe; callers run them in
worker threads.
"""
from __future__ import annotations

from collections.abc import Mapping
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

    def release(self) -> None: ...

    def load_tensors(self, tensors: Mapping[str, object], version: int) -> None: ...

    def load_weights(self, path: str | Path, version: int) -> None: ...

    def export_kv(self, execution: str, block_tokens: int = 64) -> KvBlocks | None: ...

    def import_kv(self, execution: str, blocks: KvBlocks) -> bool: ...

    def counters(self) -> dict[str, int]: ...
