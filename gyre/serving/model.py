"""The embedded default policy: a small, seeded Qwen3-architecture model on the real vocabulary.

Contract (DESIGN.md "Model and tokenizer on the embedded default"):

- `ModelSpec` fixes the architecture and the seed; same spec → bit-identical weights.
- `init_model(out_dir, spec)` writes a normal HF checkpoint that transformers (and
  SGLang) load offline: config.json, model.safetensors (float32), generation_config.json
  (eos = [<|im_end|>, <|endoftext|>]), tokenizer.json, tokenizer_config.json carrying the
  chat template, chat_template.jinja, special_tokens_map.json.
- `load_model(dir)` → `Qwen3ForCausalLM` in eval mode; `load_tokenizer(dir)` → the
  checkpoint's tokenizer (FileNotFoundError without tokenizer files). Both use local
  files only and never reach a model hub.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import structlog
import torch

from gyre.serving import tokenizer as qtok

log = structlog.get_logger(__name__)

MAX_PARAMETERS = 20_000_000
"""Upper bound on the embedded default's parameter count (keeps CPU steps cheap)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """Architecture and seed of a Qwen3ForCausalLM on Qwen3's padded vocabulary (151,936)."""

    layers: int = 2  # decoder layers
    hidden: int = 64  # residual width
    heads: int = 4  # query heads
    kv_heads: int = 2  # key/value heads (grouped-query attention); divides `heads`
    head_dim: int = 16  # width of one attention head; even (rotary pairs)
    intermediate: int = 192  # SwiGLU hidden width
    max_position: int = 32768  # longest sequence in tokens (rotary table length)
    rope_theta: float = 1e6  # rotary base frequency (Qwen3's value)
    tie_embeddings: bool = True  # output layer shares the input embedding matrix
    seed: int = 0  # torch seed for weight initialisation

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelSpec.{name} must be a positive int, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelSpec.heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelSpec.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelSpec.rope_theta must be > 0, got {self.rope_theta!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"ModelSpec.seed must be a non-negative int, got {self.seed!r}")
        if self.num_parameters() > MAX_PARAMETERS:
            raise ValueError(
                f"ModelSpec has {self.num_parameters()} parameters; the embedded default allows at most {MAX_PARAMETERS}"
            )

    def num_parameters(self) -> int:
        """Trainable parameters of the Qwen3ForCausalLM this spec builds (tied weights counted once).

        embedding V·H; per layer: q (H·n·d) + k, v (H·n_kv·d each) + o (n·d·H) + q/k norms (2d)
        + SwiGLU (3·H·I) + two RMSNorms (2H); final RMSNorm H; untied output layer V·H.
        """
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d * 2 + h * self.kv_heads * d * 2 + 2 * d
        layer = attn + 3 * h * self.intermediate + 2 * h
        head = 0 if self.tie_embeddings else qtok.VOCAB_SIZE * h
        return qtok.VOCAB_SIZE * h + self.layers * layer + h + head


def qwen3_config(spec: ModelSpec):
    """The `transformers.Qwen3Config` for `spec` (vocab 151,936, float32, Qwen3 special ids)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=qtok.VOCAB_SIZE,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position,
        rope_parameters={"rope_type": "default", "rope_theta": float(spec.rope_theta)},
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tie_embeddings,
        attention_bias=False,
        use_sliding_window=False,
        bos_token_id=qtok.ENDOFTEXT,
        eos_token_id=qtok.IM_END,
        pad_token_id=qtok.ENDOFTEXT,
        dtype="float32",
    )


def build_model(spec: ModelSpec = ModelSpec()):
    """A freshly initialised `Qwen3ForCausalLM` (float32, eval mode), seeded by `spec.seed`.

    The global torch RNG is left untouched (the seed applies inside a forked RNG).
    """
    from transformers import Qwen3ForCausalLM

    config = qwen3_config(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(config)
    return model.to(torch.float32).eval()


def write_tokenizer(out_dir: str | Path) -> None:
    """Write the Qwen3 tokenizer files into `out_dir` (tokenizer.json, tokenizer_config.json
    with the chat template, chat_template.jinja, special_tokens_map.json)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(qtok.tokenizer_json_path(), out / "tokenizer.json")
    config = qtok.tokenizer_config()
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", "utf-8")
    (out / "chat_template.jinja").write_text(config["chat_template"], "utf-8")
    special = {
        "additional_special_tokens": list(qtok.EXTRA_SPECIAL_TOKENS),
        "eos_token": config["eos_token"],
        "pad_token": config["pad_token"],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", "utf-8")


def weights_readable_as_config(out: Path) -> None:
    """Give `out`'s *.safetensors the mode of its config.json. save_pretrained writes the
    weights through a temporary file (mode 0600) and config.json with open() (the umask's
    mode): an engine or trainer of another user that reads the one could not read the other.
    Links and files this user may not change are left as they are (a warning)."""
    mode = (out / "config.json").stat().st_mode & 0o777
    for path in out.glob("*.safetensors"):
        if path.is_symlink():
            continue
        try:
            path.chmod(mode)
        except PermissionError as exc:
            log.warning("model.weights.mode_unchanged", path=str(path), error=str(exc))


def init_model(out_dir: str | Path, spec: ModelSpec = ModelSpec()) -> Path:
    """Build the seeded model for `spec` and save it with its tokenizer as an HF checkpoint.

    Returns the checkpoint directory (created if missing; existing files are overwritten).
    """
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(spec)
    model.save_pretrained(out)
    weights_readable_as_config(out)
    _add_legacy_config_keys(out / "config.json", spec)
    GenerationConfig(
        bos_token_id=qtok.ENDOFTEXT,
        eos_token_id=list(qtok.STOP_IDS),
        pad_token_id=qtok.ENDOFTEXT,
    ).save_pretrained(out)
    write_tokenizer(out)
    log.info(
        "model.init.finished",
        out_dir=str(out),
        parameters=sum(p.numel() for p in model.parameters()),
        spec=dataclasses.asdict(spec),
    )
    return out


def _add_legacy_config_keys(path: Path, spec: ModelSpec) -> None:
    """Also spell rope_theta / torch_dtype the transformers-4 way, so older readers (SGLang
    images pinned to transformers 4.x) see the same rotary base and dtype."""
    config = json.loads(path.read_text("utf-8"))
    config.setdefault("rope_theta", float(spec.rope_theta))
    config.setdefault("torch_dtype", "float32")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", "utf-8")


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    """The checkpoint in `model_dir` as a `Qwen3ForCausalLM` in eval mode, from local files only.

    Errors: `OSError` when the directory lacks the checkpoint files.
    """
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)
    return model.eval()


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: `path` itself when it is a file, else the
    shards its index names, else its `model.safetensors`. Raises FileNotFoundError."""
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


TOKENIZER_SETS = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",), ("vocab.txt",))
"""Files of which one complete set makes a tokenizer (a fast tokenizer's tokenizer.json, BPE
vocabulary and merges, a SentencePiece model, a WordPiece vocabulary)."""


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's tokenizer (with its chat template), from local files only.

    Errors: `FileNotFoundError` when the directory holds no complete set of tokenizer files
    (`TOKENIZER_SETS`): transformers would otherwise build a tokenizer of a few special
    tokens from the configs alone, and every encode and decode would be wrong.
    """
    from transformers import AutoTokenizer

    root = Path(model_dir)
    if not any(all((root / name).is_file() for name in names) for names in TOKENIZER_SETS):
        raise FileNotFoundError(f"no tokenizer in {model_dir}: none of "
                                + ", ".join(" + ".join(names) for names in TOKENIZER_SETS))
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
