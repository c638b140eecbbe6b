"""The checkpoint's tokenizer.json, plus incremental detokenization for streaming.

Streaming sends text deltas whose concatenation must equal decoding the whole output. Byte-level
BPE can split one UTF-8 character across tokens; decoding a prefix then ends in U+FFFD, so
`IncrementalDetokenizer` holds such a tail back until the character is complete (or the stream ends).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{folder}: tokenizer.json not found")
        self.path = path
        self.hf = HFTokenizer.from_file(str(path))
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        self.eos_ids = self._eos_ids(folder)
        # no token stands for more characters than its vocabulary entry has (byte-level entries
        # spell one character per byte; added tokens are matched literally), so a text longer than
        # n * max_token_chars has more than n tokens: the bound that refuses a huge prompt before
        # tokenizing it (10 M tokens of a 20 MB prompt took 16 s and blocked its model)
        self.max_token_chars = max(map(len, self.hf.get_vocab(with_added_tokens=True)), default=1)

    def _eos_ids(self, folder: Path) -> list[int]:
        ids: list[int] = []
        cfg = folder / "config.json"
        if cfg.exists():
            eos = json.loads(cfg.read_text()).get("eos_token_id")
            ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        tok_cfg = folder / "tokenizer_config.json"
        if not ids and tok_cfg.exists():
            token = json.loads(tok_cfg.read_text()).get("eos_token")
            token = token.get("content") if isinstance(token, dict) else token
            if token is not None and self.hf.token_to_id(token) is not None:
                ids = [self.hf.token_to_id(token)]
        return ids

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def fingerprint(self) -> str:
        """What must match between a target and a draft model: the vocabulary and the merges."""
        model = json.loads(self.hf.to_str())["model"]
        return json.dumps([model.get("vocab"), model.get("merges")], sort_keys=True)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already handed out

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens, return the text that is now certain (everything, when final)."""
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids)
        end = len(text)
        if not final:
            while end > self.emitted and text[end - 1] == "\ufffd":
                end -= 1
        delta = text[self.emitted : end]
        self.emitted = end
        return delta
