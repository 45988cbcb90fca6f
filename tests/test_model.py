"""The seeded embedded-default model: spec validation, determinism, checkpoint round trip."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from gyre.serving import tokenizer as qtok
from gyre.serving.chat import render
from gyre.serving.model import MAX_PARAMETERS, ModelSpec, build_model, init_model, load_model, load_tokenizer

IDS = torch.tensor([[qtok.IM_START, 872, 198, 9707, 1879, qtok.IM_END, 198, qtok.IM_START, 77091, 198]])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    old = os.umask(0o022)  # the usual umask, under which the weights' 0600 stands out
    try:
        return init_model(tmp_path_factory.mktemp("model"))
    finally:
        os.umask(old)


def test_default_spec_parameter_count_is_hand_worked():
    spec = ModelSpec()
    # embedding 151936·64 = 9,723,904; per layer: q 64·64 + k 64·32 + v 64·32 + o 64·64 + q/k norms 2·16
    # + SwiGLU 3·64·192 + two RMSNorms 2·64 = 49,312; two layers 98,624; final norm 64.
    assert spec.num_parameters() == 9_723_904 + 2 * 49_312 + 64 == 9_822_592
    assert dataclasses.replace(spec, tie_embeddings=False).num_parameters() == 9_822_592 + 9_723_904


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        ({"layers": 0}, "layers must be a positive int"),
        ({"heads": 4, "kv_heads": 3}, "multiple of kv_heads"),
        ({"head_dim": 15}, "even"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"seed": -1}, "seed"),
        ({"hidden": 256}, "at most 20000000"),
    ],
)
def test_spec_validation_names_the_rule(change, rule):
    with pytest.raises(ValueError, match=rule):
        ModelSpec(**change)


def test_built_model_matches_spec():
    spec = ModelSpec()
    model = build_model(spec)
    params = sum(p.numel() for p in model.parameters())
    assert params == spec.num_parameters() <= MAX_PARAMETERS
    assert model.config.vocab_size == qtok.VOCAB_SIZE
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not model.training


def test_same_seed_same_weights_and_rng_untouched():
    before = torch.random.get_rng_state()
    a = build_model(ModelSpec(seed=3)).state_dict()
    b = build_model(ModelSpec(seed=3)).state_dict()
    c = build_model(ModelSpec(seed=4)).state_dict()
    assert torch.equal(torch.random.get_rng_state(), before)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_checkpoint_files(checkpoint):
    names = {p.name for p in checkpoint.iterdir()}
    assert {
        "config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
    } <= names  # fmt: skip
    mode = lambda name: (checkpoint / name).stat().st_mode & 0o777  # noqa: E731
    assert mode("model.safetensors") == mode("config.json")  # readable by whoever reads the config
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["vocab_size"] == 151936
    assert config["rope_theta"] == 1e6 and config["tie_word_embeddings"] is True
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]
    tok_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == (checkpoint / "chat_template.jinja").read_text() == qtok.chat_template()


def test_init_model_is_deterministic_on_disk(checkpoint, tmp_path):
    again = init_model(tmp_path / "again")
    a, b = load_file(checkpoint / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_save_load_same_logits(checkpoint):
    fresh = build_model(ModelSpec())
    loaded = load_model(checkpoint)
    assert not loaded.training
    with torch.no_grad():
        want = fresh(IDS).logits  # (1, 10, 151936)
        got = loaded(IDS).logits
    assert got.shape == (1, IDS.shape[1], qtok.VOCAB_SIZE)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_loaded_tokenizer_matches_the_built_one(checkpoint):
    loaded, built = load_tokenizer(checkpoint), qtok.build_tokenizer()
    text = "Hi <|im_start|>user\n<tool_call>{\"a\": 1}</tool_call> 中文 🙂\n\n  x<think>y</think>"
    assert loaded.encode(text) == built.encode(text)
    assert len(loaded) == len(built) == 151669
    assert loaded.eos_token_id == qtok.IM_END and loaded.pad_token_id == qtok.ENDOFTEXT
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok"}, {"role": "tool", "content": "r"}]
    assert render(loaded, messages) == render(built, messages)
