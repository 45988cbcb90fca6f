"""The engine's settings that a recipe sets: the policy's context window.

Torch-free, so the recipe (`gyre.config`, the `[engine]` table) composes them without
importing torch; `gyre.serving.engine.EngineConfig` extends them with the settings no
recipe sets. `__post_init__` raises ValueError naming the broken rule.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineSettings:
    """What bounds one generation of the policy."""

    max_context_tokens: int = 32768
    """Prompt + completion window of the policy, in tokens: the embedded engine's limit (a
    longer prompt raises `PromptTooLong`) and the proxy's (a prompt that leaves no room gets
    the API's prompt-too-long error; completions are capped at the room left). >= 1."""

    def __post_init__(self) -> None:
        if self.max_context_tokens < 1:
            raise ValueError(f"{type(self).__name__}.max_context_tokens must be >= 1, got {self.max_context_tokens}")
