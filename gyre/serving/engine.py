"""The embedded engine: a HF transformers causal LM served token-in, token-out.

Contract (DESIGN.md "Cells and engines"):
- `Engine(cfg).generate(GenerateRequest) -> GenerateResult` is synchronous and
  thread-safe; callers run it in worker threads. Concurrent requests interleave at
  decode-step granularity: every prefill and every decode step takes one FIFO lock, so
  12+ executions sharing the engine advance in turn, one forward pass at a time.
- Behaviour log-probs are of the temperature-scaled distribution *before* top-p/top-k
  truncation: log_softmax(logits / T)[token] (DESIGN.md "Learning"). Temperature 0 is
  greedy decoding with the log-prob under T = 1. Sampling draws from top-k, then top-p
  over the renormalised top-k distribution, with a `torch.Generator` per request.
- The stop token is part of the output ids (finish `stop`, with the matched id); so are
  the ids of a stop string (`SamplingParams.stop`: generation ends with the id whose text
  completes one, as SGLang's string stop; the matched string is reported; the checkpoint's
  tokenizer decodes, loaded on the first such request);
  `length` when max_new_tokens or the context limit is reached; `abort` after `abort(rid)`.
- `load_weights(path, version)` swaps weights between decode steps: a request in
  flight continues with the new weights and its `versions` spans show the switch.
- Per execution the engine keeps the KV cache of that execution's last call (LRU,
  bounded by executions and tokens); the next call with the same execution prefills
  only the ids after the longest common prefix. A weight update or `flush_cache()`
  drops every cached prefix, since it was computed with other weights.
- A prompt is prefilled in chunks of at most `prefill_chunk_tokens` from its first
  uncached id, and its last id always runs alone, in a forward of one id as a decode step
  is (in the same turn of the step lock as the rest of its chunk). A forward's float32 result for an id depends on how many ids share the forward, so
  the last id's logits (the first token's) and its KV would otherwise differ in the last
  bits between a call prefilled here and the same call retried where its execution's KV
  moved (every prompt id but the last cached); run alone, they are the same bits, and so
  is what the call samples, whichever cell serves it.
- `drain()` aborts the requests in flight and waits for them to end (their prefix KV kept,
  so a cell leaving rollout can hand it over); `release()` drains, then frees the live
  weights and every prefix KV cache (a cell leaving rollout, DESIGN.md "Cells and
  engines"); until the next `load_weights` / `load_tensors` (which always loads, whatever
  the version) `generate` raises EngineReleased.

Never imports aiohttp or nats; `handlers/engines/embedded.py` puts it behind SGLang's
native HTTP API.
"""
from __future__ import annotations

import collections
import dataclasses
import inspect
import random
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import structlog
import torch

from gyre.serving.kv import KvBlocks
from gyre.serving.model import checkpoint_files
from gyre.serving.request import (  # noqa: F401 - EngineError, SamplingParams: re-exported
    EngineError, EngineReleased, FinishType, GenerateRequest, GenerateResult, InvalidRequest, NoTokenizer,
    PromptTooLong, SamplingParams, WeightLoadError,
)
from gyre.serving.sampling import nucleus_mask, sample_token  # noqa: F401 - nucleus_mask: re-exported
from gyre.serving.settings import EngineSettings
from gyre.serving.storage import Layout, alloc_parameters, free_parameters
from gyre.serving.tokenizer import fast_decoder, stop_hit, stop_window

log = structlog.get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig(EngineSettings):
    """Configuration of one embedded engine: the recipe's settings (`EngineSettings`:
    max_context_tokens) and those no recipe sets."""

    model_dir: str
    """Directory with config.json and model.safetensors (HF layout; shards allowed)."""
    max_completion_tokens: int = 4096
    """Upper bound on a request's max_new_tokens (larger values are clamped); in a run, the
    recipe's `sampling.max_tokens`."""
    stop_ids: tuple[int, ...] = (151645, 151643)
    """Ids that end every generation (`<|im_end|>`, `<|endoftext|>`), besides per-request ones."""
    seed: int = 0
    """Seeds the per-request seeds of requests that carry none (in a run, the recipe's `run.seed`)."""
    kv_cache_executions: int = 64
    """At most this many executions keep a prefix KV cache (least recently used evicted)."""
    kv_cache_tokens: int = 2_000_000
    """At most this many tokens summed over all kept prefix KV caches."""
    prefill_chunk_tokens: int = 2048
    """Prompt ids prefilled per forward; between chunks other calls take decode steps."""
    initial_version: int = 0
    """Policy version of the weights in model_dir."""
    dtype: str = "float32"
    """torch dtype name of the live weights."""

    def __post_init__(self) -> None:
        EngineSettings.__post_init__(self)
        if not self.model_dir:
            raise ValueError("model_dir must be a non-empty path")
        if self.max_completion_tokens < 1:
            raise ValueError(f"max_completion_tokens must be >= 1, got {self.max_completion_tokens}")
        if self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        if self.kv_cache_executions < 0:
            raise ValueError(f"kv_cache_executions must be >= 0, got {self.kv_cache_executions}")
        if self.kv_cache_tokens < 0:
            raise ValueError(f"kv_cache_tokens must be >= 0, got {self.kv_cache_tokens}")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"dtype must name a torch dtype, got {self.dtype!r}")


class _FifoLock:
    """A lock granted in arrival order, so waiting requests take decode steps in turn."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._serving = 0

    def __enter__(self) -> None:
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            while ticket != self._serving:
                self._cond.wait()

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


@dataclasses.dataclass
class _Prefix:
    ids: list[int]  # the ids whose KV the cache holds, in order
    cache: object  # transformers DynamicCache
    epoch: int  # weight epoch the KV was computed under


@dataclasses.dataclass
class _Flight:
    cancel: threading.Event
    tokens: int = 0


def _lcp(a: list[int], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Engine:
    """A HF causal LM served token-in, token-out; see the module docstring for the contract."""

    def __init__(self, cfg: EngineConfig) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=getattr(torch, cfg.dtype)).eval()
        self.vocab_size = int(self.model.config.vocab_size)
        # transformers 5 renamed `past_key_values` to `cache`; accept either.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._step = _FifoLock()
        self._state = threading.Lock()  # guards the dicts and counters below
        self._version = cfg.initial_version
        self._epoch = 0  # bumped on every weight update
        self._prefixes: collections.OrderedDict[str, _Prefix] = collections.OrderedDict()
        self._flights: dict[str, _Flight] = {}
        self._seeds = random.Random(cfg.seed)
        self._decode = None  # the checkpoint tokenizer's decode for stop strings (first use); False: none
        self._decode_lock = threading.Lock()
        self._released: Layout | None = None  # the freed parameters' layout while released
        self._weights = threading.Lock()  # one weight change at a time: a load or a release
        self.prefilled_tokens = 0
        """Prompt ids run through the model (cached prefix ids are not), over the engine's life."""
        self.kv_dropped = 0
        """Imported KV blocks dropped because another policy version computed them."""
        self.kv_imported_tokens = 0
        """Positions of imported KV blocks kept (`import_kv`), over the engine's life."""
        log.info("engine.loaded", model_dir=cfg.model_dir, vocab=self.vocab_size, version=self._version)

    @property
    def weight_version(self) -> int:
        """Policy version of the live weights."""
        return self._version

    @property
    def version(self) -> int:
        """Alias of `weight_version`."""
        return self._version

    @property
    def released(self) -> bool:
        """Whether the weights are freed (`release`) and not loaded again."""
        return self._released is not None

    def release(self, drain_s: float = 10.0) -> None:
        """Abort the requests in flight and wait up to `drain_s` for them to leave (`drain`),
        then free the live weights and every prefix KV cache (module docstring). Idempotent."""
        self.drain(drain_s)
        with self._weights, self._step, self._state:
            self._prefixes.clear()
            self._epoch += 1  # KV a request still in flight computed is never kept
            if self._released is None:
                self._released = free_parameters(self.model)
        log.info("engine.released", version=self._version)

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Abort every request in flight and wait up to `timeout_s` for them to end; each
        keeps its execution's prefix KV as a finished call does. Returns whether none is left."""
        self.abort_all()
        deadline = time.monotonic() + timeout_s
        while self.in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.in_flight()

    def counters(self) -> dict[str, int]:
        """The engine's counters over its life: `prefill_tokens` (prompt ids run through the
        model), `kv_imported_tokens` (positions of imported KV blocks kept), `kv_dropped`
        (imported blocks dropped: another policy version computed them)."""
        with self._state:
            return {"prefill_tokens": self.prefilled_tokens, "kv_imported_tokens": self.kv_imported_tokens,
                    "kv_dropped": self.kv_dropped}

    def in_flight(self) -> dict[str, int]:
        """rid -> completion tokens generated so far, for every request being served."""
        with self._state:
            return {rid: f.tokens for rid, f in self._flights.items()}

    def abort(self, rid: str) -> bool:
        """Makes the in-flight request `rid` finish with `abort` before its next forward.
        Returns False when no such request is in flight (a no-op)."""
        with self._state:
            flight = self._flights.get(rid)
        if flight is None:
            return False
        flight.cancel.set()
        return True

    def abort_all(self) -> int:
        """Aborts every in-flight request; returns how many."""
        with self._state:
            flights = list(self._flights.values())
        for f in flights:
            f.cancel.set()
        return len(flights)

    def flush_cache(self) -> int:
        """Drops every per-execution prefix KV cache; returns how many were dropped."""
        with self._state:
            n = len(self._prefixes)
            self._prefixes.clear()
        return n

    def load_weights(self, path: str | Path, version: int) -> None:
        """Loads a safetensors checkpoint (a directory as written by save_pretrained, or one
        file) into the live model between two decode steps and sets the policy version.

        Every name must belong to the model with the same shape; names the file lacks are
        allowed only for tensors tied to one it has (e.g. lm_head tied to the embedding).
        Raises WeightLoadError and leaves the live weights untouched when it does not fit.
        """
        from safetensors.torch import load_file

        path = Path(path)
        try:
            state: dict[str, torch.Tensor] = {}
            for f in checkpoint_files(path):
                state.update(load_file(str(f)))
        except Exception as e:  # unreadable file, bad header
            raise WeightLoadError(f"cannot read checkpoint {path}: {e}") from e
        self._swap(state, version, f"checkpoint {path}")

    def load_tensors(self, tensors: Mapping[str, object], version: int) -> None:
        """Loads named tensors (numpy arrays or torch tensors: a verified snapshot pulled
        through the transfer layer, gyre.transfer) between two decode steps and sets the
        policy version; the same checks as `load_weights`, WeightLoadError when they fail."""
        state = {name: torch.as_tensor(t) for name, t in tensors.items()}
        self._swap(state, version, f"snapshot of version {version}")

    def _swap(self, state: dict[str, torch.Tensor], version: int, path: str) -> None:
        """Check `state` against the live model, then copy it in under the step lock (a
        released model gets storage again first, and loses it again when `state` does not fit)."""
        with self._weights:
            released = self._released
            if released is not None:
                with self._step:
                    alloc_parameters(self.model, released)
            try:
                self._check(state, path)
            except WeightLoadError:
                if released is not None:
                    with self._step:
                        free_parameters(self.model)
                raise
            live = self.model.state_dict()
            with self._step, torch.no_grad():
                for name, tensor in state.items():
                    live[name].copy_(tensor)
                with self._state:
                    previous = self._version
                    self._version = int(version)
                    self._epoch += 1
                    self._prefixes.clear()
                    self._released = None
        log.info("engine.weights.loaded", source=path, version=int(version), previous=previous,
                 restored=released is not None)

    def _check(self, state: dict[str, torch.Tensor], path: str) -> None:
        """WeightLoadError unless `state` names only live tensors, with their shapes, and
        every live tensor (tied ones count as covered by their twin)."""
        live = self.model.state_dict()
        unknown = sorted(set(state) - set(live))
        if unknown:
            raise WeightLoadError(f"{path} has tensors the model lacks: {unknown[:5]}")
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(live[name].shape):
                raise WeightLoadError(
                    f"{path}: {name} has shape {tuple(tensor.shape)}, model has {tuple(live[name].shape)}"
                )
        covered = {live[name].data_ptr() for name in state}
        missing = sorted(n for n in set(live) - set(state) if live[n].data_ptr() not in covered)
        if missing:
            raise WeightLoadError(f"{path} lacks tensors: {missing[:5]}")

    def export_kv(self, execution: str, block_tokens: int = 64) -> KvBlocks | None:
        """The prefix KV cache kept for `execution` as blocks (gyre.serving.kv) tagged with
        the policy version that computed it; None when none is kept. The engine keeps it."""
        with self._state:
            entry = self._prefixes.get(execution)
            if entry is None or entry.epoch != self._epoch:
                return None
            version = self._version
            layers = [(layer.keys.numpy().copy(), layer.values.numpy().copy()) for layer in entry.cache.layers]
            ids = tuple(entry.ids)
        return KvBlocks(ids=ids, version=version, keys=tuple(k for k, _ in layers),
                        values=tuple(v for _, v in layers), block_tokens=block_tokens)

    def import_kv(self, execution: str, blocks: KvBlocks) -> bool:
        """Keep `blocks` as `execution`'s prefix KV cache, so its next call prefills only the
        ids after them (counted in `kv_imported_tokens`). Blocks computed by another policy
        version than the one served are dropped and counted (`kv_dropped`): the prefix is then
        recomputed. Returns whether they were kept. Raises InvalidRequest when they do not fit
        the model."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        if len(blocks.keys) != len(cache.layers):
            raise InvalidRequest(f"KV blocks of {len(blocks.keys)} layers, the model has {len(cache.layers)}")
        with self._state:
            if self._released is not None:
                return False
            if blocks.version != self._version:
                self.kv_dropped += 1
                log.info("engine.kv.dropped", execution=execution, blocks_version=blocks.version,
                         version=self._version)
                return False
        with torch.inference_mode():
            for layer, k, v in zip(cache.layers, blocks.keys, blocks.values):
                layer.update(torch.from_numpy(np.ascontiguousarray(k)), torch.from_numpy(np.ascontiguousarray(v)))
        with self._state:
            if blocks.version != self._version:  # weights changed meanwhile
                self.kv_dropped += 1
                return False
            epoch = self._epoch
        if not self._put_prefix(execution, list(blocks.ids), cache, epoch):
            return False
        with self._state:
            self.kv_imported_tokens += len(blocks.ids)
        return True

    def generate(self, req: GenerateRequest, cancel: threading.Event | None = None) -> GenerateResult:
        """Serves one call; blocks until it finishes. `cancel`, when given, aborts it like
        `abort(req.rid)` (the HTTP server sets it when its client goes away).

        Raises InvalidRequest (empty prompt, id outside [0, vocab), duplicate rid in
        flight), PromptTooLong (P > max_context_tokens) and NoTokenizer (stop strings, and
        no tokenizer in model_dir), EngineReleased (`release` freed the weights).
        """
        t0 = time.monotonic()
        if self._released is not None:
            raise EngineReleased("this engine's weights are released (its cell left rollout); it serves again "
                                 "once a policy version is loaded")
        self._validate(req)
        flight = _Flight(cancel=cancel or threading.Event())
        with self._state:
            if req.rid in self._flights:
                raise InvalidRequest(f"rid {req.rid!r} is already in flight")
            self._flights[req.rid] = flight
        try:
            return self._generate(req, flight, t0)
        finally:
            with self._state:
                self._flights.pop(req.rid, None)

    def _validate(self, req: GenerateRequest) -> None:
        if not req.input_ids:
            raise InvalidRequest("input_ids must hold at least one id")
        if len(req.input_ids) > self.cfg.max_context_tokens:
            raise PromptTooLong(
                f"prompt has {len(req.input_ids)} tokens, max_context_tokens is {self.cfg.max_context_tokens}"
            )
        lo, hi = min(req.input_ids), max(req.input_ids)
        if lo < 0 or hi >= self.vocab_size:
            raise InvalidRequest(f"input_ids must lie in [0, {self.vocab_size}), got min {lo} max {hi}")

    def _take_prefix(self, execution: str | None, input_ids: tuple[int, ...]) -> tuple[object | None, int, int]:
        """Removes the execution's cached prefix and crops it to the reusable length.
        Returns (cache or None, reused ids, weight epoch of that KV). At least one prompt
        id is always left to prefill, since its logits give the first token."""
        with self._state:
            entry = self._prefixes.pop(execution, None) if execution is not None else None
            epoch = self._epoch
        if entry is None or entry.epoch != epoch:
            return None, 0, epoch
        reuse = min(_lcp(entry.ids, input_ids), len(input_ids) - 1)
        if reuse == 0:
            return None, 0, epoch
        with torch.inference_mode():
            entry.cache.crop(-(len(entry.ids) - reuse))  # negative = drop that many from the end
        return entry.cache, reuse, epoch

    def _put_prefix(self, execution: str, ids: list[int], cache: object, epoch: int) -> bool:
        """Keep `cache` as the execution's prefix; False when it is not kept (no room, or
        computed under other weights)."""
        if self.cfg.kv_cache_executions == 0 or len(ids) > self.cfg.kv_cache_tokens:
            return False
        with self._state:
            if epoch != self._epoch:  # weights changed during the call: the KV is mixed
                return False
            self._prefixes.pop(execution, None)
            self._prefixes[execution] = _Prefix(ids=ids, cache=cache, epoch=epoch)
            total = sum(len(p.ids) for p in self._prefixes.values())
            while len(self._prefixes) > self.cfg.kv_cache_executions or total > self.cfg.kv_cache_tokens:
                _, evicted = self._prefixes.popitem(last=False)
                total -= len(evicted.ids)
        return True

    def _forward(self, ids: list[int], cache: object) -> torch.Tensor:
        """Runs `ids` through the model appending to `cache`; returns last logits (V,) float32."""
        x = torch.tensor([ids], dtype=torch.long)  # (1, T)
        out = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[0, -1].float()  # (V,)

    def _decoder(self):
        """`decode(ids) -> str` of the checkpoint's tokenizer (special tokens kept), loaded
        once. Raises NoTokenizer when model_dir holds none (logged once, with the path)."""
        with self._decode_lock:  # not _state: loading takes a second, aborts must not wait
            if self._decode is None:
                from gyre.serving.model import load_tokenizer

                try:
                    self._decode = fast_decoder(load_tokenizer(self.cfg.model_dir))
                except Exception as exc:  # noqa: BLE001 - a corrupt tokenizer.json raises a bare Exception
                    log.error("engine.tokenizer.missing", model_dir=self.cfg.model_dir, error=repr(exc))
                    self._decode = False
            if self._decode is False:
                raise NoTokenizer("this engine cannot honour stop strings: its checkpoint has no tokenizer")
            return self._decode

    def _generate(self, req: GenerateRequest, flight: _Flight, t0: float) -> GenerateResult:
        from transformers import DynamicCache

        sp = req.sampling
        bound = log.bind(rid=req.rid, execution=req.execution)
        stop = set() if sp.ignore_eos else set(self.cfg.stop_ids) | set(sp.stop_token_ids)
        decode = self._decoder() if sp.stop else None
        window = stop_window(sp.stop) if sp.stop else 0
        budget = min(sp.max_new_tokens, self.cfg.max_completion_tokens, self.cfg.max_context_tokens - len(req.input_ids))
        if sp.seed is not None:
            seed = sp.seed
        else:
            with self._state:
                seed = self._seeds.getrandbits(63)
        generator = torch.Generator().manual_seed(seed)

        out: list[int] = []
        logps: list[float] = []
        versions: list[list[int]] = []  # [start, end, version], merged as we go
        finish: FinishType = "length"
        matched: int | str | None = None
        queue_s: float | None = None
        # epoch: the weights the KV in `cache` was computed with
        cache, cached, epoch = self._take_prefix(req.execution if budget > 0 else None, req.input_ids)
        fed = list(req.input_ids[:cached])  # ids whose KV `cache` holds
        pending = list(req.input_ids[cached:])  # ids of the next forward
        mixed = False  # True once the KV spans a weight update: then it is never kept
        prefilled = 0
        with torch.inference_mode():
            while len(out) < budget:
                # long prompts go in chunks, each its own turn of the step lock, so other
                # calls keep decoding and attention masks stay (chunk, T)-sized
                chunk = pending[: self.cfg.prefill_chunk_tokens]
                with self._step:
                    if queue_s is None:
                        queue_s = time.monotonic() - t0
                    if flight.cancel.is_set() or self._released is not None:
                        finish = "abort"
                        break
                    if not fed:
                        epoch = self._epoch
                    elif self._epoch != epoch:
                        mixed = True
                    if cache is None:
                        cache = DynamicCache(config=self.model.config)
                    if 1 < len(chunk) == len(pending):  # the prompt's last id runs alone (module docstring)
                        self._forward(chunk[:-1], cache)
                        logits = self._forward(chunk[-1:], cache)
                    else:
                        logits = self._forward(chunk, cache)
                    version = self._version
                    if len(fed) < len(req.input_ids):
                        self.prefilled_tokens += len(chunk)
                        prefilled += len(chunk)
                fed.extend(chunk)
                pending = pending[len(chunk) :]
                if pending:
                    continue
                token, logp = sample_token(logits, sp, generator)
                out.append(token)
                logps.append(logp)
                flight.tokens = len(out)
                if versions and versions[-1][2] == version:
                    versions[-1][1] += 1
                else:
                    versions.append([len(out) - 1, len(out), version])
                if token in stop:
                    finish, matched = "stop", token
                    break
                if decode is not None:
                    hit = stop_hit(decode, out, sp.stop, window)
                    if hit is not None:
                        finish, matched = "stop", hit
                        break
                pending = [token]
        if req.execution is not None and cache is not None and not mixed:
            self._put_prefix(req.execution, fed, cache, epoch)
        result = GenerateResult(
            rid=req.rid,
            output_ids=tuple(out),
            logprobs=tuple(logps),
            finish=finish,
            matched_stop=matched,
            prompt_tokens=len(req.input_ids),
            cached_tokens=cached,
            versions=tuple((s, e, v) for s, e, v in versions),
            weight_version=self._version,
            e2e_latency_s=time.monotonic() - t0,
            queue_s=queue_s or 0.0,
            prefilled_tokens=prefilled,
        )
        bound.info(
            "engine.call.finished",
            finish=finish,
            prompt_tokens=result.prompt_tokens,
            cached_tokens=cached,
            completion_tokens=len(out),
            duration_s=round(result.e2e_latency_s, 4),
        )
        return result
