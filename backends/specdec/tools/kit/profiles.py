"""Training profiles: every size, step count and time share of one kit build, in one place.

`tiny` is for tests and CI (a minute or two on 2 CPU cores, step-bounded so it is reproducible);
`demo` is the shipped kit (time-bounded: it trains for whatever `--minutes` allows and can resume).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from specdec.core.models.config import LlamaConfig

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 0  # the first special token the BPE trainer adds


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int

    def config(self, vocab: int, max_positions: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.hidden // self.heads, rms_norm_eps=1e-6, rope_theta=10000.0,
            max_position_embeddings=max_positions, tie_word_embeddings=True, eos_token_id=[EOS_ID],
        )


@dataclass(frozen=True)
class Stage:
    """One training stage's limits: it stops at `steps` or when its share of the time budget is spent."""

    steps: int
    lr: float
    batch: int
    time_share: float  # fraction of `--minutes` this stage may use
    warmup: int = 50


@dataclass(frozen=True)
class Profile:
    name: str
    vocab: int
    seq_len: int
    target: ModelShape
    draft: ModelShape
    medusa_heads: int
    stages: dict[str, Stage]
    minutes: float | None  # default total time budget; None = step-bounded only
    max_train_files: int | None  # corpus subset for quick profiles
    tokenizer_chars: int  # characters of training text the BPE trainer sees
    eval_windows: int
    eval_prompts: int
    eval_new_tokens: int
    compile: bool
    seed: int = 1234
    heldout_percent: int = 5
    eagle_layers: int = 1  # decoder layers of the EAGLE head (one in the released EAGLE-1 heads)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


STAGE_ORDER = ("target", "draft", "eagle", "medusa")

PROFILES: dict[str, Profile] = {
    "tiny": Profile(
        name="tiny", vocab=512, seq_len=64,
        target=ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=192),
        draft=ModelShape(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=96),
        medusa_heads=3,
        stages={
            "target": Stage(steps=120, lr=3e-3, batch=16, time_share=0.4, warmup=10),
            "draft": Stage(steps=60, lr=3e-3, batch=16, time_share=0.2, warmup=5),
            "eagle": Stage(steps=60, lr=3e-3, batch=16, time_share=0.2, warmup=5),
            "medusa": Stage(steps=60, lr=3e-3, batch=16, time_share=0.2, warmup=5),
        },
        minutes=None, max_train_files=60, tokenizer_chars=400_000,
        eval_windows=8, eval_prompts=4, eval_new_tokens=24, compile=False,
    ),
    # Sized for CPU-hours: 1 torch thread gives ~1-2k tokens/s on the target, so a 4-layer d=256
    # model sees a few million tokens per hour; deeper models would be further from converged.
    "demo": Profile(
        name="demo", vocab=2048, seq_len=256,
        target=ModelShape(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=768),
        draft=ModelShape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=384),
        medusa_heads=3,
        stages={
            "target": Stage(steps=200_000, lr=2e-3, batch=8, time_share=0.1171, warmup=100),
            "draft": Stage(steps=200_000, lr=3e-3, batch=8, time_share=0.1766, warmup=50),
            "eagle": Stage(steps=200_000, lr=2e-3, batch=8, time_share=0.5991, warmup=50),
            "medusa": Stage(steps=200_000, lr=2e-3, batch=8, time_share=0.1072, warmup=50),
        },
        minutes=538.0, max_train_files=None, tokenizer_chars=12_000_000,
        eval_windows=64, eval_prompts=16, eval_new_tokens=64, compile=True, eagle_layers=2,
    ),
}
