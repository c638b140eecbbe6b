"""Train the byte-level BPE tokenizer (GPT-2 style) with the `tokenizers` library.

Byte-level means every string encodes (no unknown token); `<|endoftext|>` is the only special
token, id 0, used both as EOS and as the document separator in training.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from specdec.tools.kit.corpus import Document
from specdec.tools.kit.profiles import EOS_ID, EOS_TOKEN


def train_tokenizer(docs: list[Document], vocab_size: int, max_chars: int, path: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True,
    )

    def texts():
        seen = 0
        for d in docs:
            if seen >= max_chars:
                return
            seen += len(d.text)
            yield d.text

    tok.train_from_iterator(texts(), trainer)
    if tok.token_to_id(EOS_TOKEN) != EOS_ID:
        raise RuntimeError(f"{EOS_TOKEN} got id {tok.token_to_id(EOS_TOKEN)}, expected {EOS_ID}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok
