"""One call to the embedded engine (gyre.serving.engine): its sampling, the request, the
result, and the errors the engine raises.

`gyre.serving.engine` re-exports every name here: callers import them from either.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

FinishType = Literal["stop", "length", "abort"]


class EngineError(Exception):
    """Base of the errors `Engine` raises on purpose."""


class InvalidRequest(EngineError):
    """The request is malformed (empty prompt, id outside the vocabulary, bad sampling, duplicate rid)."""


class NoTokenizer(EngineError):
    """A request has stop strings and the engine's checkpoint has no tokenizer to decode
    with (a setup fault of the engine, not of the request)."""


class PromptTooLong(InvalidRequest):
    """The prompt has more ids than `EngineConfig.max_context_tokens`."""


class WeightLoadError(EngineError):
    """A checkpoint could not be read or does not fit the live model (names, shapes)."""


class EngineReleased(EngineError):
    """The engine's weights are released (its cell left rollout); load a version first."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling of one request. temperature >= 0 (0 = greedy); top_p in (0, 1], 1 = off;
    top_k: -1 or 0 = off, else >= 1; max_new_tokens >= 0; stop_token_ids add to the
    engine's stop ids unless ignore_eos; stop: stop strings (non-empty; honoured with
    ignore_eos too); seed None = drawn from the engine's seeded stream."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise InvalidRequest(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not all(isinstance(x, str) and x for x in self.stop):
            raise InvalidRequest(f"stop must hold non-empty strings, got {self.stop!r}")


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One call. rid: unique among in-flight requests. input_ids: (P,) prompt ids, P >= 1.
    execution: sticky key of the per-execution prefix KV cache, or None for no caching."""

    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    execution: str | None = None


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """Outcome of one call.

    output_ids: (C,) sampled ids, stop token included when finish == "stop".
    logprobs: (C,) behaviour log-probs, natural log, of log_softmax(logits / T).
    finish: "stop" | "length" | "abort"; matched_stop: the stop id, or the stop string, that
      ended it when finish == "stop".
    versions: policy-version spans ((start, end, version), ...), half-open, covering [0, C).
    weight_version: the engine's policy version when the call finished.
    cached_tokens: prompt ids served from the execution's prefix KV cache (not prefilled).
    e2e_latency_s / queue_s: seconds from entry to result / waiting for the first forward.
    prefilled_tokens: prompt ids this call ran through the model (fewer than prompt_tokens −
      cached_tokens when it was aborted during its prefill).
    """

    rid: str
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish: FinishType
    matched_stop: int | str | None
    prompt_tokens: int
    cached_tokens: int
    versions: tuple[tuple[int, int, int], ...]
    weight_version: int
    e2e_latency_s: float
    queue_s: float
    prefilled_tokens: int = 0
