"""The rounds engine: draft-then-verify over two models of the same Triton repository that speak the
`tensorrt_llm` contract (TensorRT-LLM engines on a GPU, `trtllm_contract` models on the CPU), called
through BLS. It has the in-process Engine's interface (submit / cancel / start / stop / metrics,
Outputs through `on_output`), so the backend (model.py) parses, streams, cancels and exports the
same Prometheus series whichever engine it built.

Per request, on a worker thread (up to max_batch requests in flight; the inner models batch them):
1. draft call: input_ids = prompt + output so far, request_output_len = min_length = k, greedy;
2. target call: the same input_ids, draft_input_ids = the draft, request_output_len = k + 1, the
   request's sampling; it returns the accepted draft tokens plus one token of its own (token
   matching: lossless), or only the accepted ones when its next token was end_id;
3. the round's tokens go out at once (stop conditions, stop strings and counters are the Engine's
   own `_emit`), then k follows the request's acceptance: one more than its recent mean accepted
   length, within 1 .. min(max_draft_len, num_draft_tokens).
Without a draft model (or num_draft_tokens = 0) one streaming target call generates the output.
A cancelled request starts no further inner call. Prompts are tokenized once (Engine.submit); inner
calls send `exclude_input_in_output` as configured and slice the result accordingly.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np
import torch

from specdec.core.engine import Engine, EngineMetrics
from specdec.core.errors import ConfigurationError
from specdec.core.models.tokenizer import Tokenizer
from specdec.core.policy import Policy
from specdec.core.sequence import Sequence
from specdec.core.verify import Draft
from specdec.serving.bls import BlsCalls

INNER_OUTPUTS = ["output_ids", "sequence_length"]
SCHEDULER_TICK_S = 0.05  # queue timeouts and cancelled queued requests are noticed within this


class InnerError(RuntimeError):
    """An inner model answered with an error; the message names the model."""


class InnerClient(Protocol):
    def generate(self, model: str, inputs: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        """The responses of one request to `model` (one, or one per step when streaming)."""


class BlsClient:
    """Inner calls through Triton's BLS from worker threads (allowed in a decoupled model), made
    by `bls.BlsCalls`: every request and response generator is held for a while after use (the
    stub crashed, and once crossed two calls' responses, when they were freed at once). `exec`
    from threads deadlocked the canary router's stub every few thousand requests; 7988 requests
    here at 4 streams did not stall (`serving.bls`)."""

    def __init__(self, pb_utils) -> None:
        self.pb = pb_utils
        self.calls = BlsCalls()

    def generate(self, model: str, inputs: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        pb = self.pb
        request = pb.InferenceRequest(model_name=model, requested_output_names=INNER_OUTPUTS,
                                      inputs=[pb.Tensor(name, value) for name, value in inputs.items()])
        responses = self.calls.exec(request, inputs)
        complete = False
        try:
            for response in responses:
                if response.has_error():
                    complete = True  # an error response is the last one
                    raise InnerError(f"{model}: {response.error().message()}")
                tensors = {name: pb.get_output_tensor_by_name(response, name) for name in INNER_OUTPUTS}
                if all(t is not None for t in tensors.values()):  # the final flag may come alone
                    yield {name: t.as_numpy() for name, t in tensors.items()}
            complete = True
        finally:
            # stop a streaming call we leave early; never cancel a finished one: cancelling after the
            # final response crashed the stub (segfault in libpython under 16 concurrent streams)
            cancel = getattr(responses, "cancel", None)
            if not complete and cancel is not None:
                try:
                    cancel()
                except Exception:
                    pass


@dataclass
class RoundsConfig:
    tokenizer: str  # folder of the target's tokenizer (prompts are tokenized here, once)
    target_model: str = "target_trtllm"
    draft_model: str | None = "draft_trtllm"  # none: the target alone (the baseline)
    max_draft_len: int = 4  # at most the target engine's --max_draft_len
    max_batch: int = 8  # requests in flight
    max_context: int = 1024
    queue_timeout_s: float = 60.0
    adaptive: bool = True
    inner_exclude_input: bool = True  # exclude_input_in_output of the inner calls
    stream_interval: int = 1  # the backend's option (serving.config.BackendOptions), parsed there

    @classmethod
    def from_parameters(cls, parameters: dict[str, str], model_dir: str | Path) -> "RoundsConfig":
        from specdec.serving.config import BACKEND_SETTINGS, backend_options, resolve_path

        backend = {k: v for k, v in parameters.items() if k in BACKEND_SETTINGS}
        values: dict[str, object] = {"stream_interval": backend_options(backend).stream_interval}
        for key, raw in parameters.items():
            raw = raw.strip()
            if key in BACKEND_SETTINGS:
                continue
            try:
                if key == "policy":
                    if raw not in ("adaptive", "fixed"):
                        raise ValueError
                    values["adaptive"] = raw == "adaptive"
                elif key == "tokenizer":
                    values[key] = resolve_path(raw, Path(model_dir))
                elif key in ("target_model",):
                    values[key] = raw
                elif key == "draft_model":
                    values[key] = None if raw.lower() in ("", "none") else raw
                elif key in ("max_draft_len", "max_batch", "max_context"):
                    values[key] = int(raw)
                elif key == "queue_timeout_s":
                    values[key] = float(raw)
                elif key == "inner_exclude_input_in_output":
                    values["inner_exclude_input"] = {"true": True, "false": False}[raw.lower()]
                else:
                    raise ConfigurationError(
                        f"unknown model parameter {key!r} for a rounds (BLS) model; known: tokenizer, target_model, "
                        "draft_model, max_draft_len, max_batch, max_context, queue_timeout_s, policy, "
                        f"inner_exclude_input_in_output, {', '.join(BACKEND_SETTINGS)}")
            except (ValueError, KeyError):
                raise ConfigurationError(f"model parameter {key}={raw!r} is not valid") from None
        if "tokenizer" not in values:
            raise ConfigurationError("model parameter 'tokenizer' (the target's tokenizer folder) is required")
        cfg = cls(**values)
        if cfg.max_draft_len < 1 or cfg.max_batch < 1 or cfg.max_context < 2:
            raise ConfigurationError("max_draft_len and max_batch must be >= 1, max_context >= 2")
        return cfg


def is_rounds(parameters: dict[str, str]) -> bool:
    """A model config that names inner models is served by the rounds engine."""
    return "target_model" in parameters


class RoundsEngine(Engine):
    """Engine's queue, admission, output and stop-condition code; rounds instead of a local model.

    `free_slots` are in-flight places here (no KV cache lives in this process). Everything that
    touches a request's state (`streams`, `running`, counters) runs under `self.lock`."""

    def __init__(self, cfg: RoundsConfig, inner: InnerClient, tokenizer: Tokenizer | None = None) -> None:
        self.cfg, self.inner = cfg, inner
        self.tokenizer = tokenizer or Tokenizer(cfg.tokenizer)
        self.proposer, self.typical = None, None
        self.policy = Policy(0, False, lambda k: 0)  # Engine._finish releases slots through it; k is chosen per round here
        self.max_batch, self.max_context = cfg.max_batch, cfg.max_context
        self.eos_ids = list(self.tokenizer.eos_ids)
        self.free_slots = list(range(cfg.max_batch))
        self.queue: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.streams = {}
        self.queue_timeout_s = cfg.queue_timeout_s
        self.metrics = EngineMetrics()
        self.lock = threading.Condition()
        self.ids = itertools.count()
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.workers = ThreadPoolExecutor(cfg.max_batch, thread_name_prefix="specdec-rounds")

    # ---- scheduling ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.lock:
                if not self.stopping:
                    self.lock.wait(SCHEDULER_TICK_S)
                if self.stopping:
                    break
                self._drop_cancelled()
                for seq in self._admit():
                    self.running.append(seq)
                    self.metrics.prefill_tokens += len(seq.prompt_ids)
                    self.workers.submit(self._drive, seq)
        with self.lock:
            for seq in list(self.queue) + list(self.running):
                self._finish(seq, "cancelled", error="the server is shutting down")
        self.workers.shutdown(wait=False, cancel_futures=True)

    def step(self) -> None:  # the loop above replaces Engine's step-driven one
        raise NotImplementedError("the rounds engine runs its requests on worker threads; use start()")

    def _alive(self, seq: Sequence) -> bool:
        return not seq.cancelled and not self.stopping and seq.request_id in self.streams

    def _drive(self, seq: Sequence) -> None:
        try:
            if self.cfg.draft_model and seq.params.num_draft_tokens != 0:
                self._speculate(seq)
            else:
                self._generate(seq)
        except Exception as exc:  # an inner error ends this request with it; the rest go on
            with self.lock:
                self._finish(seq, "error", error=str(exc) if isinstance(exc, InnerError) else f"internal error: {exc!r}")
        finally:
            with self.lock:
                if seq.request_id in self.streams:  # ended without a final Output: cancelled meanwhile
                    self._finish(seq, "cancelled")
                self.lock.notify()

    # ---- draft-then-verify --------------------------------------------------------------------
    def _speculate(self, seq: Sequence) -> None:
        cap = min(self.cfg.max_draft_len, seq.params.num_draft_tokens or self.cfg.max_draft_len)
        k, mean_accepted = cap, None
        while self._alive(seq):
            k_now = min(k, seq.params.max_tokens - len(seq.output_ids) - 1)
            t0 = time.perf_counter()
            draft = self._tokens(self.cfg.draft_model, self._inputs(seq, k_now, drafting=True)) if k_now > 0 else []
            t1 = time.perf_counter()
            if not self._alive(seq):
                return
            out = self._tokens(self.cfg.target_model, self._inputs(seq, len(draft) + 1, draft=draft))
            t2 = time.perf_counter()
            accepted = next((i for i, (a, b) in enumerate(zip(out, draft)) if a != b), min(len(out), len(draft)))
            tokens = list(out)
            if len(out) == accepted:  # no token of the target's own: its next one was end_id
                if seq.params.ignore_eos or not self.eos_ids:
                    raise InnerError(f"{self.cfg.target_model}: returned no new token for request {seq.request_id}")
                tokens.append(self.eos_ids[0])
            with self.lock:
                m = self.metrics
                m.steps += 1
                m.propose_seconds += t1 - t0
                m.verify_seconds += t2 - t1
                m.verify_tokens += len(draft) + 1
                if not self._alive(seq):
                    return
                self._count(seq, Draft.chain(draft), accepted)
                seq.stats.steps += 1
                if not self._emit(seq, tokens):
                    return
            if self.cfg.adaptive and draft:
                mean_accepted = accepted if mean_accepted is None else 0.5 * mean_accepted + 0.5 * accepted
                k = max(1, min(cap, round(mean_accepted) + 1))

    def _generate(self, seq: Sequence) -> None:
        """The target alone: one streaming call, every response's tokens out at once."""
        remaining = seq.params.max_tokens - len(seq.output_ids)
        got = 0
        t0 = time.perf_counter()
        for tokens in self._responses(self.cfg.target_model, self._inputs(seq, remaining, streaming=True)):
            got += len(tokens)
            with self.lock:
                self.metrics.steps += 1
                self.metrics.verify_tokens += len(tokens)
                if not self._alive(seq):
                    return
                seq.stats.steps += 1
                if not self._emit(seq, tokens):
                    return
        with self.lock:
            self.metrics.verify_seconds += time.perf_counter() - t0
            if self._alive(seq) and got < remaining:  # ended early: end_id
                self._emit(seq, self.eos_ids[:1])

    # ---- inner calls --------------------------------------------------------------------------
    def _inputs(self, seq: Sequence, output_len: int, draft: list[int] | None = None, drafting: bool = False,
                streaming: bool = False) -> dict[str, np.ndarray]:
        p = seq.params
        one = lambda v, dtype=np.int32: np.array([[v]], dtype=dtype)  # noqa: E731  [batch 1, 1]
        ignore_eos = p.ignore_eos or not self.eos_ids
        inputs = {
            "input_ids": np.array([seq.tokens], dtype=np.int32),
            "input_lengths": one(len(seq.tokens)),
            "request_output_len": one(output_len),
            "end_id": one(-1 if ignore_eos else self.eos_ids[0]),
            "pad_id": one(self.eos_ids[0] if self.eos_ids else 0),
            "exclude_input_in_output": one(self.cfg.inner_exclude_input, bool),
            "streaming": one(streaming, bool),
        }
        if drafting:  # greedy drafts of exactly k tokens: the likeliest match for token matching
            inputs.update(runtime_top_k=one(1), min_length=one(output_len))
            return inputs
        inputs["min_length"] = one(max(0, p.min_tokens - len(seq.output_ids)))
        if p.greedy:
            inputs["runtime_top_k"] = one(1)
        else:  # a fresh seed per call from the request's generator: seeded requests reproduce
            seed = int(torch.randint(0, 2**62, (1,), generator=seq.generator))
            inputs.update(temperature=one(p.temperature, np.float32), runtime_top_k=one(p.top_k),
                          runtime_top_p=one(p.top_p, np.float32), random_seed=one(seed, np.uint64))
        if draft:
            inputs["draft_input_ids"] = np.array([draft], dtype=np.int32)
        return inputs

    def _responses(self, model: str, inputs: dict[str, np.ndarray]) -> Iterator[list[int]]:
        """The new tokens of each response, sliced by the exclude_input_in_output the call sent."""
        skip = 0 if self.cfg.inner_exclude_input else int(inputs["input_lengths"][0][0])
        streaming = bool(inputs["streaming"][0][0])
        for tensors in self.inner.generate(model, inputs):
            length = int(np.asarray(tensors["sequence_length"]).reshape(-1)[0])
            row = np.asarray(tensors["output_ids"]).reshape(-1)  # [batch 1, beam 1, tokens]
            yield [int(t) for t in (row[:length] if streaming else row[skip:length])]

    def _tokens(self, model: str, inputs: dict[str, np.ndarray]) -> list[int]:
        return [t for tokens in self._responses(model, inputs) for t in tokens]


def build_rounds_engine(parameters: dict[str, str], model_dir: str | Path, pb_utils) -> tuple[RoundsConfig, RoundsEngine]:
    """model.py's seam: the config parameters name inner models -> a rounds engine over BLS."""
    cfg = RoundsConfig.from_parameters(parameters, model_dir)
    return cfg, RoundsEngine(cfg, BlsClient(pb_utils))
