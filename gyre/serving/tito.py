"""Token-in, token-out (TITO): per-execution call store and prefix matching.

DESIGN.md "Token-in, token-out". The trainer never re-tokenises text: for every call the
proxy keeps the exact ids the engine saw and sampled, and a new request reuses them
wherever it extends an earlier call. Requests are normalised first (`gyre.serving.normalise`),
calls are kept as `gyre.serving.call_record.CallRecord`s, and drift is defined and counted
on a whole prompt in `gyre.serving.drift`.

Contract:
- `CallStore.match(messages, tools) -> Match`:
  1. *Extension.* Find the recorded call c (same tools; the system prompt is a message)
     whose `c.messages + [c.answer]` is the longest message-level prefix of the request.
     The matched messages are replaced by c's recorded ones; c's conversation rendered
     without a generation prompt, cut right after its last `<|im_end|>`, must be a string
     prefix of the request's rendering. Then
     `prompt_ids = c.full_ids (+ <|im_end|> unless c's completion ended with it) + encode(suffix)`,
     the suffix starting with "\\n<|im_start|>". parent = c, prefix_len = len(c.full_ids).
     With gyre's template (`gyre.serving.chat.uses_gyre_template`) only the new messages are
     rendered (`gyre.serving.chat.render_appended`) and the prefix relation is decided from two
     facts kept per call (does the conversation hold a real user query; does an assistant
     after the last one show reasoning), so the cost does not grow with the history; with
     another template both conversations are rendered in full and compared.
  2. *Branch.* Otherwise (no such call, or the rendered text is not an extension, e.g. a
     template that drops earlier thinking; or c's completion held a think block, empty
     ones included, and a real user query follows it: the template renders that turn
     without the block, which c's ids hold) the whole request is rendered and encoded, and
     the recorded call sharing the longest common token prefix with it becomes the parent
     (prefix_len = that length; parent None and 0 when nothing is shared). Never raises
     for a mismatch.
  `match` = `attach` then `complete`. `attach` returns a gyre-template extension as its
  Match, and as a `Pending` any request whose prompt needs whole conversations rendered (a
  branch, a fresh request, with another template an extension candidate: `extends`) and a
  gyre-template extension by more than `HEAVY_CHARS` of new messages.
  A caller on an event loop can run `prepare(pending)` — the rendering and encoding, which
  read no store state calls change — in a worker thread between the two (the proxy does for
  `Pending.heavy` requests).
  Messages are normalised and hashed incrementally: a request is compared (as parsed
  JSON, in C) with the few latest requests of the execution, and only the messages after
  the common part are normalised and hashed again.
- `CallStore.fresh(messages, tools) -> Match`: the request rendered alone, parent None
  (auxiliary calls: counted, answered and published, never recorded). A token count is
  attached as its call would be (`attach(..., remember=False)`: the same prompt ids, the
  memo of latest requests left as it was) and never recorded either.
- A branch or fresh request's first turn (the system prompt and tool definitions, up to
  and including the first `<|im_end|>`) is encoded once per store: the latest
  `FIRST_TURNS` distinct ones used are kept with their ids. Branches (a compaction, the main
  line after it, a second sub-agent of a kind) and count_tokens calls resend them, so each
  is encoded once, not on every such call. They name the execution's working directory, so
  stores do not share them.
  Exact because encoding splits at `<|im_end|>` (`gyre.serving.drift`).
- `CallStore.record(match, call=, seq=, answer=, completion_ids=)` adds a served call; its
  answer's tool-call payloads enter `tool_args`. Only calls whose answer reached the harness
  should be recorded.

Drift: `gyre.serving.drift` defines it and says how the store counts it, O(one turn) with
gyre's template; `check_drift=False` skips the count (drift 0).
Memory: the normalisation memo holds the latest `MEMO_REQUESTS` requests' messages, sharing
the message objects they have in common (a call's ids: `gyre.serving.call_record`).
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import orjson

from gyre.serving.call_record import CallRecord, _last_im_end_before, _shared_len
from gyre.serving.chat import is_query, render_appended, render_assistant_turn, shows_reasoning, uses_gyre_template
from gyre.serving.drift import (
    _im_end_stands_alone, _opening_pattern, _special_tokens_split, _splitting_tokens, count_drift,
)
from gyre.serving.normalise import (
    _chain, _text_chars, _tools_json, equal_prefix_len, message_key, normalise, normalise_message, normalise_tools,
)
from gyre.serving.tokenizer import IM_END, IM_END_TEXT, fast_encoder

TURN_HEADER = "\n<|im_start|>assistant\n"
"""What an assistant turn opens with in gyre's template, after the previous `<|im_end|>`."""

FIRST_TURNS = 4
"""Distinct first turns (system prompt + tools) kept per execution with their ids: the
main agent's, before and after a compaction, and sub-agents' and side calls' own."""

MEMO_REQUESTS = 4
"""Latest requests per execution whose normalised messages are reused (main line,
sub-agents and side calls interleave)."""

TIP_CACHE = 8
"""Latest calls per execution whose full ids are also kept whole, as their prompt and
completion int32 arrays, so extending one costs one copy in C, not a walk over the call
chain. Arrays, not lists of Python ints: a list of 10^4 ints is a container the cyclic GC
walks item by item on every collection while it lives, pausing the event loop."""

HEAVY_CHARS = 100_000
"""Characters (≈ 25k tokens) above which a `Pending` request is `heavy` and the proxy
renders and encodes it in a worker thread (`CallStore.prepare`), off the event loop: a
request whose prompt needs whole conversations rendered (a branch, a fresh request, and
every extension when the store is not incremental) counting its messages and tools, or an
incremental extension counting its new messages (a huge tool output)."""

Renderer = Callable[..., str]
_IM_END_IDS = np.array([IM_END], np.int32)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Match:
    """Where a request attaches to the execution's calls.

    parent: the call whose full ids the prompt starts with (None for a root).
    prefix_len: leading ids of parent's full ids reused verbatim (0 for a root).
    prompt_ids: (P,) int32, the whole prompt to send to the engine.
    extended: True for a message-level extension (ids reused), False for a branch/root.
    drift: `gyre.serving.drift`. messages/tools: what
    was rendered (normalised). digest: names (tools, messages) for message-level matching.
    query / shown: facts of `messages` in gyre's template (see CallRecord.conv_query /
    conv_shown).
    """

    parent: CallRecord | None
    prefix_len: int
    prompt_ids: np.ndarray
    extended: bool
    drift: int
    messages: tuple[dict, ...]
    tools: tuple[dict, ...]
    digest: bytes
    query: bool = False
    shown: bool = False

    @property
    def new_prompt_ids(self) -> np.ndarray:
        """(P - prefix_len,) int32: the prompt ids after the reused prefix."""
        return self.prompt_ids[self.prefix_len:]


@dataclasses.dataclass(frozen=True, slots=True)
class Pending:
    """A request whose prompt `CallStore.attach` leaves to `CallStore.prepare` (rendering
    and encoding, safe in a worker thread) and `CallStore.complete` (attaching): a branch
    or fresh request; in a store that is not incremental (another template than gyre's, or
    a `render` given) any request that may extend the call `extends`; in an incremental
    store an extension of `extends` by heavy new messages.

    messages / tools: normalised, as Match. digest: as Match.digest (b"" when fresh).
    fresh: attach to nothing (auxiliary calls; `CallStore.fresh`). heavy: more than
    `HEAVY_CHARS` characters of text (content and its text parts, reasoning, tool-call
    arguments; and the tools' JSON unless it extends an incremental store's call, where
    only the new messages count). extends: the recorded call whose conversation + answer
    are the request's first messages (None for a branch); rest: the messages after them.
    """

    messages: tuple[dict, ...]
    tools: tuple[dict, ...]
    digest: bytes
    fresh: bool
    heavy: bool
    extends: CallRecord | None = None
    rest: tuple[dict, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Prepared:
    """What `CallStore.prepare` made of a `Pending` request (int32 arrays, may be read-only):
    `prompt_ids` (P,), the whole prompt of a branch or fresh request; or, for an extension,
    `suffix_ids` (S,), the ids after `extends`' conversation, and `reference_ids` (R,), the
    whole request encoded afresh (drift; None when drift is not counted)."""

    prompt_ids: np.ndarray | None = None
    suffix_ids: np.ndarray | None = None
    reference_ids: np.ndarray | None = None


# --------------------------------------------------------------------------- store


def conversation_facts(messages: Sequence[dict], after: tuple[bool, bool] = (False, False)) -> tuple[bool, bool]:
    """(query, shown) of a conversation in gyre's template: does it hold a real user query
    (`gyre.serving.chat.is_query`), and does an assistant after the last one show reasoning
    (`gyre.serving.chat.shows_reasoning`). `after`: the facts of the conversation `messages`
    continue (default: an empty one), so the cost is O(len(messages)).
    Errors: `ValueError` for content the renderer rejects."""
    last = -1
    for i in range(len(messages) - 1, -1, -1):
        if is_query(messages[i]):
            last = i
            break
    if last >= 0:
        return True, any(shows_reasoning(m) for m in messages[last + 1:])
    query, shown = after
    return query, shown or (query and any(shows_reasoning(m) for m in messages))


@dataclasses.dataclass(slots=True)
class _Seen:
    """One recent request, normalised: raw messages as received (compared with the next
    requests), their normalised forms and the cumulative digests (`_chain`, len(raw) + 1).
    unknown: tool-call id → index of the first message that used it while `tool_args`
    lacked it (that message would normalise differently once the id is known)."""

    tools_json: bytes | None  # `_tools_json` of the request's tools as received
    tools: tuple[dict, ...]
    raw: list
    norm: list[dict]
    digests: list[bytes]
    unknown: dict[str, int]


class CallStore:
    """The calls of one execution and the raw tool-call payloads we emitted.

    tokenizer: an HF tokenizer (`gyre.serving.tokenizer.build_tokenizer()` or the model's).
    render: `gyre.serving.chat.render(tokenizer, messages, tools, add_generation_prompt)`; None =
      that function, with incremental rendering when the tokenizer is on gyre's template.
    check_drift: count drift on extensions (`gyre.serving.drift`; O(one turn) on gyre's
      template, O(prompt) re-tokenisation otherwise); False reports drift 0.
    Attributes: `incremental` (only new messages are rendered; module docstring).
    Not thread-safe; one event loop owns it. Only `prepare` and `encode` may run in another
    thread meanwhile (they read no state the others change).
    """

    def __init__(self, tokenizer: Any, *, render: Renderer | None = None, check_drift: bool = True):
        split = _special_tokens_split(tokenizer)
        self.incremental = render is None and uses_gyre_template(tokenizer) and split
        self._splitting = _splitting_tokens(tokenizer)
        # First turns are split off only where encoding splits at <|im_end|> wherever it is written.
        self._first_turns: dict[str, np.ndarray] | None = {} if split and _im_end_stands_alone(tokenizer, self._splitting) else None
        if render is None:
            from gyre.serving.chat import render as chat_render

            render = chat_render
        self.tokenizer = tokenizer
        self.render = render
        self.check_drift = check_drift
        # A completion holding this id wrote a think block, empty or not (Qwen3's `</think>`).
        self._think_end = (getattr(tokenizer, "get_added_vocab", dict)() or {}).get("</think>")
        self.calls: list[CallRecord] = []
        self.tool_args: dict[str, str] = {}
        self._by_conv: dict[bytes, CallRecord] = {}
        self._by_call: dict[str, CallRecord] = {}
        self._extended: set[str] = set()
        self._seen: list[_Seen] = []
        self._tips: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._opening = _opening_pattern(self._splitting)
        self._heads: dict[str, np.ndarray] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        split = getattr(tokenizer, "split_special_tokens", False)  # the backend would parse them
        # tiktoken on gyre's Qwen3 vocabulary; else the fast tokenizer's own encoder (same ids,
        # less overhead than __call__); else None.
        fast = fast_encoder(tokenizer)
        self._fast_array = fast.array if fast is not None else None
        self._fast_encode = fast or (
            (lambda text: backend.encode(text, add_special_tokens=False).ids) if backend is not None and not split
            else None)

    # -- helpers
    def _joins(self, recorded: int, fresh: int) -> bool:
        """Id `fresh`'s text is id `recorded`'s followed by more (`count_drift`'s `joins`),
        compared as the vocabulary writes them (byte-level BPE: one character a byte)."""
        a, b = self.tokenizer.convert_ids_to_tokens([recorded, fresh])
        return isinstance(a, str) and isinstance(b, str) and len(b) > len(a) and b.startswith(a)

    def encode_list(self, text: str) -> list[int]:
        """Ids of `text` as a list, no special tokens added (special-token text is parsed)."""
        if self._fast_encode is not None:  # same ids, several times faster (gyre.serving.tokenizer.fast_encoder)
            return self._fast_encode(text)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, text: str) -> np.ndarray:
        """(N,) int32 ids of `text`, no special tokens added (special-token text is parsed).
        Thread-safe; may be read-only. With gyre's tokenizer tiktoken encodes with the GIL
        released (`gyre.serving.tokenizer.FastEncoder.array`)."""
        if self._fast_array is not None:
            return self._fast_array(text)
        return np.asarray(self.encode_list(text), dtype=np.int32)

    def encode_prompt(self, text: str) -> np.ndarray:
        """(N,) int32 ids of a whole rendered prompt: `encode(text)`, its first turn
        encoded once per store (the module docstring)."""
        kept = self._first_turns
        end = text.find(IM_END_TEXT) + len(IM_END_TEXT) if kept is not None else 0
        if end < len(IM_END_TEXT):
            return self.encode(text)
        head = text[:end]
        ids = kept.pop(head, None)
        if ids is None:
            if len(kept) >= FIRST_TURNS:
                del kept[next(iter(kept))]  # the least recently used
            ids = self.encode(head)
        kept[head] = ids  # the newest
        return np.concatenate((ids, self.encode(text[end:])))

    def _prompt(self, c: CallRecord, suffix: Sequence[int] | np.ndarray) -> np.ndarray:
        """The prompt extending c: c's full ids (+ <|im_end|> unless c stopped) + suffix.
        c's cached prompt and completion (`TIP_CACHE`) are used when present, so no walk over
        the call chain runs (c leaves the cache when its extension is recorded: `record`)."""
        parts = list(self._tips.get(c.call) or (c.full_ids(),))
        if not c.stopped:
            parts.append(_IM_END_IDS)
        parts.append(np.asarray(suffix, np.int32))
        return np.concatenate(parts)

    def _render(self, messages: Sequence[dict], tools: Sequence[dict], gen: bool) -> str:
        return self.render(self.tokenizer, list(messages), list(tools) or None, gen)

    def normalise(self, messages: Iterable[dict]) -> list[dict]:
        return normalise(messages, self.tool_args)

    def _normalised(self, messages: Sequence[dict], tools: Any,
                    remember: bool = True) -> tuple[list[dict], tuple[dict, ...], list[bytes]]:
        """(normalised messages, normalised tools, cumulative digests), reusing the latest
        requests' work for the messages they share with this one (module docstring); the
        request becomes the newest remembered one unless `remember` is False."""
        if not isinstance(messages, list):
            messages = list(messages)
        args = self.tool_args
        best: _Seen | None = None
        n = 0
        tools_json = _tools_json(tools)
        for seen in self._seen:
            if tools_json is None or seen.tools_json != tools_json:
                continue
            top = min(len(seen.raw), len(messages))
            if best is not None and top <= n:
                continue  # cannot share more than the best so far: skip comparing it
            for tc_id, index in seen.unknown.items():
                if index < top and tc_id in args:
                    top = index
            k = equal_prefix_len(messages, seen.raw, top)
            if best is None or k > n:
                best, n = seen, k
        if best is not None:
            tools_n, digests = best.tools, best.digests[: n + 1]
            raw, norm = best.raw[:n], best.norm[:n]
            unknown = {i: x for i, x in best.unknown.items() if x < n}
            if remember:
                self._seen.remove(best)
        else:
            tools_n = tuple(normalise_tools(tools))
            digests = _chain(orjson.dumps(list(tools_n)), ())  # in the order the template writes them
            raw, norm, unknown = [], [], {}
        for m in messages[n:]:
            nm = normalise_message(m, args)
            for tc in nm.get("tool_calls", ()):
                if tc["id"] and tc["id"] not in args:
                    unknown.setdefault(tc["id"], len(norm))
            raw.append(m)
            norm.append(nm)
            digests.append(hashlib.sha256(digests[-1] + message_key(nm)).digest())
        if remember:
            self._seen.insert(0, _Seen(tools_json=tools_json, tools=tools_n, raw=raw, norm=norm, digests=digests,
                                       unknown=unknown))
            del self._seen[MEMO_REQUESTS:]
        return list(norm), tools_n, digests

    # -- matching
    def match(self, messages: Sequence[dict], tools: Any = None) -> Match:
        """Attach a request to the recorded calls (module docstring): `attach`, then
        `complete` on the event loop's thread. Raises ValueError on malformed messages or
        tools, and whatever `render` raises on a request the template cannot render."""
        found = self.attach(messages, tools)
        return found if isinstance(found, Match) else self.complete(found)

    def fresh(self, messages: Sequence[dict], tools: Any = None) -> Match:
        """A request rendered and encoded on its own, attached to nothing (parent None):
        for auxiliary calls (titles, small-model side calls) that must not shape the
        trajectory tree. Raises like `match`."""
        return self.complete(self.attach(messages, tools, fresh=True))

    def attach(self, messages: Sequence[dict], tools: Any = None, *, fresh: bool = False,
               remember: bool = True) -> Match | Pending:
        """The extension `match` finds with gyre's template (only new messages rendered), or
        a `Pending` request: one whose prompt needs whole conversations rendered (a branch,
        any request when `fresh`, with another template every request that may extend a
        call), or a gyre-template extension by heavy new messages (`Pending`). Raises
        ValueError on malformed messages or tools, and whatever `render` raises while
        extending. remember=False (a token count: the request is attached as its call would
        be, and forgotten) leaves the normalisation memo's latest requests as they were."""
        if fresh:
            msgs = self.normalise(messages)
            tools_n = tuple(normalise_tools(tools))
            return Pending(messages=tuple(msgs), tools=tools_n, digest=b"", fresh=True,
                           heavy=_text_chars(msgs, tools_n) > HEAVY_CHARS)
        msgs, tools_n, digests = self._normalised(messages, tools, remember)
        extends: CallRecord | None = None
        k = 0
        for k in range(len(msgs), 0, -1):
            c = self._by_conv.get(digests[k])
            if c is None:
                continue
            if not self.incremental:
                if not _drops_shown_reasoning(c, msgs[k:]):
                    extends = c  # decided once both conversations are rendered (`prepare`)
                break
            rest = msgs[k:]
            if _text_chars(rest, ()) > HEAVY_CHARS and not _drops_shown_reasoning(c, rest):
                # an extension by long messages (a huge tool output): only they are rendered, in `prepare`
                return Pending(messages=tuple(msgs), tools=tools_n, digest=digests[-1], fresh=False, heavy=True,
                               extends=c, rest=tuple(rest))
            found = self._extend_appended(c, rest, tools_n, digests[-1])
            if found is not None:
                return found
            break  # the longest message-level match is not a token-level extension
        return Pending(messages=tuple(msgs), tools=tools_n, digest=digests[-1], fresh=False,
                       heavy=_text_chars(msgs, tools_n) > HEAVY_CHARS, extends=extends,
                       rest=tuple(msgs[k:]) if extends is not None else ())

    def prepare(self, pending: Pending) -> Prepared:
        """Render and encode `pending`. An extension candidate (`pending.extends`, another
        template than gyre's) renders the call's conversation (its recorded messages and
        answer) with and without `pending.rest`: when the shorter, cut after its last
        `<|im_end|>`, is a string prefix of the longer, the rest is encoded (`suffix_ids`; and
        the whole request when drift is counted), else the request is a branch (`prompt_ids`,
        the request's own messages rendered). An incremental store's `extends` renders only
        `pending.rest`. Reads nothing of the store that calls change (the first-turn cache is
        not used), so it may run in a worker thread while the event loop uses the store.
        Raises whatever `render` raises."""
        return self._prepare(pending, self.encode)

    def _prepare(self, pending: Pending, encode_prompt: Callable[[str], np.ndarray]) -> Prepared:
        c = pending.extends
        if c is not None and self.incremental:  # attach decided it extends c: the new messages only
            return Prepared(suffix_ids=self.encode(render_appended(self.tokenizer, list(pending.rest),
                                                                   after_query=c.conv_query)))
        if c is not None:  # c's recorded messages, which may show what the request's omit (reasoning)
            conv = (*c.messages, c.answer)
            text = self._render((*conv, *pending.rest), pending.tools, True)
            prev = self._render(conv, pending.tools, False)
            cut = prev.rfind(IM_END_TEXT)
            if cut >= 0 and text.startswith(prev[: cut + len(IM_END_TEXT)]):
                return Prepared(suffix_ids=self.encode(text[cut + len(IM_END_TEXT):]),
                                reference_ids=self.encode(text) if self.check_drift else None)
        return Prepared(prompt_ids=encode_prompt(self._render(pending.messages, pending.tools, True)))

    def complete(self, pending: Pending, prepared: Prepared | None = None) -> Match:
        """`pending` attached: an extension of `pending.extends` (module docstring), a fresh
        root, or a branch whose parent is the recorded call sharing the longest token prefix
        with it. prepared: from `prepare(pending)`; None = made here, a branch's first turn
        from the store's cache. Raises whatever `render` raises."""
        if prepared is None:
            prepared = self._prepare(pending, self.encode_prompt)
        msgs, tools = pending.messages, pending.tools
        c = pending.extends
        if prepared.suffix_ids is not None and c is not None:  # an extension of c
            if self.incremental:
                return self._extend_appended(c, list(pending.rest), tools, pending.digest, prepared.suffix_ids)
            prompt = self._prompt(c, prepared.suffix_ids)
            drift = 0
            if prepared.reference_ids is not None:
                sampled = np.zeros(len(prompt), bool)
                sampled[: c.full_len] = c.sampled_mask(c.full_len)
                drift = count_drift(prompt, sampled, prepared.reference_ids, self._joins)
            query, shown = conversation_facts(pending.rest, (c.conv_query, c.conv_shown))
            return Match(parent=c, prefix_len=c.full_len, prompt_ids=prompt, extended=True, drift=drift,
                         messages=(*c.messages, c.answer, *pending.rest), tools=tools, digest=pending.digest,
                         query=query, shown=shown)
        prompt_ids = prepared.prompt_ids
        if pending.fresh:
            return Match(parent=None, prefix_len=0, prompt_ids=prompt_ids, extended=False, drift=0,
                         messages=msgs, tools=tools, digest=b"")
        best: CallRecord | None = None
        best_len = 0
        shared: dict[str, int] = {}
        for rec in self.calls:
            if rec.call in self._extended:
                continue  # a child that extends it shares at least as long a prefix
            n = _shared_len(rec, prompt_ids, shared)
            if n > best_len or (n == best_len and best is not None and n > 0 and rec.seq > best.seq):
                best, best_len = rec, n
        # Attach at the call that first held the shared ids.
        while best is not None and best.parent is not None and best_len <= best.prefix_len:
            best = best.parent
        if best_len == 0:
            best = None
        query, shown = conversation_facts(msgs)
        return Match(parent=best, prefix_len=best_len, prompt_ids=prompt_ids, extended=False, drift=0,
                     messages=msgs, tools=tools, digest=pending.digest, query=query, shown=shown)

    def _extend_appended(self, c: CallRecord, rest: list[dict], tools: tuple[dict, ...], digest: bytes,
                         suffix: np.ndarray | None = None) -> Match | None:
        """Extension rendering only `rest` (gyre's template; module docstring). suffix: its
        ids when `prepare` made them (`attach` has then checked that it extends c)."""
        query, shown = conversation_facts(rest, (c.conv_query, c.conv_shown))
        if suffix is None:
            if _drops_shown_reasoning(c, rest):
                return None
            suffix = self.encode_list(render_appended(self.tokenizer, rest, after_query=c.conv_query))
        prompt = self._prompt(c, suffix)
        drift = c.drift + c.turn_drift if self.check_drift else 0
        return Match(parent=c, prefix_len=c.full_len, prompt_ids=prompt, extended=True, drift=drift,
                     messages=(*c.messages, c.answer, *rest), tools=tools, digest=digest, query=query, shown=shown)

    def _recorded_turn_drift(self, match: Match, turn_start: int, comp: np.ndarray, text: str) -> int:
        """`_turn_drift` of a call being recorded: its ids from `turn_start` (the last turn's
        start in `match.prompt_ids`) with the completion `comp` (+ <|im_end|> when it did not
        stop), against `text`, its turn as rendered.

        The usual case is counted without building the turn's arrays, as `_turn_drift`'s
        shortcut counts it: the turn's header ids all lie in the call's own prompt (none
        sampled), neither they nor the completion before its last id hold <|im_end|>, the
        completion ends with it, and `_turn_head` applies with the header no longer than the
        head: the header ids against the head's."""
        tail = match.prompt_ids[turn_start:]
        n = len(tail)
        head = self._turn_head(text)
        if head is not None and n <= len(head) and len(comp) and int(comp[-1]) == IM_END \
                and (match.parent is None or turn_start >= match.prefix_len) \
                and comp.tolist().count(IM_END) == 1 and IM_END not in tail.tolist():
            return int(np.count_nonzero(tail != head[:n]))
        ids = np.concatenate([tail, comp])
        sampled = np.zeros(len(ids), bool)
        sampled[n:] = True
        if match.parent is not None and turn_start < match.prefix_len:
            sampled[: match.prefix_len - turn_start] = match.parent.sampled_range(turn_start, match.prefix_len)
        if not (len(comp) and int(comp[-1]) == IM_END):
            ids = np.append(ids, np.int32(IM_END))
            sampled = np.append(sampled, False)
        return self._turn_drift(ids, sampled, text)

    def _turn_drift(self, ids: np.ndarray, sampled: np.ndarray, text: str) -> int:
        """Drift of a call's last turn as an extension reuses it: `ids` (T,) the stored ids
        from the prompt's last turn start to the end (+ the closing <|im_end|> when the
        completion did not stop), `sampled` (T,) bool, against `encode(text)`, the turn as
        rendered (`gyre.serving.drift`).

        Shortcut, same count: when the turn is one chunk on both sides (a single
        <|im_end|>, at the end) and the rendered body opens with an added token, only the
        ids before the first sampled one are compared, and those lie in the encoding of the
        header up to that token (encoding splits at added tokens), so the body is not
        encoded. A model's answer usually opens so (`<think>`, `<tool_call>`)."""
        head = self._turn_head(text)
        if head is not None:
            hits = np.flatnonzero(sampled[: len(head) + 1])
            if len(hits) and int(hits[0]) <= len(head) and int(np.count_nonzero(ids == IM_END)) == 1 \
                    and int(ids[-1]) == IM_END:
                n = int(hits[0])
                return int(np.count_nonzero(ids[:n] != head[:n]))
        return count_drift(ids, sampled, self.encode(text), self._joins)

    def _turn_head(self, text: str) -> np.ndarray | None:
        """`encode(TURN_HEADER + token)` when `text` is TURN_HEADER + body + "<|im_end|>"
        with no other <|im_end|> and the body opens with exactly one of the added tokens
        the encoding splits at as written (`_splitting_tokens`); else None."""
        if not text.startswith(TURN_HEADER) or not text.endswith(IM_END_TEXT) or text.count(IM_END_TEXT) != 1:
            return None
        k = len(TURN_HEADER)
        if not self._splitting or not text.startswith(self._splitting, k):
            return None
        if self._opening is not None:  # no token is a prefix of another: the one that opens the body
            opening = self._opening.match(text, k).group()
        else:
            openings = [t for t in self._splitting if text.startswith(t, k)]
            if len(openings) != 1:
                return None
            opening = openings[0]
        head = self._heads.get(opening)
        if head is None:
            head = self._heads[opening] = self.encode(TURN_HEADER + opening)
        return head

    def full_drift(self, match: Match) -> int:
        """The drift of an extension counted on the whole request: `match.prompt_ids`
        against a fresh `encode(render(...))` of its messages, O(prompt) — the reference
        definition (`gyre.serving.drift`), for tests and audits. 0 for a branch."""
        if not match.extended or match.parent is None:
            return 0
        sampled = np.zeros(len(match.prompt_ids), bool)
        sampled[: match.prefix_len] = match.parent.sampled_mask(match.prefix_len)
        return count_drift(match.prompt_ids, sampled, self.encode(self._render(match.messages, match.tools, True)),
                           self._joins)

    # -- recording
    def record(self, match: Match, *, call: str, seq: int, answer: dict,
               completion_ids: Sequence[int]) -> CallRecord:
        """Add a served call. answer: the assistant message returned to the harness, with
        tool-call `arguments` exactly as emitted; they are cached by tool-call id.
        completion_ids: (C,) sampled ids, stop token included when the engine stopped.
        With gyre's template and drift counted, the answer's turn is rendered here (after
        delivery) and its drift counted for the next extension (`_turn_drift`). The store keeps
        `match.prompt_ids` itself, not a copy: do not modify it afterwards."""
        answer_n = normalise_message(answer)
        for tc in answer_n.get("tool_calls", ()):
            if tc["id"]:
                self.tool_args[tc["id"]] = tc["function"]["arguments"]
        comp = np.asarray(completion_ids, dtype=np.int32)
        own = np.concatenate([match.new_prompt_ids, comp]).astype(np.int32, copy=False)
        conv_key = hashlib.sha256(match.digest + message_key(answer_n)).digest()
        prompt_len = len(match.prompt_ids)
        turn_start = turn_drift = 0
        # The answer shows reasoning after the last query when its message has some, or when
        # its ids hold a think block (an empty one leaves the message none): either way a
        # later query makes the template render this turn otherwise than its ids.
        thinks = self._think_end is not None and bool(np.any(comp == self._think_end))
        conv_shown = match.shown or (match.query and (shows_reasoning(answer_n) or thinks))
        if self.incremental:
            ends = np.flatnonzero(match.prompt_ids[match.prefix_len:] == IM_END)
            if len(ends):
                turn_start = match.prefix_len + int(ends[-1]) + 1
            elif match.parent is not None:
                turn_start = _last_im_end_before(match.parent, match.prefix_len) + 1
            turn_start = min(turn_start, prompt_len)
            if self.check_drift:
                text = render_assistant_turn(self.tokenizer, answer_n, after_query=match.query)
                turn_drift = self._recorded_turn_drift(match, turn_start, comp, text)
        rec = CallRecord(call=call, seq=seq, parent=match.parent, prefix_len=match.prefix_len, own_ids=own,
                         completion_len=len(comp), messages=match.messages, tools=match.tools,
                         answer=answer_n, conv_key=conv_key, drift=match.drift, conv_query=match.query,
                         conv_shown=conv_shown, turn_start=turn_start, turn_drift=turn_drift)
        self.calls.append(rec)
        self._by_conv[conv_key] = rec
        self._by_call[call] = rec
        if match.parent is not None and match.prefix_len == match.parent.full_len:
            self._tips.pop(match.parent.call, None)  # its extension holds the newest ids
        self._tips[call] = (match.prompt_ids, comp)
        while len(self._tips) > TIP_CACHE:
            del self._tips[next(iter(self._tips))]
        if match.parent is not None and match.prefix_len == match.parent.full_len:
            self._extended.add(match.parent.call)
        return rec

    def get(self, call: str) -> CallRecord | None:
        return self._by_call.get(call)



def _drops_shown_reasoning(c: CallRecord, rest: Sequence[dict]) -> bool:
    """A real user query in `rest` after c's conversation showed reasoning (a think block in
    its ids, empty ones included), which the template then drops, so c's ids are no prefix
    of the request's rendering (a branch, not an extension)."""
    return c.conv_shown and any(is_query(m) for m in rest)

