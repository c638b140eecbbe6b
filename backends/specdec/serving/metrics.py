"""Prometheus metrics on Triton's metrics port, from the Python backend (pb_utils.MetricFamily).

Names follow vLLM's (`specdec:` prefix), every series labelled with `model`. The engine thread only
appends plain numbers to a deque (`on_output`); a flusher thread turns engine counters into counter
increments and queued observations into histogram observations every `interval_s`, so the IPC to
the server never sits on the decode path.
"""

from __future__ import annotations

import collections
import threading
import time

LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]

# name -> (kind, description); kind "counter" | "gauge" | "histogram"
FAMILIES = {
    "specdec:spec_decode_num_drafts": ("counter", "Verification rounds that checked at least one draft token"),
    "specdec:spec_decode_num_draft_tokens": ("counter", "Draft tokens proposed"),
    "specdec:spec_decode_num_accepted_tokens": ("counter", "Draft tokens accepted by the target"),
    "specdec:spec_decode_num_accepted_tokens_per_pos": ("counter", "Accepted draft tokens by draft position (0 = first)"),
    "specdec:spec_decode_draft_acceptance_rate": ("gauge", "Accepted / proposed draft tokens since start"),
    "specdec:generation_tokens": ("counter", "Output tokens generated"),
    "specdec:prompt_tokens": ("counter", "Prompt tokens prefilled"),
    "specdec:engine_seconds": ("counter", "Engine thread's busy time by phase: prefill, then a decode step's "
                               "schedule, policy, draft, inputs, forward, verify, compact, commit, output, other"),
    "specdec:response_seconds": ("counter", "CPU time the backend's sender thread spent building and sending "
                                 "responses (outside the engine thread)"),
    "specdec:responses": ("counter", "Outputs the sender thread sent (one per running request and step): "
                          "response_seconds over this is a response's cost"),
    "specdec:request_success": ("counter", "Finished requests by finished_reason (length, eos, stop, cancelled, error)"),
    "specdec:num_requests_running": ("gauge", "Requests holding a KV slot"),
    "specdec:num_requests_waiting": ("gauge", "Requests queued for a KV slot"),
    "specdec:kv_slots": ("gauge", "KV cache slots of this instance (the batch limit)"),
    "specdec:time_to_first_token_seconds": ("histogram", "Arrival to first output token"),
    "specdec:inter_token_latency_seconds": ("histogram", "Mean gap between a request's tokens after the first (one per request)"),
    "specdec:request_queue_time_seconds": ("histogram", "Arrival to admission into a KV slot"),
    "specdec:e2e_request_latency_seconds": ("histogram", "Arrival to the last token"),
    "specdec:batch_size": ("histogram", "Running requests, sampled every flush interval while any run"),
    "specdec:drafting_vetoes": ("counter", "Times the adaptive policy's rate guard stopped drafting for a batch size "
                                "because drafting's realized tokens/s trailed plain decoding's"),
    "specdec:model_restarts": ("counter", "Reloads of this model by `specdec serve` after its backend stub died"),
    "specdec:server_restarts": ("counter", "Restarts of tritonserver by `specdec serve` after it died"),
}

ENGINE_COUNTERS = {
    "specdec:spec_decode_num_drafts": "drafts",
    "specdec:spec_decode_num_draft_tokens": "draft_tokens",
    "specdec:spec_decode_num_accepted_tokens": "accepted_tokens",
    "specdec:generation_tokens": "output_tokens",
    "specdec:prompt_tokens": "prefill_tokens",
    "specdec:response_seconds": "response_seconds",
    "specdec:responses": "response_outputs",
}


class Metrics:
    def __init__(self, pb_utils, model: str, engine, interval_s: float = 0.2) -> None:
        self.pb, self.model, self.engine, self.interval_s = pb_utils, model, engine, interval_s
        kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE,
                 "histogram": pb_utils.MetricFamily.HISTOGRAM}
        # the families must outlive their Metric objects (docs/design.md, "Triton traps"): keep them on self
        self.families = {name: pb_utils.MetricFamily(name=name, description=desc, kind=kinds[kind])
                         for name, (kind, desc) in FAMILIES.items()}
        self.metrics: dict[tuple, object] = {}
        self.seen = {name: 0 for name in ENGINE_COUNTERS}
        self.seen_per_pos: list[int] = []
        self.seen_busy: dict[str, float] = {}
        self.seen_vetoes = 0
        self.pending: collections.deque = collections.deque()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.metric("specdec:kv_slots").set(engine.max_batch)
        self.metric("specdec:drafting_vetoes")  # at 0 from the start: a policy that never vetoed says so
        self.thread = threading.Thread(target=self._loop, name="specdec-metrics", daemon=True)
        self.thread.start()

    def metric(self, name: str, **labels):
        key = (name, tuple(sorted(labels.items())))
        m = self.metrics.get(key)
        if m is None:
            all_labels = {"model": self.model, **labels}
            if FAMILIES[name][0] == "histogram":
                buckets = BATCH_BUCKETS if name == "specdec:batch_size" else LATENCY_BUCKETS
                m = self.families[name].Metric(labels=all_labels, buckets=buckets)
            else:
                m = self.families[name].Metric(labels=all_labels)
            self.metrics[key] = m
        return m

    def restarts(self, model: int, server: int) -> None:
        """Raise the restart counters to the watchdog's counts so far (`control.restarts`): they
        outlive the process that counts. A dead stub never deletes its metrics, so the stub of its
        reload gets them back in tritonserver with their values: adding the whole count on top of
        those counted a model's second reload as 1 + 2 = 3."""
        with self.lock:
            for name, n in (("specdec:model_restarts", model), ("specdec:server_restarts", server)):
                metric = self.metric(name)
                if n > metric.value():
                    metric.increment(n - metric.value())

    # ---- called from the engine thread: cheap appends only -------------------------------
    def observe(self, name: str, value: float) -> None:
        self.pending.append((name, value))

    def finished(self, reason: str) -> None:
        self.pending.append(("specdec:request_success", reason))

    # ---- flusher ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self.stopping.wait(self.interval_s):
            self.flush()

    def flush(self) -> None:
        with self.lock:
            try:
                self._flush()
            except Exception as exc:  # metrics must never take the model down
                self.pb.Logger.log_warn(f"specdec metrics flush failed: {exc!r}")

    def _flush(self) -> None:
        m = self.engine.metrics
        for name, attr in ENGINE_COUNTERS.items():
            value = getattr(m, attr)
            if value > self.seen[name]:
                self.metric(name).increment(value - self.seen[name])
                self.seen[name] = value
        per_pos = list(m.accepted_per_position)
        for pos, value in enumerate(per_pos):
            before = self.seen_per_pos[pos] if pos < len(self.seen_per_pos) else 0
            if value > before:
                self.metric("specdec:spec_decode_num_accepted_tokens_per_pos", position=str(pos)).increment(value - before)
        self.seen_per_pos = per_pos
        for phase, value in m.busy_seconds().items():
            if value > self.seen_busy.get(phase, 0.0):
                self.metric("specdec:engine_seconds", phase=phase).increment(value - self.seen_busy.get(phase, 0.0))
                self.seen_busy[phase] = value
        vetoes = self.engine.policy.guard.vetoes  # the policy's own count: engine.metrics is per run
        if vetoes > self.seen_vetoes:
            self.metric("specdec:drafting_vetoes").increment(vetoes - self.seen_vetoes)
            self.seen_vetoes = vetoes
        if m.draft_tokens:
            self.metric("specdec:spec_decode_draft_acceptance_rate").set(m.accepted_tokens / m.draft_tokens)
        running = len(self.engine.running)
        self.metric("specdec:num_requests_running").set(running)
        if running:
            self.metric("specdec:batch_size").observe(running)
        self.metric("specdec:num_requests_waiting").set(len(self.engine.queue))
        while self.pending:
            name, value = self.pending.popleft()
            if name == "specdec:request_success":
                self.metric(name, finished_reason=value).increment(1)
            else:
                self.metric(name).observe(value)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self.flush()


class RequestTimer:
    """Per-request latency observations, fed from the Outputs of one request (engine thread).
    A few observations per request, not per step: each observe is an IPC to the server."""

    __slots__ = ("metrics", "started")

    def __init__(self, metrics: Metrics | None) -> None:
        self.metrics, self.started = metrics, False

    def on_output(self, out) -> None:
        m = self.metrics
        if m is None:
            return
        stats = out.stats
        if not self.started and out.token_ids:
            self.started = True
            if stats.first_token is not None:
                m.observe("specdec:time_to_first_token_seconds", stats.first_token - stats.arrival)
            if stats.admitted is not None:
                m.observe("specdec:request_queue_time_seconds", stats.admitted - stats.arrival)
        if out.finished:
            m.finished(out.finish_reason or "unknown")
            now = time.perf_counter()
            if stats.first_token is not None:
                m.observe("specdec:e2e_request_latency_seconds", now - stats.arrival)
                if stats.output_tokens > 1:
                    m.observe("specdec:inter_token_latency_seconds",
                              (now - stats.first_token) / (stats.output_tokens - 1))
