"""gyre.serving.engine on a tiny Qwen3 model on CPU: behaviour log-probs, sampling, stops,
seeds, per-execution prefix KV reuse, weight updates between decode steps, abort."""
from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from gyre.serving.engine import (
    Engine,
    EngineConfig,
    EngineReleased,
    GenerateRequest,
    InvalidRequest,
    NoTokenizer,
    PromptTooLong,
    SamplingParams,
    WeightLoadError,
    nucleus_mask,
    sample_token,
)

VOCAB = 151936


def build_tiny_model(out_dir, seed: int = 0, tie: bool = False) -> str:
    """A seeded 2-layer Qwen3 with the real vocabulary size, saved with save_pretrained."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32768,
        tie_word_embeddings=tie,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    return build_tiny_model(base / "v0", seed=0), build_tiny_model(base / "v1", seed=1)


@pytest.fixture(scope="module")
def engine(model_dirs):
    """A shared engine for tests that do not change its weights."""
    return Engine(EngineConfig(model_dir=model_dirs[0]))


def prompt(n: int, seed: int = 0) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(int(i) for i in torch.randint(0, 151000, (n,), generator=g))


def wait_for(cond, what: str, bound_s: float = 60.0) -> None:
    """Polls a condition (progress of another thread); the bound only guards against hangs."""
    deadline = time.monotonic() + bound_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.005)


# --- sampling, hand-worked -------------------------------------------------


def test_nucleus_mask_hand_worked():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # mass strictly before each id: 0, 0.5, 0.8, 0.95
    assert nucleus_mask(probs, 0.7).tolist() == [True, True, False, False]
    assert nucleus_mask(probs, 0.5).tolist() == [True, False, False, False]
    assert nucleus_mask(probs, 0.81).tolist() == [True, True, True, False]
    assert nucleus_mask(probs * 10, 0.7).tolist() == [True, True, False, False]  # any scale
    assert nucleus_mask(torch.tensor([1.0, 0.0]), 0.01).tolist() == [True, False]


def test_sample_token_logprob_is_before_truncation():
    logits = torch.tensor([2.0, 1.0, 0.0])
    # T = 2: scaled logits 1, 0.5, 0 -> log p(0) = 1 - ln(e + e^0.5 + 1)
    want = 1.0 - math.log(math.e + math.exp(0.5) + 1.0)
    g = torch.Generator().manual_seed(0)
    tok, lp = sample_token(logits, SamplingParams(temperature=2.0, top_k=1), g)
    assert tok == 0 and lp == pytest.approx(want, abs=1e-6)  # top-k = 1 kept p = 1, log-prob is not 0
    tok, lp = sample_token(logits, SamplingParams(temperature=2.0, top_p=0.3), g)
    assert tok == 0 and lp == pytest.approx(want, abs=1e-6)
    # greedy: argmax, log-prob under T = 1: 2 - ln(e^2 + e + 1)
    for greedy in (0.0, 1e-300, 9e-7):  # below GREEDY_BELOW, as SGLang: not a division by ~0 (NaN)
        tok, lp = sample_token(logits, SamplingParams(temperature=greedy), g)
        assert tok == 0 and lp == pytest.approx(2.0 - math.log(math.exp(2) + math.e + 1.0), abs=1e-6)
    # top-k = 2 then top-p over the renormalised pair: p = (e, e^.5)/(e + e^.5) = 0.62, 0.38
    seen = {sample_token(logits, SamplingParams(temperature=2.0, top_k=2, top_p=0.7), g)[0] for _ in range(200)}
    assert seen == {0, 1}
    seen = {sample_token(logits, SamplingParams(temperature=2.0, top_k=2, top_p=0.6), g)[0] for _ in range(50)}
    assert seen == {0}


def test_sampling_params_validation():
    for bad in (dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(max_new_tokens=-1)):
        with pytest.raises(InvalidRequest):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="max_context_tokens"):
        EngineConfig(model_dir="x", max_context_tokens=0)


# --- generation ------------------------------------------------------------


def full_forward_logprobs(engine: Engine, ids: tuple[int, ...], out: tuple[int, ...], temperature: float):
    """log_softmax(logits / T) of each output id from one forward over prompt + output."""
    x = torch.tensor([list(ids) + list(out[:-1])])
    with torch.no_grad():
        logits = engine.model(input_ids=x).logits[0, len(ids) - 1 :]  # (C, V)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(1, torch.tensor(out).unsqueeze(1)).squeeze(1)


def test_logprobs_match_full_forward_with_truncation(engine):
    ids = prompt(20)
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=12, seed=7)
    res = engine.generate(GenerateRequest(rid="lp", input_ids=ids, sampling=sp))
    assert len(res.output_ids) == len(res.logprobs) == 12 and res.finish == "length"
    want = full_forward_logprobs(engine, ids, res.output_ids, 0.8)
    assert torch.allclose(torch.tensor(res.logprobs), want, atol=1e-4)
    assert res.versions == ((0, 12, 0),) and res.weight_version == 0
    assert res.prompt_tokens == 20 and res.cached_tokens == 0


def test_greedy_logprobs_under_unit_temperature(engine):
    ids = prompt(10, seed=1)
    res = engine.generate(GenerateRequest(rid="g", input_ids=ids, sampling=SamplingParams(temperature=0, max_new_tokens=6)))
    want = full_forward_logprobs(engine, ids, res.output_ids, 1.0)
    assert torch.allclose(torch.tensor(res.logprobs), want, atol=1e-4)
    x = torch.tensor([list(ids) + list(res.output_ids[:-1])])
    with torch.no_grad():
        argmax = engine.model(input_ids=x).logits[0, len(ids) - 1 :].argmax(-1)
    assert tuple(argmax.tolist()) == res.output_ids


def test_stop_token_included(engine):
    ids = prompt(10, seed=2)
    free = engine.generate(GenerateRequest(rid="s0", input_ids=ids, sampling=SamplingParams(temperature=0, max_new_tokens=8)))
    stop_id = free.output_ids[3]
    first = free.output_ids.index(stop_id)
    sp = SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(stop_id,))
    res = engine.generate(GenerateRequest(rid="s1", input_ids=ids, sampling=sp))
    assert res.output_ids == free.output_ids[: first + 1] and res.output_ids[-1] == stop_id
    assert res.finish == "stop" and res.matched_stop == stop_id
    assert len(res.logprobs) == len(res.output_ids) and res.versions == ((0, first + 1, 0),)
    ignored = engine.generate(GenerateRequest(rid="s2", input_ids=ids, sampling=dataclass_replace(sp, ignore_eos=True)))
    assert ignored.output_ids == free.output_ids and ignored.finish == "length"


def dataclass_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def test_length_limits(model_dirs):
    eng = Engine(EngineConfig(model_dir=model_dirs[0], max_context_tokens=16, max_completion_tokens=5))
    res = eng.generate(GenerateRequest(rid="a", input_ids=prompt(4), sampling=SamplingParams(max_new_tokens=3, seed=1)))
    assert len(res.output_ids) == 3 and res.finish == "length"
    res = eng.generate(GenerateRequest(rid="b", input_ids=prompt(4), sampling=SamplingParams(max_new_tokens=100, seed=1)))
    assert len(res.output_ids) == 5 and res.finish == "length"  # clamped to max_completion_tokens
    res = eng.generate(GenerateRequest(rid="c", input_ids=prompt(13), sampling=SamplingParams(max_new_tokens=100, seed=1)))
    assert len(res.output_ids) == 3 and res.finish == "length"  # 13 + 3 = max_context_tokens
    res = eng.generate(GenerateRequest(rid="d", input_ids=prompt(4), sampling=SamplingParams(max_new_tokens=0)))
    assert res.output_ids == () and res.finish == "length" and res.versions == ()
    with pytest.raises(PromptTooLong, match="17 tokens"):
        eng.generate(GenerateRequest(rid="e", input_ids=prompt(17)))
    with pytest.raises(InvalidRequest):
        eng.generate(GenerateRequest(rid="f", input_ids=()))
    with pytest.raises(InvalidRequest, match="input_ids"):
        eng.generate(GenerateRequest(rid="g", input_ids=(1, VOCAB)))


def test_same_seed_same_output(engine):
    ids = prompt(8, seed=3)
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, seed=123)
    a = engine.generate(GenerateRequest(rid="x1", input_ids=ids, sampling=sp))
    b = engine.generate(GenerateRequest(rid="x2", input_ids=ids, sampling=sp))
    c = engine.generate(GenerateRequest(rid="x3", input_ids=ids, sampling=dataclass_replace(sp, seed=124)))
    assert a.output_ids == b.output_ids and a.logprobs == b.logprobs
    assert c.output_ids != a.output_ids


def test_engine_seed_makes_unseeded_requests_reproducible(model_dirs):
    runs = []
    for _ in range(2):
        eng = Engine(EngineConfig(model_dir=model_dirs[0], seed=5))
        sp = SamplingParams(max_new_tokens=6)
        runs.append([eng.generate(GenerateRequest(rid=str(i), input_ids=prompt(6), sampling=sp)).output_ids for i in range(2)])
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]


# --- per-execution prefix KV cache -----------------------------------------


def test_prefix_reuse_is_identical_to_no_cache(model_dirs):
    eng = Engine(EngineConfig(model_dir=model_dirs[0]))
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    p1 = prompt(30, seed=4)
    first = eng.generate(GenerateRequest(rid="c1", input_ids=p1, sampling=greedy, execution="e1"))
    assert first.cached_tokens == 0
    # the harness's next call extends the previous prompt + answer
    p2 = p1 + first.output_ids + prompt(7, seed=5)
    cached = eng.generate(GenerateRequest(rid="c2", input_ids=p2, sampling=greedy, execution="e1"))
    plain = eng.generate(GenerateRequest(rid="c3", input_ids=p2, sampling=greedy))
    # the last sampled id of call 1 was never fed, so its KV is not in the cache
    assert cached.cached_tokens == len(p1) + len(first.output_ids) - 1
    assert cached.output_ids == plain.output_ids
    assert torch.allclose(torch.tensor(cached.logprobs), torch.tensor(plain.logprobs), atol=1e-4)
    # a branch at an earlier point crops the cache to the common prefix
    p3 = p1[:12] + prompt(5, seed=6)
    branch = eng.generate(GenerateRequest(rid="c4", input_ids=p3, sampling=greedy, execution="e1"))
    plain3 = eng.generate(GenerateRequest(rid="c5", input_ids=p3, sampling=greedy))
    assert branch.cached_tokens == 12 and branch.output_ids == plain3.output_ids
    # an identical prompt reuses all but its last id
    again = eng.generate(GenerateRequest(rid="c6", input_ids=p3, sampling=greedy, execution="e1"))
    assert again.cached_tokens == len(p3) - 1 and again.output_ids == plain3.output_ids
    # other executions do not see it; flush and weight updates drop it
    other = eng.generate(GenerateRequest(rid="c7", input_ids=p3, sampling=greedy, execution="e2"))
    assert other.cached_tokens == 0
    assert eng.flush_cache() == 2
    assert eng.generate(GenerateRequest(rid="c8", input_ids=p3, sampling=greedy, execution="e1")).cached_tokens == 0
    eng.load_weights(model_dirs[0], 1)
    assert eng.generate(GenerateRequest(rid="c9", input_ids=p3, sampling=greedy, execution="e1")).cached_tokens == 0


def test_prefix_cache_lru_bound(model_dirs):
    eng = Engine(EngineConfig(model_dir=model_dirs[0], kv_cache_executions=2))
    sp = SamplingParams(temperature=0, max_new_tokens=2)
    for e in ("a", "b", "c"):
        eng.generate(GenerateRequest(rid=e, input_ids=prompt(5), sampling=sp, execution=e))
    hits = {e: eng.generate(GenerateRequest(rid=e + "2", input_ids=prompt(5), sampling=sp, execution=e)).cached_tokens for e in ("a", "c")}
    assert hits == {"a": 0, "c": 4}


# --- weights, abort, concurrency -------------------------------------------


def start(eng: Engine, req: GenerateRequest) -> tuple[threading.Thread, dict]:
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault("res", eng.generate(req)), daemon=True)
    th.start()
    return th, box


def test_load_weights_mid_generation_splits_version_spans(model_dirs):
    eng = Engine(EngineConfig(model_dir=model_dirs[0], stop_ids=()))
    sp = SamplingParams(max_new_tokens=4000, seed=1)
    th, box = start(eng, GenerateRequest(rid="long", input_ids=prompt(8), sampling=sp, execution="e"))
    wait_for(lambda: eng.in_flight().get("long", 0) >= 5, "5 tokens")
    eng.load_weights(model_dirs[1], 7)
    assert eng.weight_version == 7
    n = eng.in_flight()["long"]
    wait_for(lambda: eng.in_flight().get("long", 0) >= n + 5, "5 more tokens")
    assert eng.abort("long")
    th.join(60)
    res = box["res"]
    assert res.finish == "abort" and res.weight_version == 7
    (s0, e0, v0), (s1, e1, v1) = res.versions
    # a token whose forward ran just before the update may be appended after `n` was read
    assert (s0, v0, v1, e1) == (0, 0, 7, len(res.output_ids)) and e0 == s1 and 5 <= e0 <= n + 1
    # the KV of that call spans two policy versions: it must not be reused
    again = eng.generate(GenerateRequest(rid="next", input_ids=prompt(8), sampling=SamplingParams(max_new_tokens=1), execution="e"))
    assert again.cached_tokens == 0
    # new weights really serve: greedy output equals a fresh engine on v1's checkpoint
    fresh = Engine(EngineConfig(model_dir=model_dirs[1]))
    greedy = SamplingParams(temperature=0, max_new_tokens=5)
    assert (
        eng.generate(GenerateRequest(rid="g1", input_ids=prompt(9), sampling=greedy)).output_ids
        == fresh.generate(GenerateRequest(rid="g2", input_ids=prompt(9), sampling=greedy)).output_ids
    )


def test_load_weights_rejects_misfit_and_keeps_weights(model_dirs, tmp_path):
    from safetensors.torch import save_file

    eng = Engine(EngineConfig(model_dir=model_dirs[0]))
    before = eng.model.model.norm.weight.clone()
    save_file({"model.norm.weight": torch.ones(63)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(WeightLoadError, match="shape"):
        eng.load_weights(tmp_path / "bad.safetensors", 1)
    save_file({"model.norm.weight": torch.ones(64)}, str(tmp_path / "partial.safetensors"))
    with pytest.raises(WeightLoadError, match="lacks"):
        eng.load_weights(tmp_path / "partial.safetensors", 1)
    with pytest.raises(WeightLoadError, match="no model.safetensors"):
        eng.load_weights(tmp_path, 1)
    assert torch.equal(eng.model.model.norm.weight, before) and eng.weight_version == 0


def test_load_weights_tied_embeddings(tmp_path):
    d0 = build_tiny_model(tmp_path / "t0", seed=0, tie=True)
    d1 = build_tiny_model(tmp_path / "t1", seed=1, tie=True)
    eng = Engine(EngineConfig(model_dir=d0))
    eng.load_weights(d1, 1)
    assert torch.equal(eng.model.lm_head.weight, eng.model.model.embed_tokens.weight)
    fresh = Engine(EngineConfig(model_dir=d1))
    assert torch.equal(eng.model.lm_head.weight, fresh.model.lm_head.weight)


def test_release_frees_the_weights_and_kv_until_a_load_restores_them(model_dirs, tmp_path):
    """A cell leaving rollout: the live tensor storage drops by the weights and the prefix KV
    caches, the call in flight ends `abort`, calls are refused; a load of the same version
    (the engine's own) serves again, as a fresh engine of that checkpoint does."""
    from gyre.serving.storage import live_tensor_bytes

    eng = Engine(EngineConfig(model_dir=model_dirs[0], stop_ids=()))
    weights = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    eng.generate(GenerateRequest(rid="kv", input_ids=prompt(40), sampling=SamplingParams(max_new_tokens=6, seed=1),
                                 execution="e"))
    cfg = eng.model.config
    kv = (40 + 6) * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # float32 K and V
    th, box = start(eng, GenerateRequest(rid="long", input_ids=prompt(8), sampling=SamplingParams(max_new_tokens=4000)))
    wait_for(lambda: eng.in_flight().get("long", 0) >= 2, "a call in flight")
    before = live_tensor_bytes()
    eng.release()
    th.join(60)
    freed = before - live_tensor_bytes()
    assert box["res"].finish == "abort" and eng.released and eng.in_flight() == {}
    assert freed >= weights + kv, (freed, weights, kv)
    assert eng.export_kv("e") is None
    with pytest.raises(EngineReleased, match="released"):
        eng.generate(GenerateRequest(rid="x", input_ids=prompt(5)))
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.ones(63)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(WeightLoadError, match="shape"):
        eng.load_weights(tmp_path / "bad.safetensors", 0)
    assert eng.released  # a load that does not fit leaves it released
    eng.load_weights(model_dirs[0], 0)  # the version it served: loaded all the same
    assert not eng.released and eng.weight_version == 0
    greedy = SamplingParams(temperature=0, max_new_tokens=5)
    fresh = Engine(EngineConfig(model_dir=model_dirs[0], stop_ids=()))
    got = eng.generate(GenerateRequest(rid="g1", input_ids=prompt(9), sampling=greedy, execution="e"))
    want = fresh.generate(GenerateRequest(rid="g2", input_ids=prompt(9), sampling=greedy))
    assert (got.output_ids, got.logprobs, got.cached_tokens) == (want.output_ids, want.logprobs, 0)


def test_abort_and_interleaving(model_dirs):
    eng = Engine(EngineConfig(model_dir=model_dirs[0], stop_ids=()))
    th, box = start(eng, GenerateRequest(rid="A", input_ids=prompt(8), sampling=SamplingParams(max_new_tokens=4000, seed=1)))
    wait_for(lambda: eng.in_flight().get("A", 0) >= 1, "A to start")
    with pytest.raises(InvalidRequest, match="in flight"):
        eng.generate(GenerateRequest(rid="A", input_ids=prompt(3)))
    # B finishes while A still runs: decode steps interleave
    short = eng.generate(GenerateRequest(rid="B", input_ids=prompt(5), sampling=SamplingParams(max_new_tokens=5, seed=2)))
    assert len(short.output_ids) == 5 and "A" in eng.in_flight()
    assert eng.abort("A") and not eng.abort("nope")
    th.join(60)
    res = box["res"]
    assert res.finish == "abort" and 1 <= len(res.output_ids) < 4000
    assert len(res.logprobs) == len(res.output_ids) and res.versions[-1][1] == len(res.output_ids)
    assert eng.in_flight() == {}
    # a cancel event set before the first forward aborts with no tokens
    ev = threading.Event()
    ev.set()
    res = eng.generate(GenerateRequest(rid="C", input_ids=prompt(5)), cancel=ev)
    assert res.finish == "abort" and res.output_ids == () and res.versions == ()


def test_chunked_prefill_is_identical(model_dirs, engine):
    chunked = Engine(EngineConfig(model_dir=model_dirs[0], prefill_chunk_tokens=7))
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    ids = prompt(30, seed=8)
    a = chunked.generate(GenerateRequest(rid="k1", input_ids=ids, sampling=greedy, execution="e"))
    b = engine.generate(GenerateRequest(rid="k2", input_ids=ids, sampling=greedy))
    assert a.output_ids == b.output_ids
    assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    longer = ids + a.output_ids + prompt(20, seed=9)
    c = chunked.generate(GenerateRequest(rid="k3", input_ids=longer, sampling=greedy, execution="e"))
    d = engine.generate(GenerateRequest(rid="k4", input_ids=longer, sampling=greedy))
    assert c.cached_tokens == 35 and c.output_ids == d.output_ids


def test_stop_string_ends_with_the_id_that_completes_it(engine, model_dirs, tmp_path):
    """A stop string ends the generation at the first id whose text completes it; its ids
    stay in the output and the string is reported (SGLang's string stop). Decoding needs
    the checkpoint's tokenizer: without one the request is refused."""
    from gyre.serving.model import load_tokenizer, write_tokenizer
    from gyre.serving.tokenizer import fast_decoder

    ids = prompt(10, seed=3)
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    for rid in ("t0", "t0b"):  # the missing tokenizer is looked for once, then remembered
        with pytest.raises(NoTokenizer, match="no tokenizer"):
            engine.generate(GenerateRequest(rid=rid, input_ids=ids, sampling=dataclass_replace(greedy, stop=("x",))))
    assert engine._decode is False
    import shutil

    shutil.copytree(model_dirs[0], tmp_path / "m")
    write_tokenizer(tmp_path / "m")
    eng = Engine(EngineConfig(model_dir=str(tmp_path / "m")))
    free = eng.generate(GenerateRequest(rid="t1", input_ids=ids, sampling=greedy))
    decode = fast_decoder(load_tokenizer(tmp_path / "m"))
    texts = [decode(list(free.output_ids[:n])) for n in range(len(free.output_ids) + 1)]
    # a stop string that starts in the text of the second id and ends in the third's
    j = len(texts[2])
    assert texts[-1].startswith(texts[2]) and texts[3] != texts[2] and texts[3].isprintable()
    stop = texts[-1][j - 1: j + 1]
    first = next(n for n in range(1, len(texts)) if stop in texts[n])
    assert first == 3
    res = eng.generate(GenerateRequest(rid="t2", input_ids=ids, sampling=dataclass_replace(greedy, stop=("zzz", stop))))
    assert res.output_ids == free.output_ids[:first] and res.logprobs == free.logprobs[:first]
    assert (res.finish, res.matched_stop) == ("stop", stop)
    ignored = eng.generate(GenerateRequest(rid="t3", input_ids=ids, sampling=dataclass_replace(
        greedy, stop=(stop,), ignore_eos=True)))
    assert ignored.output_ids == res.output_ids  # ignore_eos ignores stop ids, not stop strings
    never = eng.generate(GenerateRequest(rid="t4", input_ids=ids, sampling=dataclass_replace(greedy, stop=("\x00\x01",))))
    assert never.output_ids == free.output_ids and never.finish == free.finish
    with pytest.raises(InvalidRequest, match="non-empty"):
        SamplingParams(stop=("",))
    (tmp_path / "bad").mkdir()
    shutil.copytree(model_dirs[0], tmp_path / "bad", dirs_exist_ok=True)
    (tmp_path / "bad" / "tokenizer.json").write_text("{}")  # corrupt: the load raises a bare Exception
    bad = Engine(EngineConfig(model_dir=str(tmp_path / "bad")))
    for rid in ("u0", "u1"):
        with pytest.raises(NoTokenizer):
            bad.generate(GenerateRequest(rid=rid, input_ids=ids, sampling=dataclass_replace(greedy, stop=("x",))))


def test_seeded_calls_do_not_depend_on_what_shares_the_engine(model_dirs):
    """A seeded call's tokens and log-probs are bit-identical whether it runs alone or
    interleaved, decode step by decode step, with other calls (the engine runs one request
    per forward and one generator per request): what makes a seeded run reproducible."""
    import threading

    eng = Engine(EngineConfig(model_dir=model_dirs[0]))
    reqs = [GenerateRequest(rid=f"r{i}", input_ids=prompt(5 + i, seed=i),
                            sampling=SamplingParams(temperature=1.0, max_new_tokens=12, seed=100 + i)) for i in range(4)]
    alone = [eng.generate(r) for r in reqs]
    together: dict[str, object] = {}
    threads = [threading.Thread(target=lambda r=r: together.__setitem__(r.rid, eng.generate(r))) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a in alone:
        b = together[a.rid]
        assert (a.output_ids, a.logprobs) == (b.output_ids, b.logprobs)
    assert len({a.output_ids for a in alone}) > 1
