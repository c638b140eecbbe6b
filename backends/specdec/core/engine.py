"""The continuous-batching speculative decoding loop.

Each `step()`: admit queued requests into free KV slots and prefill them (their first token goes
out at once), then for all running sequences: propose -> ONE batched target forward over every
sequence's root + draft nodes -> verify -> compact the KV cache to the accepted path -> stream.
The baseline is this same loop with no proposer (every draft empty), so an A/B comparison
differs in exactly one thing.

Threading: `submit` and `cancel` may be called from any thread; the loop runs in one thread
(`start()`), or the caller drives `step()` itself (`generate`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from specdec.core.cost_model import CostModel
from specdec.core.errors import InvalidRequest, QueueTimeout
from specdec.core.models import native
from specdec.core.models.llama import LlamaForCausalLM
from specdec.core.models.tokenizer import Tokenizer
from specdec.core.output import OutputStream
from specdec.core.policy import Policy, StepRecord
from specdec.core.proposers.base import Proposer, path_offsets
from specdec.core.sampling import SamplingParams, mask_eos, probs, sample
from specdec.core.sequence import Output, RequestStats, Sequence
from specdec.core.verify import Draft, TypicalAcceptance, greedy_walk, tree_mask, verify

log = logging.getLogger("specdec.core.engine")


# The parts of one decode step, in order. "schedule": dropping cancelled requests and admitting
# (prefill itself is timed apart); "policy": choosing k and feeding the policy its observations;
# "inputs": the target's token, position and mask tensors; "verify": accepting a path per row;
# "compact": moving accepted tree nodes' KV entries; "commit": the proposer's own bookkeeping
# after verification; "output": committing tokens, stop conditions, detokenizing, streaming.
PHASES = ("schedule", "policy", "draft", "inputs", "forward", "verify", "compact", "commit", "output")
SAMPLED_TIMING_TEMPERATURE = 1.0  # the sampled requests a proposal is timed with before serving
# (`Engine.time_proposals`): what a sampled row's proposal costs does not depend on the temperature


@dataclass
class EngineMetrics:
    """Engine-wide counters (monotonic), read by the metrics exporter and the benchmark."""

    requests: int = 0
    finished: int = 0
    errors: int = 0
    steps: int = 0
    prefill_tokens: int = 0
    output_tokens: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    propose_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    verify_tokens: int = 0
    # where a decode step's time goes (`specdec bench --profile`): seconds per phase, summed over steps
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    decode_seconds: float = 0.0  # whole decode steps: the phases plus what no phase covers
    response_seconds: float = 0.0  # a server's CPU time sending responses, outside the engine thread (`note_responses`)
    response_outputs: int = 0  # ... for this many Outputs (one per running sequence and step)

    def busy_seconds(self) -> dict[str, float]:
        """Engine time by phase: "prefill", each decode phase and "other" (what no decode phase
        covers). The bench's step profile and the served `specdec:engine_seconds` both read it, so a
        served profile and an in-process one split the time alike."""
        out = {"prefill": self.prefill_seconds, **self.phase_seconds}
        out["other"] = max(0.0, self.decode_seconds - sum(self.phase_seconds.values()))
        return out


class Engine:
    def __init__(
        self,
        target: LlamaForCausalLM,
        tokenizer: Tokenizer,
        proposer: Proposer | None,
        max_batch: int,
        max_context: int,
        adaptive: bool,
        queue_timeout_s: float,
        typical: TypicalAcceptance | None = None,
        prefill_threads: int = 1,
    ) -> None:
        """The settings' defaults live in `specdec.core.config`; `build_engine` passes them all."""
        self.target, self.tokenizer, self.proposer = target, tokenizer, proposer
        self.prefill_threads = prefill_threads  # the native pool's for a prefill (decode keeps the runtime's)
        self.typical = typical  # lossy Medusa-2 acceptance for sampled requests; None = exact
        self.max_batch, self.max_context = max_batch, max_context
        self.eos_ids = list(target.config.eos_token_id or tokenizer.eos_ids)
        self.device = target.lm_head.weight.device
        self.adaptive = adaptive and proposer is not None
        self.policy = self.new_policy()
        max_k = self.policy.max_k
        self.capacity = max_context + max_k + 1  # room for the draft nodes past the last position
        self.cache = target.new_cache(max_batch, self.capacity)
        if proposer is not None:
            proposer.allocate(max_batch, self.capacity)
        self.free_slots = list(range(max_batch))  # a heap: the lowest free slot is taken first (_admit)
        self.queue: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.streams: dict[str, OutputStream] = {}
        self.queue_timeout_s = queue_timeout_s
        self.metrics = EngineMetrics()
        self.lock = threading.Condition()
        self.ids = itertools.count()
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.lap_start = time.perf_counter()
        self.observed_seconds = 0.0  # the policy's observation of the last step
        # the engine's own time between two decode steps (the loop, dropping cancelled requests,
        # admitting none): every step pays it, and it counts with the step's time the policy sees
        # (`StepRecord.step_seconds`); measured where no prefill came between (`decode_end` None)
        self.loop_seconds = 0.0
        self.decode_end: float | None = None
        if self.adaptive:
            cost = CostModel.measure(self.probe_forward, max_batch * (max_k + 1))
            cost.proposals.start(self.time_proposals())
            cost.use_path(sampled=True)  # a sampled row's proposal (`CostModel.use_path`), timed apart
            cost.proposals.start(self.time_proposals(temperature=SAMPLED_TIMING_TEMPERATURE))
            cost.use_path(sampled=False)
            self.policy = self.new_policy()  # what the timing requests taught it (their acceptance) is forgotten
            self.policy.cost = cost
            self.metrics = EngineMetrics()

    def new_policy(self) -> Policy:
        p = self.proposer
        return Policy(p.max_k if p else 0, self.adaptive, p.depth_for if p else (lambda k: 0), p.backlog if p else None)

    # ---- requests -------------------------------------------------------------------------
    def submit(
        self, prompt: str | list[int], params: SamplingParams, on_output: Callable[[Output], None],
        request_id: str | None = None,
    ) -> Sequence:
        """Validate and queue a request; raises InvalidRequest with the reason."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("text_input is empty")
            most = (self.max_context - 1) * self.tokenizer.max_token_chars
            if len(prompt) > most:
                raise InvalidRequest(
                    f"text_input has {len(prompt)} characters, more than a prompt of at most {self.max_context - 1} "
                    f"tokens (the context limit of {self.max_context} less one generated token) can have with this "
                    f"tokenizer ({most} characters)")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise InvalidRequest("the prompt has no tokens")
        params.validate(self.max_context - 1)
        if len(prompt_ids) + params.max_tokens > self.max_context:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"limit of {self.max_context} tokens"
            )
        if request_id is not None and request_id in self.streams:
            raise InvalidRequest(f"request id {request_id!r} is already in use by a running request")
        seq = Sequence(
            request_id=request_id or f"req-{next(self.ids)}", prompt_ids=prompt_ids, params=params,
            on_output=on_output, generator=params.generator(), tokens=list(prompt_ids),
        )
        self.streams[seq.request_id] = OutputStream.open(seq, self.tokenizer, self.eos_ids)
        with self.lock:
            self.queue.append(seq)
            self.metrics.requests += 1
            self.lock.notify()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Ask the loop to end a request; its slot is freed within one step."""
        seq.cancelled = True
        with self.lock:
            self.lock.notify()

    # ---- the loop -------------------------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify()
        if self.thread is not None:
            self.thread.join()

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self.stopping and not self.queue and not self.running:
                    self.lock.wait()
                if self.stopping:
                    break
            try:
                self.step()
            except Exception:  # step() already failed the affected requests; keep serving the rest
                log.exception("engine step failed")
        for seq in list(self.queue) + self.running:
            self._finish(seq, "cancelled", error="the server is shutting down")

    def has_work(self) -> bool:
        return bool(self.queue or self.running)

    @torch.inference_mode()
    def step(self) -> None:
        """Admit and prefill, then one propose/verify/commit round for every running sequence."""
        admitted: list[Sequence] = []
        try:
            t0 = time.perf_counter()
            self._drop_cancelled()
            admitted = self._admit()
            scheduled = time.perf_counter() - t0
            if admitted:
                self._prefill(admitted)
                self.decode_end = None  # the time since the last decode step was mostly the prefill's
            if self.running:
                t1 = self.lap_start = time.perf_counter()
                self._decode()
                m = self.metrics
                m.phase_seconds["schedule"] += scheduled
                m.decode_seconds += scheduled + time.perf_counter() - t1
        except Exception as exc:  # never leave a client hanging: fail the batch, keep serving
            for seq in list(self.running) + admitted:
                self._finish(seq, "error", error=f"internal error: {exc!r}")
            raise

    def _lap(self, phase: str) -> None:
        """Charge the time since the previous lap to `phase` (a few hundred ns: always on)."""
        now = time.perf_counter()
        self.metrics.phase_seconds[phase] += now - self.lap_start
        self.lap_start = now

    def _drop_cancelled(self) -> None:
        with self.lock:
            queued = [s for s in self.queue if s.cancelled]
            for s in queued:
                self.queue.remove(s)
        for s in queued + [s for s in self.running if s.cancelled]:
            self._finish(s, "cancelled")

    def _admit(self) -> list[Sequence]:
        admitted, now = [], time.perf_counter()
        with self.lock:
            while self.queue and self.free_slots:
                seq = self.queue.popleft()
                # the lowest free slot, and `running` kept in slot order (_prefill): a batch whose
                # slots form one range reads its KV cache as a slice, where scattered slots (in the
                # order sequences happened to finish) made every layer gather a copy of the batch's
                # whole cache
                seq.slot = heapq.heappop(self.free_slots)
                seq.stats.admitted = now
                admitted.append(seq)
            expired = [s for s in self.queue if now - s.stats.arrival > self.queue_timeout_s]
            for s in expired:
                self.queue.remove(s)
        for s in expired:
            self._finish(s, "error", error=str(QueueTimeout(
                f"no KV slot became free within {self.queue_timeout_s:g} s ({self.max_batch} slots busy)")))
        return admitted

    def _prefill(self, seqs: list[Sequence]) -> None:
        t0 = time.perf_counter()
        rows = [s.prompt_ids for s in seqs]
        width = max(len(r) for r in rows)
        tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=self.device)
        positions = torch.arange(width, device=self.device).expand(len(seqs), -1)
        # prompts of different lengths: the padding is not computed (prompts of 24 and 165 tokens
        # ran 330 rows, not 189) and does not count against the native forward's rows
        lengths = [len(r) for r in rows] if any(len(r) < width for r in rows) else None
        with native.threads_for(self.prefill_threads):
            hidden = self.target(tokens, positions, self.cache, [s.slot for s in seqs], [0] * len(seqs), None, lengths)
            last = hidden[torch.arange(len(seqs)), torch.tensor([len(r) - 1 for r in rows])]
            logits = self.target.logits(last)
        self.metrics.prefill_tokens += sum(len(r) for r in rows)
        firsts = []
        for b, seq in enumerate(seqs):
            row = logits[b : b + 1]
            if seq.params.min_tokens > 0:
                row = mask_eos(row, self.eos_ids, torch.tensor([True]))
            first = int(row.argmax()) if seq.params.greedy else sample(probs(row, seq.params)[0], seq.generator)
            firsts.append(first)
        if self.proposer is not None:
            self.proposer.prefill(seqs, [hidden[b, : len(r)] for b, r in enumerate(rows)])
        self.metrics.prefill_seconds += time.perf_counter() - t0
        for seq, first in zip(seqs, firsts):
            seq.stats.steps += 1
            self.policy.admit(seq)
            self.running.append(seq)
            self._emit(seq, [first])
        self.running.sort(key=lambda s: s.slot)

    def _decode(self) -> None:
        seqs = list(self.running)
        chosen = time.perf_counter()
        if self.decode_end is not None:
            self.loop_seconds = chosen - self.decode_end
        ks = self.policy.choose(seqs)
        chosen = time.perf_counter() - chosen
        self._lap("policy")
        proposing = self.proposer is not None and any(ks)
        backlogs = [self.proposer.backlog(s) if k else 0 for s, k in zip(seqs, ks)] if proposing else []
        t0 = time.perf_counter()
        drafts = self.proposer.propose(seqs, ks) if proposing else [Draft.empty() for _ in seqs]
        t1 = time.perf_counter()
        self._lap("draft")
        T = 1 + max(len(d) for d in drafts)
        B = len(seqs)
        starts = [s.cache_len for s in seqs]
        slots = [s.slot for s in seqs]
        # [B, T] flattened, built as lists: per-row tensor writes cost ~4 operator calls a row
        pad = [T - 1 - len(d) for d in drafts]
        tokens: list[int] = []
        positions: list[int] = []
        for s, d, n, st in zip(seqs, drafts, pad, starts):
            tokens += [s.tokens[-1], *d.tokens] + [0] * n
            positions += [st + x for x in [0, *d.depths()]] + [st] * n
        masks = None if all(d.is_chain() for d in drafts) else torch.stack([tree_mask(d, T) for d in drafts])
        # rows drafting fewer tokens than the longest are padded; the native decoder skips padding,
        # and the output head runs on the real tokens only (2 of 8 rows drafting 4 tokens: 16, not 40)
        lengths = [T - n for n in pad] if any(pad) else None
        ends = list(itertools.accumulate(lengths or [T] * B))  # each row's tokens end here among the real ones
        # rows that are all greedy and past min_tokens read each token's argmax alone: the forward,
        # head and argmax are one native call where the target runs natively (`greedy_step`)
        greedy = all(s.params.greedy and len(s.output_ids) >= s.params.min_tokens for s in seqs)
        self._lap("inputs")
        t2 = time.perf_counter()
        one_call = self.target.greedy_step(tokens, positions, B, T, self.cache, slots, starts, masks, lengths) if greedy else None
        if one_call is not None:
            hidden, argmax = one_call
            logits = None
        else:  # rows that sample (or owe min_tokens) read the logits: one native call where it runs
            hidden, logits = (self.target.logits_step(tokens, positions, B, T, self.cache, slots, starts, masks, lengths)
                              or self._forward(tokens, positions, B, T, slots, starts, masks, lengths))
        t3 = time.perf_counter()
        self._lap("forward")
        m = self.metrics
        m.steps += 1
        m.propose_seconds += t1 - t0
        m.verify_seconds += t3 - t2
        tokens_run = sum(len(d) + 1 for d in drafts)
        m.verify_tokens += tokens_run
        depths = [max(d.depths(), default=0) for d in drafts]
        accepted_n: list[int] = []
        if one_call is None:
            argmax = logits.argmax(-1).tolist() if any(s.params.greedy for s in seqs) else None  # one call for all
            if argmax and lengths is None:  # [B][T]: flattened as a padded batch's are
                argmax = list(itertools.chain.from_iterable(argmax))
        flat = logits if lengths else None  # [tokens, V]; a [B, T, V] is flattened for the first sampled row
        begins = [0] + ends[:-1]
        self._lap("verify")
        for b, (seq, draft) in enumerate(zip(seqs, drafts)):
            eos_blocked = seq.params.min_tokens - len(seq.output_ids)
            if seq.params.greedy and eos_blocked <= 0:
                verdict = greedy_walk(draft, argmax[begins[b] : ends[b]])
            else:
                flat = logits.flatten(0, 1) if flat is None else flat
                verdict = verify(draft, flat[begins[b] : ends[b]], seq.params, seq.generator, self.eos_ids,
                                 eos_blocked, self.typical)
            self._lap("verify")
            self.cache.compact(seq.slot, starts[b], path_offsets(verdict.path))
            self._lap("compact")
            accepted = [draft.tokens[i] for i in verdict.path]
            accepted_n.append(len(accepted))
            self._count(seq, draft, len(accepted))
            seq.stats.steps += 1
            running = self._emit(seq, accepted + [verdict.bonus])
            self._lap("output")
            if running and self.proposer is not None and (draft.tokens or self.proposer.commits_undrafted):
                self.proposer.commit(seq, verdict.path, hidden, b)
                self._lap("commit")
        t4 = time.perf_counter()
        step_seconds = t4 - t1 + self.loop_seconds
        if self.policy.coasting_plain:  # a paused batch between searches: its step's times alone
            self.policy.observe_coasting(seqs, step_seconds, t1 - t0 + chosen + self.observed_seconds)
        else:
            self.policy.observe(StepRecord(
                seqs, ks, depths, accepted_n, backlogs, propose_seconds=t1 - t0, depth=max(depths),
                step_seconds=step_seconds, tokens=tokens_run, policy_seconds=chosen + self.observed_seconds))
        self.observed_seconds = time.perf_counter() - t4  # charged to the next step (`StepRecord.policy_seconds`)
        self._lap("policy")
        self.decode_end = self.lap_start

    def _forward(self, tokens: list[int], positions: list[int], B: int, T: int, slots: list[int], starts: list[int],
                 masks: Tensor | None, lengths: list[int] | None) -> tuple[Tensor, Tensor]:
        """The target's forward and logits for a step whose rows need logits (sampled, or owing
        min_tokens) where it does not run natively (`logits_step` takes the others, in one call):
        hidden [B, T, H] and logits [B, T, V], or
        [real tokens, V] for a padded batch; flattened, row b's are begins[b]:ends[b] in both. A
        padded batch's logits were scattered into a zeroed [B, T, V]: with one 2-token row among
        8 plain ones the head and argmax took 125 us against 71 us for 8 plain rows (90 us now), a
        jump the policy's curve, interpolated between the plain and the full batch's token counts,
        does not see."""
        hidden = self.target(torch.tensor(tokens, device=self.device).view(B, T),
                             torch.tensor(positions, device=self.device).view(B, T), self.cache, slots, starts,
                             None if masks is None else masks.to(self.device), lengths)
        if lengths is None:
            return hidden, self.target.logits(hidden)
        real = torch.arange(T, device=self.device) < torch.tensor(lengths, device=self.device)[:, None]
        return hidden, self.target.logits(hidden[real])

    def _count(self, seq: Sequence, draft: Draft, accepted: int) -> None:
        if not len(draft):
            return
        for stats in (seq.stats, self.metrics):
            stats.drafts += 1
            stats.draft_tokens += len(draft)
            stats.accepted_tokens += accepted
            while len(stats.accepted_per_position) < accepted:
                stats.accepted_per_position.append(0)
            for d in range(accepted):
                stats.accepted_per_position[d] += 1

    # ---- output ---------------------------------------------------------------------------
    def _emit(self, seq: Sequence, new_tokens: list[int]) -> bool:
        """Commit tokens to the request's output and stream them. True if it is still running."""
        stream = self.streams[seq.request_id]
        done = stream.commit(new_tokens)
        self.metrics.output_tokens += len(done.tokens)
        if done.reason is not None:
            self._finish(seq, done.reason, text_end=done.text_end, token_ids=done.tokens)
            return False
        stream.send(done.text_end, done.tokens)
        return True

    def _finish(self, seq: Sequence, reason: str, text_end: int | None = None, token_ids=(), error=None) -> None:
        stream = self.streams.pop(seq.request_id, None)
        if stream is None:  # already finished
            return
        seq.stats.finished = time.perf_counter()
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot >= 0:
            if self.proposer is not None:
                self.proposer.release(seq.slot)
            self.policy.release(seq.slot)
            heapq.heappush(self.free_slots, seq.slot)
            seq.slot = -1
        self.metrics.finished += 1
        self.metrics.errors += reason == "error"
        stream.send(text_end, token_ids, finished=True, reason=reason, error=error)

    # ---- helpers --------------------------------------------------------------------------
    def probe_forward(self, n: int, rows: int | None = None) -> None:
        """A verification-shaped target forward (start-up cost calibration; every slot is still
        free): n new tokens after a typical context, logits for all of them, as a decode step does.
        Leaving out the context or the logits made the target look 2x cheaper than it is, and the
        policy then judged every proposer too expensive. The tokens are spread over as many rows
        as a full batch has, as a step of n tokens is: n rows of one token up to max_batch, then
        max_batch rows of up to max_k + 1 (so every row fits its slot). Two rows of 4-5 tokens,
        taken for 8 tokens before, read the cache of 2 sequences instead of 8: at batch 8 the
        curve put a k = 4 step (8 x 5) at 2.25x a plain one (8 x 1) where it ran 1.46x, and the
        draft model (1.3x at fixed k = 4) stayed off in some runs. `rows`: that many rows instead
        (the bench's curve of one sequence; its caller keeps n within half the context, where at
        most a row's tokens start)."""
        rows = rows or min(n, self.max_batch)
        width = -(-n // rows)  # <= max_k + 1: calibration probes at most max_batch * (max_k + 1) tokens
        start = min(256, self.max_context // 2)
        # through the call a greedy step takes (`greedy_step`) where the target has it: timed through
        # the separate forward, head and argmax, a one-token forward carried ~0.1 ms those steps no
        # longer pay, and the curve put 4 tokens at 1.24x one where greedy steps ran 2.4x
        positions = [start + i for _ in range(rows) for i in range(width)]
        if self.target.greedy_step([0] * (rows * width), positions, rows, width, self.cache, list(range(rows)),
                                   [start] * rows) is not None:
            return
        with torch.inference_mode():
            tokens = torch.zeros(rows, width, dtype=torch.long, device=self.device)
            positions = (start + torch.arange(width, device=self.device)).expand(rows, -1)
            hidden = self.target(tokens, positions, self.cache, list(range(rows)), [start] * rows)
            self.target.logits(hidden).argmax(-1).tolist()

    def note_responses(self, seconds: float, outputs: int, responses: int | None = None, alone: int | None = None) -> None:
        """A server's sender thread spent `seconds` of CPU sending `responses` responses carrying
        `outputs` Outputs (one per running sequence and step), `alone` of them each in a response
        of its own (None: every Output its own response): counted, and charged by the adaptive
        policy to every row of every step (`CostModel.observe_output`) as what one Output fewer
        saves: a response's cost where it went alone, nothing where it shared one. Where the sender
        falls behind the engine, a stream's Outputs pile up and leave as one response, and a step
        fewer makes no response fewer: served at 4 and 16 users the baseline's responses carried
        3.4-3.5 tokens, a drafting model's 2.9-3.3 (its longer steps let the sender keep up).
        Charged per Output regardless, as before, the draft model read 0.92-0.94x the baseline's
        tokens/s there, 0.95-1.06x uncharged, 0.93-0.95x charged this way (load tests of 6
        rounds, intervals about +-0.07: reports/benchmarks-log.md). At one user, where drafting made
        responses carry 2.7-3.4 tokens against 2.2-2.3, the charge pays (1.04-1.10x against
        1.02x uncharged). Charged to the regime the policy is in as they leave, drafting or not:
        each regime's outputs are priced apart (`CostModel.observe_output`). Called from that
        thread."""
        self.metrics.response_seconds += seconds
        self.metrics.response_outputs += outputs
        if self.policy.cost is not None and outputs:
            per_response = seconds / (responses or outputs)
            self.policy.cost.observe_output(per_response * (outputs if alone is None else alone) / outputs,
                                            self.policy.drafting_regime)

    def time_proposals(self, rounds: int = 2, temperature: float = 0.0) -> list[tuple[int, int, float]]:
        """(rows, depth, seconds): the fastest in-sync proposal for one row and for a full batch at
        two depths, timed over a few steps of requests run before serving (the policy has no
        cost model yet, so each drafts its cap), in rounds like the target's curve, so that a
        busy spell slows one round of every shape rather than one shape. Without it the policy
        started from a tenth of a one-token target forward per level and row: EAGLE's proposal
        was 4x that (2.1 one-token forwards at depth 4), prompt lookup's a twelfth of it, and a
        paused method whose probes all caught up first (at batch 8 every probe did) kept the
        guess for good. At a `temperature`, sampled (unseeded) requests: a sampled row's proposal
        (`CostModel.use_path`), started from the greedy one's fit and its own samples only, was
        priced at 0.3 ms where its probes took 0.7-1.2 ms (the draft model at batch 1: while paused,
        nearly every proposal it timed was a catch-up), and it drafted at a loss."""
        prompt = [1 + i % 8 for i in range(min(24, self.max_context // 2))]  # a pattern prompt lookup finds
        if not prompt:  # a context too short for any request (one token): nothing to time
            return []
        top, cost = self.policy.max_k, self.policy.cost
        self.policy.cost = None  # no cost model: every request drafts its cap
        cells = [(rows, k) for rows in sorted({1, self.max_batch}) for k in sorted({min(2, top), top})]
        params = {k: SamplingParams(max_tokens=min(16, self.max_context - len(prompt)), ignore_eos=True,
                                    num_draft_tokens=k, temperature=temperature) for k in {k for _, k in cells}}
        fastest = dict.fromkeys(cells, float("inf"))
        try:
            for r in range(rounds):
                for rows, k in cells:
                    for i in range(rows):
                        self.submit(prompt, params[k], lambda out: None, request_id=f"proposal-timing-{r}-{rows}-{k}-{i}")
                    self.step()  # the prefill, and a first proposal that catches up on the prompts
                    while self.has_work():
                        full, before = len(self.running) == rows, self.metrics.propose_seconds
                        self.step()
                        if full and self.metrics.propose_seconds > before:
                            fastest[rows, k] = min(fastest[rows, k], self.metrics.propose_seconds - before)
        finally:
            self.policy.cost = cost
        return [(rows, self.policy.depth_of[k], t) for (rows, k), t in fastest.items() if t < float("inf")]

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]) -> list["Result"]:
        """Run prompts to completion in this thread (the CLI, benchmark and tests use this)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        results = [Result() for _ in prompts]
        for r, prompt, p in zip(results, prompts, plist):
            r.seq = self.submit(prompt, p, r.add)
        while self.has_work():
            self.step()
        return results


@dataclass
class Result:
    """A whole completion collected from streamed Outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    chunks: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    stats: RequestStats | None = None
    seq: Sequence | None = None

    def add(self, out: Output) -> None:
        self.text += out.text
        self.chunks.append(out.text)
        self.token_ids += out.token_ids
        self.stats = out.stats
        if out.finished:
            self.finish_reason, self.error = out.finish_reason, out.error
