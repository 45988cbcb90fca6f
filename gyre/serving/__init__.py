"""Serving: chat rendering, the tokenizer, token-in/token-out matching (TITO), call
roles, the embedded model and the engine logic behind the engine-host interface."""
