"""The engine a cell hosts, by the recipe's `engine.kind` (gyre.serving.host.EngineHost).

`make_host(kind, cfg, script=..., api_key=...)`: `embedded` → the HF model of `cfg.model_dir`
behind the SGLang-native server (`handlers.engines.embedded.EmbeddedHost`); `scripted` → the
scripted engine answering from the JSONL `script` (`handlers.engines.scripted.ScriptedEngine`),
with the tokenizer of `cfg.model_dir` (Qwen3's built-in one when the checkpoint has none) and
the policy version `cfg.initial_version`. Blocking (loads a model or a tokenizer).
"""
from __future__ import annotations

from gyre.serving.engine import Engine, EngineConfig
from gyre.serving.host import EngineHost


def make_host(kind: str, cfg: EngineConfig, *, script: str = "", api_key: str) -> EngineHost:
    """The host of `kind` (module docstring). Raises ValueError for an unknown kind or a bad
    script, OSError when a file cannot be read."""
    if kind == "embedded":
        from handlers.engines.embedded import EmbeddedHost

        return EmbeddedHost(Engine(cfg), api_key=api_key)
    if kind == "scripted":
        from gyre.serving.model import load_tokenizer
        from gyre.serving.tokenizer import build_tokenizer
        from handlers.engines.scripted import ScriptedEngine

        try:
            tokenizer = load_tokenizer(cfg.model_dir)
        except FileNotFoundError:
            tokenizer = build_tokenizer()
        return ScriptedEngine.from_script(script, tokenizer, policy_version=cfg.initial_version, seed=cfg.seed)
    raise ValueError(f"unknown engine kind {kind!r}: embedded or scripted")
