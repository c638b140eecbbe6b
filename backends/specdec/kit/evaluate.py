"""Quality figures for an exported kit, computed from the exported (fp16) files as served.

- target perplexity on held-out files (the 5% split the models never trained on);
- greedy completions of held-out function headers: distinct-4 (share of unique 4-grams; loops
  push it towards 0) and one sample for people to read;
- teacher-forced top-1 agreement with the target on held-out text: how often the draft, the EAGLE
  head (fed the target's features) and each Medusa head pick the token the target would pick.
  Greedy speculative decoding accepts exactly such agreements, so these bound acceptance.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from ..models.checkpoint import load_model
from ..models.heads import EagleHead, MedusaHeads
from ..models.llama import LlamaForCausalLM
from ..models.tokenizer import Tokenizer
from .corpus import Document, eval_windows, read_documents, split_documents
from .profiles import PROFILES, Profile

# Prompts end at the end of a line, before its newline: byte-level BPE merges a newline with the
# next line's indentation ("\n    "), so a prompt ending in a bare "\n" token would tell the model
# the next line starts at column 0 (the prompt-boundary problem), and a function body never follows.
SAMPLE_PROMPT = 'import os\n\n\ndef list_python_files(directory):\n    """Return the paths of the .py files under directory."""'
EVAL_BATCH = 8


def heldout_tokens(profile: Profile, tokenizer: Tokenizer) -> tuple[torch.Tensor, list[Document]]:
    _, heldout = split_documents(read_documents(), profile.heldout_percent, profile.max_train_files)
    eos = tokenizer.eos_ids[0]
    ids: list[int] = []
    for doc in heldout:
        ids.extend(tokenizer.encode(doc.text))
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long), heldout


def function_prompts(docs: list[Document], count: int) -> list[str]:
    """Held-out files up to the end of their first top-level `def` line: the model writes the body."""
    prompts = []
    for doc in docs:
        at = doc.text.find("\ndef ")
        if at < 0:
            continue
        end = doc.text.find("\n", at + 1)
        prompts.append(doc.text[max(0, at - 600) : end if end >= 0 else None])
        if len(prompts) == count:
            break
    return prompts


@torch.no_grad()
def greedy(model: LlamaForCausalLM, prompt: list[int], new_tokens: int, eos_ids: list[int]) -> list[int]:
    ids, out = list(prompt), []
    window = model.config.max_position_embeddings
    for _ in range(new_tokens):
        x = torch.tensor([ids[-window:]])
        nxt = int(model.logits(model(x)[:, -1]).argmax(-1))
        if nxt in eos_ids:
            break
        ids.append(nxt)
        out.append(nxt)
    return out


def distinct_n(tokens: list[int], n: int = 4) -> float:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


@torch.no_grad()
def teacher_forced(
    target: LlamaForCausalLM, draft: LlamaForCausalLM, medusa: MedusaHeads, eagle: EagleHead, windows: torch.Tensor,
) -> dict[str, float]:
    nll = correct = count = 0.0
    agree = {"draft": 0.0, "eagle": 0.0, **{f"medusa_head_{i + 1}": 0.0 for i in range(medusa.num_heads)}}
    totals = dict.fromkeys(agree, 0)
    for chunk in windows.split(EVAL_BATCH):
        x, y = chunk[:, :-1], chunk[:, 1:]
        T = x.shape[1]
        hidden = target(x)
        logits = target.logits(hidden)
        nll += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
        top = logits.argmax(-1)
        correct += float((top == y).sum())
        count += y.numel()
        agree["draft"] += float((draft.logits(draft(x)).argmax(-1) == top).sum())
        totals["draft"] += top.numel()
        pred = eagle(target.model.embed_tokens(x[:, 1:]), hidden[:, :-1])
        agree["eagle"] += float((target.logits(pred).argmax(-1) == top[:, 1:]).sum())
        totals["eagle"] += top[:, 1:].numel()
        heads = medusa(hidden)
        for i in range(medusa.num_heads):
            name = f"medusa_head_{i + 1}"
            agree[name] += float((heads[i, :, : T - 1 - i].argmax(-1) == top[:, 1 + i :]).sum())
            totals[name] += top[:, 1 + i :].numel()
    return {
        "heldout_tokens": int(count),
        "target_perplexity": round(math.exp(nll / count), 3),
        "target_top1_accuracy": round(correct / count, 4),
        "agreement": {k: round(v / totals[k], 4) for k, v in agree.items()},
    }


def evaluate_kit(out: Path) -> dict[str, Any]:
    """Compute the figures for the kit in `out` and record them in its kit.json (returned too)."""
    kit = json.loads((out / "kit.json").read_text())
    profile = PROFILES[kit["profile"]]
    tokenizer = Tokenizer(out / "target")
    if Tokenizer(out / "draft").fingerprint() != tokenizer.fingerprint():
        raise ValueError("draft and target tokenizers differ")
    target, draft = load_model(out / "target"), load_model(out / "draft")
    medusa, eagle = MedusaHeads.load(out / "medusa"), EagleHead.load(out / "eagle")
    tokens, docs = heldout_tokens(profile, tokenizer)
    figures = teacher_forced(target, draft, medusa, eagle, eval_windows(tokens, profile.eval_windows, profile.seq_len))
    completions = []
    for prompt in function_prompts(docs, profile.eval_prompts):
        ids = greedy(target, tokenizer.encode(prompt)[-(profile.seq_len // 2) :], profile.eval_new_tokens, tokenizer.eos_ids)
        completions.append(ids)
    sample_ids = greedy(target, tokenizer.encode(SAMPLE_PROMPT), profile.eval_new_tokens * 2, tokenizer.eos_ids)
    figures["greedy_prompts"] = len(completions)
    figures["distinct_4"] = round(sum(map(distinct_n, completions)) / max(1, len(completions)), 4)
    figures["greedy_sample"] = {"prompt": SAMPLE_PROMPT, "completion": tokenizer.decode(sample_ids)}
    kit["eval"] = figures
    (out / "kit.json").write_text(json.dumps(kit, indent=2) + "\n")
    return figures
