"""The training corpus: the Python standard library's .py source, which every machine has.

Files are split into train and held-out by a stable hash of their relative path (not by
position or random draw), so the split does not move when files are added or the order changes.
Documents are joined with the EOS token, the same separator the served models see.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer

MAX_FILE_CHARS = 200_000  # a few stdlib files are generated tables; cap them so they do not dominate


@dataclass(frozen=True)
class Document:
    path: str  # relative to the stdlib root
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str, percent: int) -> bool:
    return int(hashlib.sha1(rel_path.encode()).hexdigest()[:8], 16) % 100 < percent


def read_documents(root: Path | None = None) -> list[Document]:
    """Every readable .py file under the stdlib root (site-packages excluded), sorted by path."""
    root = root or stdlib_root()
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append(Document(rel, text[:MAX_FILE_CHARS]))
    return docs


def split_documents(docs: list[Document], percent: int, max_train: int | None) -> tuple[list[Document], list[Document]]:
    """(train, held-out); `max_train` keeps a hash-ordered subset of train files for quick profiles."""
    train = [d for d in docs if not is_heldout(d.path, percent)]
    heldout = [d for d in docs if is_heldout(d.path, percent)]
    if max_train is not None:
        train = sorted(train, key=lambda d: hashlib.sha1(d.path.encode()).hexdigest())[:max_train]
        heldout = sorted(heldout, key=lambda d: hashlib.sha1(d.path.encode()).hexdigest())[: max(4, max_train // 10)]
    return train, heldout


def encode_documents(tokenizer: HFTokenizer, docs: list[Document], eos_id: int) -> np.ndarray:
    """One uint16 token stream: doc, EOS, doc, EOS, ..."""
    encoded = tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False)
    parts = []
    for enc in encoded:
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.asarray([eos_id], dtype=np.uint16))
    return np.concatenate(parts)


def sample_batch(tokens: torch.Tensor, batch: int, seq_len: int, seed: int, device: str) -> torch.Tensor:
    """[batch, seq_len + 1] random windows; the seed (derived from the step) makes a resumed run identical."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=gen)
    windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
    return windows.to(device=device, dtype=torch.long)


def eval_windows(tokens: torch.Tensor, count: int, seq_len: int) -> torch.Tensor:
    """The first `count` non-overlapping [seq_len + 1] windows of the held-out stream (fixed, for comparable figures)."""
    count = min(count, (len(tokens) - 1) // seq_len)
    return torch.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range(count)]).long()
