"""A CPU model that speaks the `tensorrt_llm` contract (../shared/TRTLLM_CONTRACT.md), on specdec's
own Llama code: the stand-in for a TensorRT-LLM engine, so the orchestrated draft-then-verify path
runs through real tritonserver without a GPU, and the reference a real deployment is compared to.

What it answers, as tensorrtllm_backend v0.18.0 does:
- `input_ids` + `request_output_len`: generate up to that many tokens; `end_id` ends the output and
  is not part of it (NVIDIA's BLS stops when a round brings no new token); `min_length` holds
  `end_id` back before that many tokens.
- `draft_input_ids` (n tokens): one verification step. Without `draft_logits` acceptance is token
  matching: at each draft position the target draws its own token (argmax when greedy) and keeps
  going while it equals the draft's, so the output is always the target's own choice (lossless).
  With `draft_logits` it is rejection sampling against the draft's distribution (core.verify).
  The output is the accepted draft tokens plus one target token (at most `request_output_len`,
  which the orchestrator sets to n + 1), and the request ends with that step.
- `exclude_input_in_output`: false -> `output_ids` = input + generated (`sequence_length` counts
  both); true -> generated only. Streamed responses carry only the new tokens of each step.
- Prefix reuse (the analogue of `enable_kv_cache_reuse`): KV slots keep the token ids whose keys
  and values they hold; a request takes the free slot sharing the longest prefix and skips those
  positions in whole blocks of `tokens_per_block`, reported as `kv_cache_reused_blocks`.

This module is the computation only (no Triton import), so it is unit-tested in-process;
`trtllm_contract_model.py` is the Triton model around it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specdec.core.errors import InvalidRequest
from specdec.core.models.llama import LlamaForCausalLM
from specdec.core.sampling import SamplingParams, mask_eos, probs, sample
from specdec.core.verify import Draft, verify

# name -> (Triton data type, dims, optional): the subset of the v0.18.0 `tensorrt_llm` inputs this
# model understands (every one of them exists in the real config with these types and dims)
INPUTS = {
    "input_ids": ("TYPE_INT32", "[ -1 ]", False),
    "input_lengths": ("TYPE_INT32", "[ 1 ]", False),
    "request_output_len": ("TYPE_INT32", "[ 1 ]", False),
    "draft_input_ids": ("TYPE_INT32", "[ -1 ]", True),
    "draft_logits": ("TYPE_FP32", "[ -1, -1 ]", True),
    "end_id": ("TYPE_INT32", "[ 1 ]", True),
    "pad_id": ("TYPE_INT32", "[ 1 ]", True),
    "temperature": ("TYPE_FP32", "[ 1 ]", True),
    "runtime_top_k": ("TYPE_INT32", "[ 1 ]", True),
    "runtime_top_p": ("TYPE_FP32", "[ 1 ]", True),
    "random_seed": ("TYPE_UINT64", "[ 1 ]", True),
    "min_length": ("TYPE_INT32", "[ 1 ]", True),
    "exclude_input_in_output": ("TYPE_BOOL", "[ 1 ]", True),
    "streaming": ("TYPE_BOOL", "[ 1 ]", True),
    "return_kv_cache_reuse_stats": ("TYPE_BOOL", "[ 1 ]", True),  # accepted; the kv_cache_* outputs always come
}
OUTPUTS = {
    "output_ids": ("TYPE_INT32", "[ -1, -1 ]"),
    "sequence_length": ("TYPE_INT32", "[ -1 ]"),
    "kv_cache_reused_blocks": ("TYPE_INT32", "[ 1 ]"),
    "kv_cache_alloc_new_blocks": ("TYPE_INT32", "[ 1 ]"),
    "kv_cache_alloc_total_blocks": ("TYPE_INT32", "[ 1 ]"),
}


@dataclass
class ContractRequest:
    input_ids: list[int]
    output_len: int
    draft: list[int] = field(default_factory=list)
    draft_logits: np.ndarray | None = None  # [n, V]
    end_id: int = -1  # < 0: never ends early
    params: SamplingParams = field(default_factory=SamplingParams)  # temperature 0 = greedy
    seed: int = 0
    min_length: int = 0
    exclude_input: bool = False
    streaming: bool = False


def parse_inputs(inputs: dict[str, np.ndarray]) -> ContractRequest:
    """One request's tensors (leading batch dimension 1) -> ContractRequest; InvalidRequest names the input."""
    unknown = sorted(set(inputs) - set(INPUTS))
    if unknown:
        raise InvalidRequest(f"unknown input {unknown[0]!r}; this model reads {', '.join(INPUTS)}")
    for name in inputs:
        if np.asarray(inputs[name]).ndim and np.asarray(inputs[name]).shape[0] != 1:
            raise InvalidRequest(f"{name}: batch size {np.asarray(inputs[name]).shape[0]} per request is not "
                                 "supported; send one request per sequence")
    if "input_ids" not in inputs:
        raise InvalidRequest("input_ids is missing")
    ids = _ids(inputs["input_ids"], "input_ids")
    length = _scalar(inputs, "input_lengths", int, len(ids))
    if not 0 < length <= len(ids):
        raise InvalidRequest(f"input_lengths {length} must be in 1 .. {len(ids)} (the length of input_ids)")
    if "request_output_len" not in inputs:
        raise InvalidRequest("request_output_len is missing")
    output_len = _scalar(inputs, "request_output_len", int, 0)
    if output_len < 1:
        raise InvalidRequest(f"request_output_len must be >= 1, got {output_len}")
    draft = _ids(inputs["draft_input_ids"], "draft_input_ids") if "draft_input_ids" in inputs else []
    logits = None
    if "draft_logits" in inputs:
        logits = np.asarray(inputs["draft_logits"], dtype=np.float32)
        logits = logits.reshape(logits.shape[-2:]) if logits.ndim >= 2 else logits
        if logits.ndim != 2 or logits.shape[0] != len(draft):
            raise InvalidRequest(f"draft_logits must be [{len(draft)}, vocab] (one row per draft token), "
                                 f"got {list(np.asarray(inputs['draft_logits']).shape)}")
    temperature = _scalar(inputs, "temperature", float, 1.0)
    top_k = _scalar(inputs, "runtime_top_k", int, None)
    top_p = _scalar(inputs, "runtime_top_p", float, None)
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequest(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k is not None and top_k < 0:
        raise InvalidRequest(f"runtime_top_k must be >= 0, got {top_k}")
    if top_p is not None and not 0.0 <= top_p <= 1.0:
        raise InvalidRequest(f"runtime_top_p must be in [0, 1], got {top_p}")
    # TensorRT-LLM decodes greedily unless asked to sample: top_k 1, temperature 0, or neither cut given
    greedy = temperature == 0.0 or top_k == 1 or (not top_k and not top_p)
    params = SamplingParams(max_tokens=output_len, temperature=0.0 if greedy else temperature,
                            top_k=top_k or 0, top_p=top_p or 1.0)
    seed = _scalar(inputs, "random_seed", int, 0)
    if seed < 0:
        raise InvalidRequest(f"random_seed must be >= 0, got {seed}")
    return ContractRequest(
        input_ids=ids[:length], output_len=output_len, draft=draft, draft_logits=logits,
        end_id=_scalar(inputs, "end_id", int, -1), params=params, seed=seed,
        min_length=max(0, _scalar(inputs, "min_length", int, 0)),
        exclude_input=_scalar(inputs, "exclude_input_in_output", bool, False),
        streaming=_scalar(inputs, "streaming", bool, False))


def _ids(array, name: str) -> list[int]:
    a = np.asarray(array)
    if a.dtype.kind not in "iu":
        raise InvalidRequest(f"{name} must hold integers, got {a.dtype}")
    return [int(x) for x in a.reshape(-1)]


def _scalar(inputs: dict, name: str, kind: type, default):
    if name not in inputs:
        return default
    a = np.asarray(inputs[name]).reshape(-1)
    if a.size != 1:
        raise InvalidRequest(f"{name} must hold one value, got {a.size}")
    return kind(a[0])


@dataclass
class Reply:
    """One response: the new tokens of this step, in the contract's tensors."""

    output_ids: np.ndarray  # int32 [1 (batch), 1 (beam), tokens]
    sequence_length: np.ndarray  # int32 [1, 1]
    reused_blocks: int
    new_blocks: int
    total_blocks: int
    final: bool

    def tensors(self) -> dict[str, np.ndarray]:
        one = lambda v: np.array([[v]], dtype=np.int32)  # noqa: E731
        return {"output_ids": self.output_ids, "sequence_length": self.sequence_length,
                "kv_cache_reused_blocks": one(self.reused_blocks), "kv_cache_alloc_new_blocks": one(self.new_blocks),
                "kv_cache_alloc_total_blocks": one(self.total_blocks)}


@dataclass
class Active:
    """A request holding a KV slot."""

    req: ContractRequest
    slot: int
    reused: int  # prompt tokens whose KV came from the prefix cache
    generator: torch.Generator
    cache_len: int = 0  # tokens of input + generated whose KV is valid in the slot
    generated: list[int] = field(default_factory=list)
    sent: int = 0  # generated tokens already streamed
    done: bool = False
    cancelled: bool = False


@dataclass
class CacheStats:
    """Counters since start (the Triton model exports them as metrics)."""

    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    reused_blocks: int = 0
    forwards: int = 0
    forward_tokens: int = 0
    seconds: float = 0.0  # in model forwards and token choice


class ContractModel:
    """The generation loop: `admit` requests into KV slots, `step` runs every active one one step."""

    def __init__(self, model: LlamaForCausalLM, max_batch: int = 8, cache_slots: int | None = None,
                 max_context: int = 1024, max_draft_len: int = 8, tokens_per_block: int = 8) -> None:
        self.model, self.max_batch, self.max_context = model, max_batch, max_context
        self.max_draft_len, self.block = max_draft_len, tokens_per_block
        self.device = model.lm_head.weight.device
        slots = cache_slots or 2 * max_batch
        if slots < max_batch:
            raise ValueError(f"cache_slots ({slots}) must be >= max_batch ({max_batch})")
        self.capacity = max_context + max_draft_len + 1  # batched prefills that would pad past it run one by one
        self.cache = model.new_cache(slots, self.capacity)
        self.slot_tokens: list[list[int]] = [[] for _ in range(slots)]  # what each slot's KV holds
        self.slot_used = [0] * slots  # last use (LRU eviction)
        self.busy = [False] * slots
        self.clock = 0
        self.active: list[Active] = []
        self.stats = CacheStats()

    # ---- admission ----------------------------------------------------------------------------
    def check(self, req: ContractRequest) -> None:
        """Limits of this model, as errors that name the input."""
        if len(req.draft) > self.max_draft_len:
            raise InvalidRequest(f"draft_input_ids has {len(req.draft)} tokens, more than this model's "
                                 f"max_draft_len {self.max_draft_len}")
        if len(req.input_ids) + max(req.output_len, len(req.draft) + 1) > self.max_context:
            raise InvalidRequest(f"input_ids ({len(req.input_ids)} tokens) + request_output_len ({req.output_len}) "
                                 f"exceeds max_context {self.max_context}")
        vocab = self.model.config.vocab_size
        bad = [t for t in req.input_ids + req.draft if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} in input_ids/draft_input_ids is outside the vocabulary (0 .. {vocab - 1})")
        if req.draft_logits is not None and req.draft_logits.shape[1] != vocab:
            raise InvalidRequest(f"draft_logits has {req.draft_logits.shape[1]} columns, the vocabulary {vocab}")

    def can_admit(self) -> bool:
        return len(self.active) < self.max_batch

    def admit(self, req: ContractRequest) -> Active:
        """Take the free slot sharing the longest whole-block prefix with input_ids (LRU on ties)."""
        self.check(req)
        ids = req.input_ids
        best, best_reuse = -1, -1
        for slot, tokens in enumerate(self.slot_tokens):
            if self.busy[slot]:
                continue
            common = 0
            for a, b in zip(tokens, ids[: len(ids) - 1]):  # the last input token is always computed
                if a != b:
                    break
                common += 1
            reuse = common // self.block * self.block
            if reuse > best_reuse or (reuse == best_reuse and self.slot_used[slot] < self.slot_used[best]):
                best, best_reuse = slot, reuse
        self.busy[best] = True
        g = torch.Generator()
        g.manual_seed(req.seed)
        act = Active(req, best, best_reuse, g, cache_len=best_reuse)
        self.active.append(act)
        s = self.stats
        s.requests += 1
        s.prompt_tokens += len(ids)
        s.reused_tokens += best_reuse
        s.reused_blocks += best_reuse // self.block
        return act

    # ---- one step for every active request ------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[tuple[Active, Reply]]:
        """Prefill (input suffix + draft) for new requests, one token for the others; returns the
        replies to send (streaming: every step's new tokens; otherwise one at the end)."""
        t0 = time.perf_counter()
        fresh = [a for a in self.active if not a.generated and not a.done]
        going = [a for a in self.active if a.generated and not a.done]
        if fresh:
            self._forward(fresh, [a.req.input_ids[a.reused:] + a.req.draft for a in fresh], first=True)
        if going:
            self._forward(going, [[a.generated[-1]] for a in going], first=False)
        self.stats.seconds += time.perf_counter() - t0
        replies = []
        for a in list(self.active):
            if a.cancelled:
                a.done = True
            reply = self._reply(a)
            if reply is not None:
                replies.append((a, reply))
            if a.done:
                self._release(a)
        return replies

    def _forward(self, acts: list[Active], feeds: list[list[int]], first: bool) -> None:
        starts = [a.cache_len for a in acts]
        width = max(map(len, feeds))
        groups = [list(range(len(acts)))]
        if max(starts) + width > self.capacity:  # padding would run past a slot: one at a time
            groups = [[i] for i in range(len(acts))]
        for group in groups:
            w = max(len(feeds[i]) for i in group)
            tokens = torch.tensor([feeds[i] + [0] * (w - len(feeds[i])) for i in group], device=self.device)
            positions = torch.tensor([starts[i] for i in group], device=self.device)[:, None] + torch.arange(w, device=self.device)
            hidden = self.model(tokens, positions, self.cache, [acts[i].slot for i in group], [starts[i] for i in group])
            self.stats.forwards += 1
            self.stats.forward_tokens += sum(len(feeds[i]) for i in group)
            for row, i in enumerate(group):
                a, n = acts[i], len(acts[i].req.draft) if first else 0
                last = len(feeds[i]) - 1 - n  # the row of the last input token
                logits = self.model.logits(hidden[row, last: last + n + 1])
                self._choose(a, logits, feeds[i], first)

    def _choose(self, a: Active, logits: torch.Tensor, feed: list[int], first: bool) -> None:
        """Pick the next token(s) from the target rows: plain decoding, token matching, or rejection sampling."""
        req = a.req
        eos = [req.end_id] if req.end_id >= 0 else []
        rows = logits.detach().to("cpu", torch.float64)
        blocked = req.min_length - len(a.generated)  # rows before this may not end the output
        if eos and blocked > 0:
            rows = mask_eos(rows, eos, torch.arange(len(rows)) < blocked)
        draft = req.draft if first else []
        if draft and req.draft_logits is not None:
            q = probs(torch.from_numpy(req.draft_logits).double(), req.params)
            verdict = verify(Draft.chain(draft, q), rows, req.params, a.generator)
            accepted, picks = len(verdict.path), [draft[i] for i in verdict.path] + [verdict.bonus]
        else:  # token matching: the target's own token at each position, while it equals the draft's
            p = None if req.params.greedy else probs(rows, req.params)
            picks = []
            for i in range(len(draft) + 1):
                picks.append(int(rows[i].argmax()) if p is None else sample(p[i], a.generator))
                if i == len(draft) or picks[-1] != draft[i]:
                    break
            accepted = len(picks) - 1
        # valid KV now: the fed tokens up to the last input one, plus the accepted draft tokens
        a.cache_len += len(feed) - len(draft) + accepted
        for t in picks:
            if t in eos:
                a.done = True
                break
            a.generated.append(t)
            if len(a.generated) >= req.output_len:
                a.done = True
                break
        if draft:  # a verification request ends with its step: accepted + one token of the target's
            a.done = True

    def _reply(self, a: Active) -> Reply | None:
        req = a.req
        if req.streaming:
            new = a.generated[a.sent:]
            if not new and not a.done:
                return None
            a.sent = len(a.generated)
            tokens = new
        elif a.done:
            tokens = a.generated if req.exclude_input else req.input_ids + a.generated
        else:
            return None
        total = math.ceil((len(req.input_ids) + len(a.generated)) / self.block)
        reused = a.reused // self.block
        return Reply(np.array([[tokens]], dtype=np.int32).reshape(1, 1, len(tokens)),
                     np.array([[len(tokens)]], dtype=np.int32), reused, total - reused, total, a.done)

    def _release(self, a: Active) -> None:
        self.active.remove(a)
        self.slot_tokens[a.slot] = (a.req.input_ids + a.generated)[: a.cache_len]  # what the KV holds
        self.clock += 1
        self.slot_used[a.slot] = self.clock
        self.busy[a.slot] = False
