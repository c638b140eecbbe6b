"""The four training stages and the resumable, time-budgeted loop they share.

Each stage keeps model + optimizer state in `<cache>/<stage>.pt`, saved every few minutes and at
the end, so a killed run resumes where it stopped and a later run with a larger budget continues
training. A stage stops at its step limit or when its seconds (accumulated across resumes) run
out; the learning rate follows warmup + cosine over that same progress. Batches derive from
(seed, step), so a resumed run sees the batches an uninterrupted one would have.

The draft, Medusa and EAGLE stages learn from the target (self-distillation, as the Medusa and
EAGLE papers do): they read the target's features from a cache computed once per target (features.py)
rather than running the target in every step; their checkpoints record the target step they were
trained against and restart when the target has moved on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from specdec.core.models.heads import EagleHead, MedusaHeads
from specdec.core.models.llama import LlamaForCausalLM
from specdec.tools.kit.corpus import sample_batch
from specdec.tools.kit.features import FeatureBatches
from specdec.tools.kit.profiles import Profile, Stage

CHECKPOINT_EVERY_S = 180.0
# The EAGLE paper weights feature regression 1.0 and the token distribution 0.1; weighting the
# distribution 1.0 gained 0.015 held-out top-1 agreement in a side-by-side trial here (4.0: no better).
EAGLE_LOGIT_WEIGHT = 1.0
MEDUSA_DECAY = 0.8  # Medusa paper: head i's loss weighted 0.8**i


@dataclass
class StageResult:
    name: str
    steps: int
    seconds: float
    tokens: int
    loss: float

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "seconds": round(self.seconds, 1), "tokens": self.tokens, "final_loss": round(self.loss, 4)}


@dataclass
class TrainContext:
    profile: Profile
    tokens: Tensor  # the train token stream
    cache: Path
    device: str
    compile: bool
    total_seconds: float | None  # None: stages stop at their step limits only
    stages: frozenset[str]  # the stages this run trains; the others come from the cache as they are

    def budget(self, stage: Stage) -> float | None:
        return None if self.total_seconds is None else self.total_seconds * stage.time_share

    def seed(self, stage_name: str, step: int) -> int:
        return hash_seed(self.profile.seed, stage_name, step)

    def batch(self, stage_name: str, step: int, batch: int) -> Tensor:
        return sample_batch(self.tokens, batch, self.profile.seq_len, self.seed(stage_name, step), self.device)

    def maybe_compile(self, fn: Callable) -> Callable:
        return torch.compile(fn) if self.compile else fn


def hash_seed(seed: int, stage_name: str, step: int) -> int:
    return (seed * 1_000_003 + sum(map(ord, stage_name)) * 7919 + step) % (2**63)


def lr_at(stage: Stage, step: int, progress: float) -> float:
    if step < stage.warmup:
        return stage.lr * (step + 1) / stage.warmup
    return stage.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def make_optimizer(module: nn.Module, lr: float) -> torch.optim.AdamW:
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def save_checkpoint(state: dict[str, Any], path: Path) -> None:
    """Write through a temporary file, so a run killed mid-write leaves the previous checkpoint."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def run_stage(
    name: str, module: nn.Module, loss_fn: Callable[[int], Tensor], stage: Stage, ctx: TrainContext,
    key: dict[str, Any],
) -> StageResult:
    """Train `module` (its trainable parameters) on `loss_fn(step)` until the stage's steps or seconds run out.

    A stage left out of `ctx.stages` only loads its cached checkpoint: that is how two processes
    train different stages of one kit at once (one per core).
    """
    path = ctx.cache / f"{name}.pt"
    opt = make_optimizer(module, stage.lr)
    step, seconds, loss_value = 0, 0.0, float("nan")
    ema = loss_value  # smoothed loss: what the log and the kit report
    if path.exists():
        state = torch.load(path, map_location=ctx.device, weights_only=False)
        if state["key"] == key:
            module.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            step, seconds, loss_value = state["step"], state["seconds"], state["loss"]
            ema = loss_value
            print(f"[{name}] resuming at step {step} ({seconds / 60:.1f} min trained)", flush=True)
        else:
            print(f"[{name}] checkpoint was trained against {state['key']}, now {key}: restarting", flush=True)
    if name not in ctx.stages:
        if step == 0:
            raise SystemExit(f"stage {name!r} is not trained in this run and {path} holds no usable checkpoint")
        module.eval()
        return StageResult(name, step, seconds, step * stage.batch * ctx.profile.seq_len, ema)
    budget = ctx.budget(stage)

    def progress() -> float:
        return max(step / stage.steps, 0.0 if budget is None else seconds / max(budget, 1e-9))

    def save() -> None:
        save_checkpoint({"key": key, "model": module.state_dict(), "optimizer": opt.state_dict(),
                         "step": step, "seconds": seconds, "loss": ema}, path)

    module.train()
    bar = tqdm(total=1000, desc=name, unit="‰", mininterval=10, initial=int(1000 * min(progress(), 1)))
    last_save = time.monotonic()
    while progress() < 1.0:
        t0 = time.monotonic()
        for group in opt.param_groups:
            group["lr"] = lr_at(stage, step, progress())
        loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        loss_value = loss.item()
        ema = loss_value if math.isnan(ema) else 0.98 * ema + 0.02 * loss_value
        step += 1
        seconds += time.monotonic() - t0
        bar.n = int(1000 * min(progress(), 1))
        bar.set_postfix(step=step, loss=f"{ema:.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}", refresh=False)
        bar.update(0)
        if time.monotonic() - last_save > CHECKPOINT_EVERY_S:
            save()
            last_save = time.monotonic()
    bar.close()
    save()
    module.eval()
    tokens = step * stage.batch * ctx.profile.seq_len
    print(f"[{name}] done: {step} steps, {seconds / 60:.1f} min, loss {ema:.4f}", flush=True)
    return StageResult(name, step, seconds, tokens, ema)


def frozen(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def kl_to_teacher(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """KL(teacher || student) per position, averaged: the distillation loss for all three learners."""
    s = F.log_softmax(student_logits.float().flatten(0, -2), dim=-1)
    t = F.log_softmax(teacher_logits.float().flatten(0, -2), dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def train_target(model: LlamaForCausalLM, ctx: TrainContext) -> StageResult:
    stage = ctx.profile.stages["target"]

    def ce(x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(model.logits(model(x)).flatten(0, 1), y.flatten())

    step_loss = ctx.maybe_compile(ce)

    def loss_fn(step: int) -> Tensor:
        batch = ctx.batch("target", step, stage.batch)
        return step_loss(batch[:, :-1], batch[:, 1:])

    return run_stage("target", model, loss_fn, stage, ctx, key={"stage": "target"})


def train_draft(
    draft: LlamaForCausalLM, target: LlamaForCausalLM, target_step: int, features: FeatureBatches, ctx: TrainContext,
) -> StageResult:
    """Distill the target's next-token distributions into the draft (what rejection sampling rewards)."""
    stage = ctx.profile.stages["draft"]
    frozen(target)

    def kl(x: Tensor, hidden: Tensor) -> Tensor:
        with torch.no_grad():
            teacher = target.logits(hidden)
        return kl_to_teacher(draft.logits(draft(x)), teacher)

    step_loss = ctx.maybe_compile(kl)

    def loss_fn(step: int) -> Tensor:
        return step_loss(*features(ctx.seed("draft", step), stage.batch))

    return run_stage("draft", draft, loss_fn, stage, ctx, key={"stage": "draft", "target_step": target_step})


def grow_eagle(eagle: EagleHead, path: Path, key: dict[str, Any], lr: float) -> None:
    """Rewrite a cached EAGLE checkpoint that has fewer layers than `eagle` into one for `eagle`.

    Progressive stacking: the cached layers keep their weights and each new layer's output
    projections start at zero, so the grown head computes what the trained one did and training
    goes on from there (step and seconds carry over, so the stage's budget and learning-rate
    schedule continue; the optimizer starts afresh). Cheaper per CPU second than training the
    deeper head from scratch.
    """
    if not path.exists():
        return
    state = torch.load(path, map_location="cpu", weights_only=False)
    old = state["key"]
    if {**old, "layers": key["layers"]} != key or old["layers"] >= key["layers"]:
        return
    missing, unexpected = eagle.load_state_dict(state["model"], strict=False)
    new_prefixes = tuple(f"layers.{i}." for i in range(old["layers"], key["layers"]))
    if unexpected or not all(name.startswith(new_prefixes) for name in missing):
        raise SystemExit(f"{path}: cannot grow an EAGLE head whose weights do not fit (missing {missing[:3]})")
    with torch.no_grad():
        for layer in eagle.layers[old["layers"] :]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    print(f"[eagle] growing the cached {old['layers']}-layer head to {key['layers']} layers", flush=True)
    save_checkpoint({**state, "key": key, "model": eagle.state_dict(), "optimizer": make_optimizer(eagle, lr).state_dict()}, path)


def train_eagle(
    eagle: EagleHead, target: LlamaForCausalLM, target_step: int, features: FeatureBatches, ctx: TrainContext,
) -> StageResult:
    """Input at t is (embed(x_{t+1}), f_t); regress f_{t+1} and match the target's distribution there."""
    stage = ctx.profile.stages["eagle"]
    frozen(target)
    key = {"stage": "eagle", "target_step": target_step, "layers": len(eagle.layers)}
    grow_eagle(eagle, ctx.cache / "eagle.pt", key, stage.lr)

    def loss(x: Tensor, hidden: Tensor) -> Tensor:
        with torch.no_grad():
            teacher = target.logits(hidden[:, 1:])
            embeds = target.model.embed_tokens(x[:, 1:])
        pred = eagle(embeds, hidden[:, :-1])
        feature_loss = F.smooth_l1_loss(pred.float(), hidden[:, 1:])
        return feature_loss + EAGLE_LOGIT_WEIGHT * kl_to_teacher(target.logits(pred), teacher)

    step_loss = ctx.maybe_compile(loss)

    def loss_fn(step: int) -> Tensor:
        return step_loss(*features(ctx.seed("eagle", step), stage.batch))

    return run_stage("eagle", eagle, loss_fn, stage, ctx, key=key)


def init_medusa(heads: MedusaHeads, target: LlamaForCausalLM) -> None:
    """As Medusa does: each head starts as the target's own lm_head behind identity-like residual blocks."""
    with torch.no_grad():
        for head in heads.heads:
            head[-1].weight.copy_(target.lm_head.weight)
            for block in head[:-1]:
                block.linear.weight.zero_()


def train_medusa(
    heads: MedusaHeads, target: LlamaForCausalLM, target_step: int, features: FeatureBatches, ctx: TrainContext,
) -> StageResult:
    """Head i on h_t learns the target's distribution at t+1+i (over token t+2+i)."""
    stage = ctx.profile.stages["medusa"]
    frozen(target)

    def loss(hidden: Tensor) -> Tensor:
        with torch.no_grad():
            teacher = target.logits(hidden)
        student = heads(hidden)
        T = hidden.shape[1]
        total = 0.0
        for i in range(heads.num_heads):
            total = total + MEDUSA_DECAY**i * kl_to_teacher(student[i, :, : T - 1 - i], teacher[:, 1 + i :])
        return total

    step_loss = ctx.maybe_compile(loss)

    def loss_fn(step: int) -> Tensor:
        return step_loss(features(ctx.seed("medusa", step), stage.batch)[1])

    return run_stage("medusa", heads, loss_fn, stage, ctx, key={"stage": "medusa", "target_step": target_step})
