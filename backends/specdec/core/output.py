"""The output side of a request: committed tokens -> stop conditions -> detokenized, streamed text.

The engine decides which tokens a step commits; an OutputStream decides what of them the client
gets and when: EOS (after min_tokens) and max_tokens end the output at a token, stop strings end it
inside the text (the text up to the stop string is sent, the stop string is not), and while a stop
string could still be completing, the text that may be its start is held back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specdec.core.models.tokenizer import IncrementalDetokenizer, Tokenizer
from specdec.core.sequence import Output, Sequence


@dataclass
class Committed:
    """What one commit did: the tokens the output kept, why it ended (None: still running), and
    how much of the text may be sent now."""

    tokens: list[int]
    reason: str | None
    text_end: int


@dataclass
class OutputStream:
    seq: Sequence
    eos_ids: list[int]
    detok: IncrementalDetokenizer
    text: str = ""
    sent: int = 0  # characters of text already streamed
    stop_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.stop_len = max(map(len, self.seq.params.stop), default=0)

    @classmethod
    def open(cls, seq: Sequence, tokenizer: Tokenizer, eos_ids: list[int]) -> "OutputStream":
        return cls(seq, eos_ids, IncrementalDetokenizer(tokenizer))

    def commit(self, new_tokens: list[int]) -> Committed:
        """Append committed tokens to the sequence up to the first stop condition."""
        seq, p = self.seq, self.seq.params
        reason = None
        taken: list[int] = []
        for t in new_tokens:
            if t in self.eos_ids and not p.ignore_eos and len(seq.output_ids) >= p.min_tokens:
                reason = "eos"
                break
            taken.append(t)
            seq.output_ids.append(t)
            seq.tokens.append(t)
            if len(seq.output_ids) >= p.max_tokens:
                reason = "length"
                break
        seq.stats.output_tokens = len(seq.output_ids)
        if seq.stats.first_token is None and taken:
            seq.stats.first_token = time.perf_counter()
        self.text += self.detok.push(taken, final=reason is not None)
        end = len(self.text)
        if p.stop:
            window = self.text[max(0, self.sent - self.stop_len):]
            hits = [window.find(s) for s in p.stop if s in window]
            if hits:
                end = len(self.text) - len(window) + min(hits)
                reason = "stop"
            elif reason is None:  # hold back what could be the start of a stop string
                end = max(self.sent, end - self.stop_len + 1)
        return Committed(taken, reason, end)

    def send(self, end: int | None, token_ids, finished: bool = False, reason: str | None = None,
             error: str | None = None) -> None:
        """Stream the text up to `end` (None: all of it) not sent yet, with these token ids."""
        end = len(self.text) if end is None else end
        text = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        seq = self.seq
        if text or token_ids or finished:  # a snapshot of the counters, consistent with this text
            seq.on_output(Output(seq.request_id, text, list(token_ids), finished, reason, seq.stats.snapshot(), error))
