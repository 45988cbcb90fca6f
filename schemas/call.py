"""`call.completed`: one model call of a harness, token-in/token-out.

Id: `<run>:<execution>:call:<seq>`. Arrays of tokens may be moved to the run's object
store when the encoded event would exceed a threshold; then `tokens_ref` holds the
key and the three arrays are empty (see `CallTokens`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Literal

from schemas.base import Event, fail, register

FinishReason = Literal["stop", "length", "abort", "error"]
Role = Literal["main", "main-summary", "sub-agent", "sub-agent-summary", "auxiliary"]
CallStatus = Literal["ok", "aborted", "error"]


GREEDY_BELOW = 1e-6
"""Temperatures below this are greedy decoding (argmax), as SGLang samples them
(`_SAMPLING_EPS`): their behaviour log-probs are under T = 1."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """Sampling parameters the engine used for this call.

    temperature: softmax temperature (>= 0); behaviour log-probs are of logits / temperature,
      but below `GREEDY_BELOW` (0: greedy decoding, the argmax id) they are under T = 1, as
      SGLang samples greedy as top-k 1 at T = 1: `logprob_temperature` is the T they are under.
    top_p: nucleus mass in (0, 1]; 1 = off. top_k: -1 = off. max_tokens: completion cap.
    stop: stop strings (OpenAI `stop`, Anthropic `stop_sequences`): generation ends with
      the token that completes one; those sampled ids stay in the completion (finish
      `stop`), while the text the harness got ends before the string. They truncate the
      completion, not the distribution: the log-probs do not depend on them.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop: tuple[str, ...] = ()

    @property
    def logprob_temperature(self) -> float:
        """The T of the behaviour log-probs, log_softmax(logits / T): `temperature`, and 1.0
        for greedy decoding (below `GREEDY_BELOW`). The trainer's log-probs must use the same
        T (GSPO's importance ratio, Zheng et al. 2025, eq. 7, compares the two)."""
        return self.temperature if self.temperature >= GREEDY_BELOW else 1.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CallTokens:
    """The token arrays of a call (inline or in the object store under `tokens_ref`).

    prompt_ids: (P,) int, the prompt ids *after* the reused prefix of the parent call.
    completion_ids: (C,) int, sampled ids, stop token included when finish_reason is `stop`
      (or the ids of the stop string that ended it, `SamplingParams.stop`).
    logprobs: (C,) float, behaviour log-probs (natural log) of completion_ids under the
      temperature-scaled distribution before top-p/top-k truncation.
    """

    prompt_ids: tuple[int, ...] = ()
    completion_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()


@register
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CallCompleted(Event):
    """Proxy: a model call was answered (or aborted) and recorded.

    call: call id `<execution>:<seq>`. seq: 0-based order of calls in the execution.
    parent_call: call whose prompt+completion this call's prompt extends (branch point),
      None for a root. prefix_len: number of leading ids of the parent's full sequence
      (its prompt + completion) that this call's prompt reuses verbatim.
    tokens: see CallTokens (empty when tokens_ref is set).
    versions: policy-version spans over the completion: ((start, end, version), ...),
      half-open token index ranges covering [0, C).
    role: `main`, `main-summary`, `sub-agent`, `sub-agent-summary`, `auxiliary` (never trained).
    api: `chat`, `responses`, `messages`. cell: id of the cell that served it.
    timings: seconds — `queue_s`, `engine_s`, `total_s`.
    drift: number of ids where re-rendered and recorded prompt ids disagreed.
    meta: harness session metadata, strings (gyre.serving.roles): `harness`, and where known
      `session_id`, `agent_id`, `request_kind`, `turn_id`. Empty for older events.
    """

    NAME: ClassVar[str] = "call.completed"
    call: str
    execution: str
    seq: int
    parent_call: str | None
    prefix_len: int
    tokens: CallTokens
    tokens_ref: str | None = None
    sampling: SamplingParams
    finish_reason: FinishReason
    versions: tuple[tuple[int, int, int], ...]
    cell: str
    role: Role = "main"
    api: str = "chat"
    status: CallStatus = "ok"
    timings: dict = dataclasses.field(default_factory=dict)
    drift: int = 0
    meta: dict = dataclasses.field(default_factory=dict)

    def check(self) -> None:
        if self.seq < 0:
            fail(self, "seq", "must be >= 0")
        if self.prefix_len < 0:
            fail(self, "prefix_len", "must be >= 0")
        if self.parent_call is None and self.prefix_len != 0:
            fail(self, "prefix_len", "a root call reuses no prefix")
        if not 0.0 <= self.sampling.temperature < math.inf:  # NaN fails too: the trainer divides by it
            fail(self, "sampling", "temperature must be a finite number >= 0")
        t = self.tokens
        if len(t.completion_ids) != len(t.logprobs):
            fail(self, "tokens", f"completion_ids ({len(t.completion_ids)}) and logprobs ({len(t.logprobs)}) differ in length")
        if self.tokens_ref is None:
            covered = 0
            for start, end, _version in self.versions:
                if start != covered or end < start:
                    fail(self, "versions", "spans must be contiguous half-open ranges from 0")
                covered = end
            if covered != len(t.completion_ids):
                fail(self, "versions", f"spans cover {covered} tokens, completion has {len(t.completion_ids)}")
