"""Hugging Face transformers as a peer in `specdec bench --peer hf`: its plain, assisted (draft
model) and prompt-lookup greedy generation on the same checkpoints (HF layout) and the same
prompt token ids, timed in the same interleaved rounds as specdec.

Each peer method is paired with the specdec method that does the same thing (plain <-> baseline,
assisted <-> draft, prompt lookup <-> ngram) at the same k. transformers refuses assisted and
prompt-lookup generation for more than one sequence, so at batch > 1 only plain generation runs
(prompts in left-padded groups of the batch size). EOS does not stop either side (the bench's
requests ignore EOS), so both generate exactly max_tokens tokens.
"""

from __future__ import annotations

import time

import torch

PAIRS = {"hf-plain": "baseline", "hf-draft": "draft", "hf-ngram": "ngram"}  # peer method -> specdec method


class HFPeer:
    def __init__(self, paths: dict[str, str], dtype: torch.dtype, k: int) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.utils import logging

        logging.set_verbosity_error()  # its deprecation notices would drown the bench's output
        self.config = GenerationConfig
        self.k = k
        self.target = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=dtype).eval()
        self.draft = AutoModelForCausalLM.from_pretrained(paths["draft"], dtype=dtype).eval() if "draft" in paths else None
        if self.draft is not None:  # a fixed k, as the bench's specdec side (no dynamic schedule)
            self.draft.generation_config = self.generation_config()

    def generation_config(self, **kw):
        return self.config(do_sample=False, eos_token_id=None, pad_token_id=0, num_assistant_tokens=self.k,
                           num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0, **kw)

    def methods(self, batch: int) -> list[str]:
        if batch > 1:
            return ["hf-plain"]
        return ["hf-plain", "hf-ngram"] + (["hf-draft"] if self.draft is not None else [])

    @torch.inference_mode()
    def run(self, method: str, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[float, list[list[int]]]:
        """Seconds for all prompts, and each prompt's generated token ids."""
        extra = {"hf-draft": {"assistant_model": self.draft}}.get(method, {})
        config = self.generation_config(max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                        prompt_lookup_num_tokens=self.k if method == "hf-ngram" else None)
        outputs: list[list[int]] = []
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch):
            group = prompts[i : i + batch]
            width = max(map(len, group))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            out = self.target.generate(ids, attention_mask=mask, generation_config=config, **extra)
            outputs += out[:, width:].tolist()
        return time.perf_counter() - t0, outputs
