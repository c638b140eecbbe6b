"""Quality figures for an exported kit, computed from the exported (fp16) files as served.

- target perplexity on held-out files (the 5% split the models never trained on);
- greedy completions of held-out function headers: distinct-4 (share of unique 4-grams; loops
  push it towards 0) and one sample for people to read;
- teacher-forced top-1 agreement with the target on held-out text: how often the draft, the EAGLE
  head (fed the target's features) and each Medusa head pick the token the target would pick.
  Greedy speculative decoding accepts exactly such agreements, so these bound acceptance.
- the ceiling for Medusa head 1 on that text: it sees x_{<=t} but the target's pick at t+1 also
  depends on x_{t+1}, so not even a perfect head reaches 1.0 (see `second_token_ceiling`).
- through the serving engine: mean accepted length per verification round at fixed k=4, greedy,
  on the held-out `def` prompts, with the outputs' distinct-4 and a prompt-lookup row beside it,
  so that acceptance bought by repetition reads as such (`engine_acceptance`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from specdec.core.config import EngineConfig
from specdec.core.engine_config import build_engine
from specdec.core.models.checkpoint import load_model
from specdec.core.models.heads import EagleHead, MedusaHeads
from specdec.core.models.llama import LlamaForCausalLM
from specdec.core.models.tokenizer import Tokenizer
from specdec.core.sampling import SamplingParams
from specdec.tools.kit.corpus import Document, eval_windows, read_documents, split_documents
from specdec.tools.kit.profiles import PROFILES, Profile

# Prompts end at the end of a line, before its newline: byte-level BPE merges a newline with the
# next line's indentation ("\n    "), so a prompt ending in a bare "\n" token would tell the model
# the next line starts at column 0 (the prompt-boundary problem), and a function body never follows.
SAMPLE_PROMPT = 'import os\n\n\ndef list_python_files(directory):\n    """Return the paths of the .py files under directory."""'
EVAL_BATCH = 8
CEILING_CANDIDATES = 8
ENGINE_METHODS = ("draft", "eagle", "ngram")
ENGINE_K = 4


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


@torch.no_grad()
def second_token_ceiling(target: LlamaForCausalLM, windows: torch.Tensor, k: int = CEILING_CANDIDATES) -> dict[str, float]:
    """What a head seeing only x_{<=t} can reach in agreement with the target's top-1 at t+1.

    `ceiling`: under the target's own p(x_{t+1} | x_{<=t}), the best such a head can do is to name
    the t+1 argmax that carries the most probability mass over the candidates for x_{t+1};
    candidates outside the top k count as agreeing, so this errs high. `two_step_greedy`: what the
    target itself reaches by guessing x_{t+1} greedily and running once more (a head would have to
    do that work in one residual block). One forward per window: the k candidates of every position
    ride along as tree leaves at position t+1 that see x_{<=t}.
    """
    best = two_step = 0.0
    for window in windows:
        x = window[:-1]
        T = x.numel()
        logits = target.logits(target(x[None]))[0]
        p, cand = logits[: T - 1].softmax(-1).topk(k, -1)  # [T-1, k]
        parent = torch.arange(T - 1).repeat_interleave(k)  # the last original token each leaf sees
        N = T + parent.numel()
        mask = torch.ones(T, N, dtype=torch.bool).tril()
        leaves = torch.arange(N)[None, :] <= parent[:, None]
        leaves[torch.arange(parent.numel()), torch.arange(T, N)] = True
        mask = torch.cat([mask, leaves])
        tokens = torch.cat([x, cand.flatten()])[None]
        positions = torch.cat([torch.arange(T), parent + 1])[None]
        hidden = target(tokens, positions, target.new_cache(1, N), [0], [0], mask[None])
        picks = target.logits(hidden[0, T:]).argmax(-1).view(T - 1, k)
        mass = ((picks[:, :, None] == picks[:, None, :]) * p[:, None, :]).sum(-1)  # mass behind each leaf's pick
        best += float((mass.max(-1).values + 1 - p.sum(-1)).sum())
        two_step += float((picks[:, 0] == logits[1:].argmax(-1)).sum())
    positions_total = windows.shape[0] * (windows.shape[1] - 2)
    return {"ceiling": round(best / positions_total, 4), "two_step_greedy": round(two_step / positions_total, 4)}


def engine_acceptance(
    out: Path, prompts: list[list[int]], expected: list[list[int]], new_tokens: int,
) -> dict[str, dict[str, Any]]:
    """Greedy decoding of `prompts` through the engine at fixed k: what each drafter buys per round.
    `expected`: the target's plain greedy completions (`greedy`), which every method must reproduce."""
    params = SamplingParams(max_tokens=new_tokens)
    folders = {"target": str(out / "target"), "draft": str(out / "draft"), "eagle": str(out / "eagle")}
    figures: dict[str, dict[str, Any]] = {
        "baseline": {"distinct_4": round(sum(map(distinct_n, expected)) / len(expected), 4)}}
    for method in ENGINE_METHODS:
        engine = build_engine(EngineConfig.of(**folders, method=method, k=ENGINE_K, policy="fixed"))
        results = engine.generate(prompts, params)
        stats = [r.stats for r in results]
        rounds = sum(s.steps - 1 for s in stats)
        figures[method] = {
            "k": ENGINE_K,
            "mean_accepted_length": round(sum(s.output_tokens - 1 for s in stats) / max(rounds, 1), 3),
            "acceptance_rate": round(sum(s.accepted_tokens for s in stats) / max(1, sum(s.draft_tokens for s in stats)), 4),
            "identical_to_baseline": [r.token_ids for r in results] == expected,
        }
    return figures


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
    windows = eval_windows(tokens, profile.eval_windows, profile.seq_len)
    figures = teacher_forced(target, draft, medusa, eagle, windows)
    figures["medusa_head_1_reference"] = second_token_ceiling(target, windows)
    prompts = [tokenizer.encode(p)[-(profile.seq_len // 2) :] for p in function_prompts(docs, profile.eval_prompts)]
    completions = [greedy(target, ids, profile.eval_new_tokens, tokenizer.eos_ids) for ids in prompts]
    sample_ids = greedy(target, tokenizer.encode(SAMPLE_PROMPT), profile.eval_new_tokens * 2, tokenizer.eos_ids)
    figures["greedy_prompts"] = len(completions)
    figures["distinct_4"] = round(sum(map(distinct_n, completions)) / max(1, len(completions)), 4)
    figures["greedy_sample"] = {"prompt": SAMPLE_PROMPT, "completion": tokenizer.decode(sample_ids)}
    figures["engine"] = engine_acceptance(out, prompts, completions, profile.eval_new_tokens)
    kit["eval"] = figures
    (out / "kit.json").write_text(json.dumps(kit, indent=2) + "\n")
    return figures
