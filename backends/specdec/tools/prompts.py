"""Workload prompts: code-completion prompts cut from held-out standard-library files, or a user's JSONL.

Held-out files (by the kit's stable path hash) were never trained on, so acceptance measured on
them is what a user would see on new code. A prompt ends at the end of a line, before its newline:
byte-level BPE merges a newline with the next line's indentation into one token, so a prompt that
ends in a bare newline token would steer the model towards column 0.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from specdec.tools.kit.corpus import is_heldout, read_documents

HELDOUT_PERCENT = 5
BANDS = {"short": (120, 400), "long": (800, 2000)}  # prompt length in characters


def heldout_prompts(n: int, band: str = "short", seed: int = 0) -> list[str]:
    if band not in BANDS:
        raise ValueError(f"unknown prompt band {band!r}; choose one of {', '.join(BANDS)}")
    lo, hi = BANDS[band]
    docs = [d for d in read_documents() if is_heldout(d.path, HELDOUT_PERCENT) and len(d.text) > hi + 200]
    rng = random.Random(f"{seed}-{band}")
    prompts: list[str] = []
    while len(prompts) < n:
        text = rng.choice(docs).text
        end = text.find("\n", rng.randrange(hi, len(text) - 100)) + 1
        start = text.find("\n", end - rng.randrange(lo, hi)) + 1
        prompt = text[start : end - 1]
        if prompt.strip() and lo // 2 <= len(prompt) <= hi:
            prompts.append(prompt)
    return prompts


def load_jsonl(path: str | Path) -> list[str]:
    """Prompts from a JSONL file: one object per line with a "prompt" (or "text_input") field."""
    prompts = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        prompt = obj.get("prompt", obj.get("text_input"))
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}:{i}: expected a non-empty \"prompt\" string")
        prompts.append(prompt)
    return prompts
