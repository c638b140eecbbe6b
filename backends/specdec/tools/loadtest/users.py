"""Locust users that stream completions from specdec models on Triton and record every request.

`GrpcStreamUser` streams over gRPC (tritonclient, one bidirectional stream per user, requests told
apart by id); `HttpSseUser` over HTTP `/v2/models/<m>/generate_stream` (server-sent events). Each
request becomes a `Sample` (time to first token, every response's arrival time and token count,
end-to-end latency, the server's acceptance outputs, the error if any). Samples go

- to Locust's statistics, as request events (`<model>` = whole request, `<model> TTFT` = time to
  first token), so the web UI and the headless summary show them;
- to `--samples-out` as JSON lines, the raw data of `specdec loadtest`'s figures. Workers of a
  distributed run forward theirs to the master, which writes the file.

Options (also in the web UI's "Custom parameters", and as LOCUST_<NAME> environment variables):
--model, --canary-model/--canary-share (route a share of requests to another model), --prompts-file
or --prompt-band, --max-tokens, --temperature, --top-p, --top-k, --seed, --grpc-url,
--samples-out, --max-requests, --request-timeout, --trial-plan.

`--trial-plan FILE` (what `specdec loadtest` uses) replaces --model with interleaved trials: the
users send to one model at a time for `warmup_s + duration_s`, then stop sending, wait until every
request in flight has ended (so no trial overlaps the next), and move on to the next trial's
model. The process running the plan (the local runner, or the master in distributed mode, which
tells its workers by message) snapshots the machine's CPU use at the ends of each measurement
window (`noise.trial_cpu`) and writes one JSON line per trial to the plan's `out` file. Each
sample records the trial it belongs to. In distributed mode each worker reports every trial drained
with the number of samples it sent for it, and the master moves on once every worker's report and
those samples have arrived (a trial's line names any worker that did not report: its samples may
be lost). A request cut off by Locust (the run time ended, the user was stopped) still leaves a
sample, with the error saying so.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import gevent
from gevent import GreenletExit
from gevent.queue import Empty, Queue
from gevent.threadpool import ThreadPool
from locust import User, constant, events, task
from locust.exception import StopUser

from specdec.serving.client import close_stream
from specdec.serving.interface import DEFAULT_GRPC_URL, GRPC_PORT
from specdec.serving.trtllm_llmapi import llmapi_body
from specdec.tools.loadtest.workload import OUTPUT_SPREAD, check_spread, request_tokens

if TYPE_CHECKING:
    from specdec.serving.client import Chunk

try:  # let gRPC's blocking calls yield to other greenlets (Locust runs users on gevent)
    import grpc.experimental.gevent as grpc_gevent

    grpc_gevent.init_gevent()
except Exception:  # pragma: no cover - grpc without gevent support: the HTTP user still works
    pass
# gRPC runs its blocking calls in the hub's thread pool, and every open stream keeps one of its threads
# waiting for responses: with the default 10 threads, users beyond ~10 (a demo at concurrency 16) sent
# requests whose responses no thread ever read
gevent.get_hub().threadpool.maxsize = 64


@dataclass
class Sample:
    model: str
    protocol: str
    start: float  # wall clock (time.time()) when the request was sent
    prompt_index: int
    max_tokens: int
    temperature: float
    chunks: list[list[float]] = field(default_factory=list)  # [seconds after start, tokens] per response
    tokens: int = 0
    text_chars: int = 0
    ttft: float | None = None
    e2e: float | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    finish_reason: str = ""
    error: str | None = None
    worker: str = ""
    served_model: str = ""  # set when a canary router names the model that served the request
    trial: int = -1  # the trial of a --trial-plan run

    def update(self, at: float, chunk: "Chunk") -> None:
        """One streamed response, `at` seconds after the request was sent."""
        ids = len(chunk.token_ids)
        self.chunks.append([round(at, 6), ids])
        self.tokens += ids
        self.text_chars += len(chunk.text)
        if (ids or chunk.text) and self.ttft is None:  # llmapi models return text only
            self.ttft = at
        self.draft_tokens, self.accepted_tokens = chunk.draft_tokens, chunk.accepted_tokens
        self.acceptance_rate = chunk.acceptance_rate
        self.finish_reason = chunk.finish_reason or self.finish_reason


# ---- command-line options (Locust shows them in the web UI as well) ---------------------------------
@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    g = parser  # top-level options: Locust lists those (not argument groups) in the web UI
    g.add_argument("--model", default="spec_eagle", help="served model to load-test")
    g.add_argument("--interface", default="specdec", choices=["specdec", "llmapi"],
                   help="llmapi: TensorRT-LLM >= 1.x llmapi models (serving/trtllm_llmapi.py)")
    g.add_argument("--canary-model", default="", help="send --canary-share of the requests to this model instead")
    g.add_argument("--canary-share", type=float, default=0.0, help="share of requests for --canary-model (0..1)")
    g.add_argument("--prompts-file", default="", help="JSONL with a \"prompt\" per line (default: held-out code)")
    g.add_argument("--prompt-band", default="short", choices=["short", "long"], help="held-out prompt length")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens a request asks for, on average (--max-tokens-spread)")
    g.add_argument("--max-tokens-spread", type=float, default=OUTPUT_SPREAD,
                   help=f"request i asks for max_tokens x uniform(1 - spread, 1 + spread), the same for every model "
                        f"(0: all alike, which keeps closed-loop users in lockstep) (default {OUTPUT_SPREAD})")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0, help="request i gets seed + i (sampled workloads)")
    g.add_argument("--grpc-url", default="", help=f"gRPC address (default: --host's name, port {GRPC_PORT})")
    g.add_argument("--samples-out", default="", help="write one JSON line per request here")
    g.add_argument("--max-requests", type=int, default=0, help="stop after this many requests (0 = run time only)")
    g.add_argument("--request-timeout", type=float, default=300.0)
    g.add_argument("--trial-plan", default="", help="JSON plan of interleaved trials (written by specdec loadtest)")
    g.add_argument("--send-for", type=float, default=0.0,
                   help="send new requests only this many seconds after the first (0 = until stopped); "
                        "with a longer --run-time, requests in flight end before a distributed run stops")


class _State:
    """Per-process state: prompts, request counter, sample sink."""

    def __init__(self, environment) -> None:
        o = environment.parsed_options
        self.environment = environment
        self.options = o
        self.prompts = _load_prompts(o)
        self.prompts_key = (o.prompts_file, o.prompt_band, o.seed)
        check_spread(o.max_tokens_spread)
        self.counter = itertools.count()
        self.done = 0
        self.rng = random.Random(o.seed)
        self.pending: list[dict] = []
        self.first: float | None = None
        self.gate = Gate()
        self.file = open(o.samples_out, "a", buffering=1) if o.samples_out and not _is_worker(environment) else None

    def refresh(self) -> None:
        """Reload the prompts when their options changed (the web UI sets options per run)."""
        o = self.options = self.environment.parsed_options
        if (o.prompts_file, o.prompt_band, o.seed) != self.prompts_key:
            self.prompts = _load_prompts(o)
            self.prompts_key = (o.prompts_file, o.prompt_band, o.seed)

    def next_request(self) -> tuple[int, str, int]:
        """The request's index, model and trial (-1 without a plan); waits while a plan's gate is shut."""
        o = self.options
        if o.trial_plan:
            while not self.gate.open:
                if self.gate.finished:
                    raise StopUser()
                gevent.sleep(0.01)
            self.gate.inflight[self.gate.trial] = self.gate.inflight.get(self.gate.trial, 0) + 1
            return next(self.counter), self.gate.model, self.gate.trial
        now = time.monotonic()
        self.first = self.first if self.first is not None else now
        while o.send_for and now - self.first > o.send_for:
            gevent.sleep(0.2)  # done sending; the run ends at --run-time
            now = time.monotonic()
        i = next(self.counter)
        if o.max_requests and i >= o.max_requests:
            raise StopUser()
        model = o.model
        if o.canary_model and self.rng.random() < o.canary_share:
            model = o.canary_model
        return i, model, -1

    def record(self, sample: Sample) -> None:
        try:
            self.report(sample)
        finally:  # a request ends once recorded: a worker then reports its trial drained only after
            # the sample was sent
            if sample.trial >= 0:
                self.gate.inflight[sample.trial] -= 1

    def report(self, sample: Sample) -> None:
        o = self.options
        ms = (sample.e2e or 0.0) * 1000
        kind = "gRPC-stream" if sample.protocol == "grpc" else "SSE"
        exc = RuntimeError(sample.error) if sample.error else None
        fire = self.environment.events.request.fire
        fire(request_type=kind, name=sample.model, response_time=ms, response_length=sample.tokens, exception=exc,
             context={"ttft_ms": (sample.ttft or 0) * 1000, "acceptance_rate": sample.acceptance_rate})
        if sample.ttft is not None:
            fire(request_type=kind, name=f"{sample.model} TTFT", response_time=sample.ttft * 1000, response_length=0,
                 exception=None, context={})
        line = asdict(sample)
        if self.file is not None:
            self.file.write(json.dumps(line) + "\n")
        elif _is_worker(self.environment):
            self.pending.append(line)
            self.flush_to_master()  # at once: a headless master quits without waiting for workers
        self.done += 1
        if o.max_requests and self.done >= o.max_requests and self.environment.runner is not None:
            gevent.spawn_later(0.1, self.environment.runner.quit)

    def flush_to_master(self) -> None:
        if self.pending and self.environment.runner is not None:
            batch, self.pending = self.pending, []
            self.environment.runner.send_message("specdec_samples", batch)
            for line in batch:
                self.gate.sent[line["trial"]] = self.gate.sent.get(line["trial"], 0) + 1


@dataclass
class Gate:
    """Which model the users of this process send to now (a --trial-plan run) and whether they may."""
    model: str = ""
    trial: int = -1
    open: bool = False
    finished: bool = False
    inflight: dict[int, int] = field(default_factory=dict)  # trial -> its requests in flight
    given_up: set[int] = field(default_factory=set)  # trials whose requests in flight were abandoned
    sent: dict[int, int] = field(default_factory=dict)  # a worker: trial -> its samples sent to the master

    def drained(self, trial: int, timeout_s: float) -> int:
        """Wait until the trial's requests have all ended, at most timeout_s; then the users give up
        on the rest (a request the server never answers must not stall the plan). Returns how many
        were abandoned."""
        deadline = time.monotonic() + timeout_s
        while self.inflight.get(trial, 0) > 0 and time.monotonic() < deadline:
            gevent.sleep(0.01)
        left = self.inflight.get(trial, 0)
        if left:
            self.given_up.add(trial)
        return left


def run_plan(environment, plan: dict) -> None:
    """The trials, one after another (see the module docstring); then the runner quits."""
    from locust.runners import MasterRunner

    from specdec.tools.loadtest import noise

    runner = environment.runner
    master = isinstance(runner, MasterRunner)
    gate = None if master else state(environment).gate
    # the workers that run the users: each must report every trial drained (a worker the master
    # thinks missing for a moment still has its requests in flight)
    workers = {c.id for c in runner.clients.all} if master else set()
    # its own thread: the hub's pool is gRPC's (one blocked thread per stream), with 16 streams it has none left
    pool = ThreadPool(1)
    own = [os.getpid(), os.getppid()] + ([plan["server_pid"]] if plan.get("server_pid") else [])
    with open(plan["out"], "a", buffering=1) as out:
        for index, trial in enumerate(plan["trials"]):
            stubs = noise.model_stubs(plan.get("server_pid"), trial["model"])
            start = time.time()
            if master:
                runner.send_message("specdec_gate", {"model": trial["model"], "trial": index, "open": True})
            else:
                gate.model, gate.trial, gate.open = trial["model"], index, True
            gevent.sleep(plan["warmup_s"])
            before = pool.spawn(noise.snapshot).get()  # a thread: reading /proc must not stall the users
            gevent.sleep(plan["duration_s"])
            after = pool.spawn(noise.snapshot).get()
            unreported: list[str] = []
            if master:
                runner.send_message("specdec_gate", {"model": trial["model"], "trial": index, "open": False,
                                                     "drain_s": plan["drain_s"]})
                abandoned, unreported = workers_drained(runner, workers, index, plan["drain_s"] + WORKER_REPORT_S)
            else:
                gate.open = False
                abandoned = gate.drained(index, plan["drain_s"])
            out.write(json.dumps({**trial, "trial": index, "start": start, "w0": before.wall, "w1": after.wall,
                                  "end": time.time(), "abandoned": abandoned, "unreported_workers": unreported,
                                  "cpu": noise.trial_cpu(before, after, own, stubs),
                                  "rss_mb": noise.rss_mb(stubs)}) + "\n")
    if master:  # the workers' users stop at once (waiting at the shut gate, they would hold up the
        # workers' quit for --stop-timeout, and the matrix killed them)
        runner.send_message("specdec_finished")
    else:
        gate.finished = True
    runner.quit()


# the master's ledger of its workers: worker -> its report of the last trial it drained
# ({"trial", "abandoned": requests given up, "samples": samples of the trial it sent}), and
# (worker, trial) -> samples of that trial received
DRAINED: dict[str, dict] = {}
RECEIVED: dict[tuple[str, int], int] = {}
WORKER_REPORT_S = 30.0  # how long past a drain the master waits for a worker's report and samples
# heartbeats a worker may miss before the master calls it missing (Locust's 3, at one a second, is
# 3 s: a worker stalled that long on a busy machine made the master stop the test, killing the
# requests in flight, and with its last worker missing, end the trial early and lose their samples)
WORKER_LIVENESS = 30


def workers_drained(runner, workers: set[str], trial: int, timeout_s: float) -> tuple[int, list[str]]:
    """Wait (at most timeout_s) until every worker reported the trial drained and all the samples
    it says it sent for the trial have arrived; returns the requests the workers abandoned and the
    workers that did not report (the trial's record names them: samples may be lost). A worker the
    master has forgotten (it stopped or quit) is not waited for: it gets no more messages."""
    def done(w: str) -> bool:
        r = DRAINED.get(w)
        return r is not None and r["trial"] == trial and RECEIVED.get((w, trial), 0) >= r["samples"]

    deadline = time.monotonic() + timeout_s
    while (not all(done(w) or w not in runner.clients for w in workers)
           and time.monotonic() < deadline):
        gevent.sleep(0.01)
    abandoned = sum(DRAINED[w]["abandoned"] for w in workers if w in DRAINED and DRAINED[w]["trial"] == trial)
    return abandoned, sorted(w for w in workers if not done(w))


def _is_worker(environment) -> bool:
    from locust.runners import WorkerRunner

    return isinstance(environment.runner, WorkerRunner)


def _load_prompts(o) -> list[str]:
    if o.prompts_file:
        prompts = []
        with open(o.prompts_file) as f:  # the same format as specdec.tools.prompts.load_jsonl, without its imports
            for line in f:
                if line.strip():
                    obj = json.loads(line)
                    prompts.append(obj.get("prompt", obj.get("text_input")))
    else:
        from specdec.tools.prompts import heldout_prompts

        prompts = heldout_prompts(32, o.prompt_band, o.seed)
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError("prompts: expected non-empty \"prompt\" strings")
    return prompts


STATE: dict[int, _State] = {}
PLANNED: set[int] = set()  # environments whose trial plan has started


def state(environment) -> _State:
    s = STATE.get(id(environment))
    if s is None:
        s = STATE[id(environment)] = _State(environment)
    return s


@events.init.add_listener
def _on_init(environment, **kwargs) -> None:
    from locust.runners import MasterRunner, WorkerRunner

    runner = environment.runner
    if not isinstance(runner, WorkerRunner):
        def on_spawned(**kw) -> None:  # every user exists (on every worker): the plan's first trial may start
            o = environment.parsed_options
            if o is not None and o.trial_plan and id(environment) not in PLANNED:
                # once: the master fires spawning_complete again when it rebalances users (a worker
                # that went missing for a moment), and a second plan would quit the run under the first
                PLANNED.add(id(environment))
                with open(o.trial_plan) as f:
                    plan = json.load(f)
                gevent.spawn(run_plan, environment, plan)
        environment.events.spawning_complete.add_listener(on_spawned)
    if not isinstance(runner, MasterRunner):
        # the heavy imports now: the run time starts counting when users spawn
        from specdec.serving import client  # noqa: F401

        if not isinstance(runner, WorkerRunner) and environment.parsed_options is not None:
            state(environment)  # prompts too (a worker gets its options from the master when users spawn)
    if isinstance(runner, MasterRunner):
        import locust.runners

        locust.runners.HEARTBEAT_LIVENESS = WORKER_LIVENESS  # read on each heartbeat (Locust has no option)
        o = environment.parsed_options
        sink = {"file": None}

        def on_samples(msg, **kw) -> None:
            if o.samples_out and sink["file"] is None:
                sink["file"] = open(o.samples_out, "a", buffering=1)
            for line in msg.data:
                if sink["file"] is not None:
                    sink["file"].write(json.dumps(line) + "\n")
                RECEIVED[msg.node_id, line["trial"]] = RECEIVED.get((msg.node_id, line["trial"]), 0) + 1
        runner.register_message("specdec_samples", on_samples)
        runner.register_message("specdec_drained", lambda msg, **kw: DRAINED.__setitem__(msg.node_id, msg.data))
    elif isinstance(runner, WorkerRunner):
        def on_gate(msg, **kw) -> None:
            s = state(environment)
            s.gate.model, s.gate.trial, s.gate.open = msg.data["model"], msg.data["trial"], msg.data["open"]
            if not s.gate.open:
                def report() -> None:
                    trial = msg.data["trial"]
                    abandoned = s.gate.drained(trial, msg.data["drain_s"])
                    s.flush_to_master()
                    runner.send_message("specdec_drained", {"trial": trial, "abandoned": abandoned,
                                                            "samples": s.gate.sent.get(trial, 0)})
                gevent.spawn(report)
        runner.register_message("specdec_gate", on_gate)
        runner.register_message("specdec_finished", lambda msg, **kw: setattr(state(environment).gate, "finished", True))

        def periodic() -> None:
            while True:
                gevent.sleep(1.0)
                if id(environment) in STATE:
                    STATE[id(environment)].flush_to_master()
        gevent.spawn(periodic)


@events.test_start.add_listener
def _on_start(environment, **kwargs) -> None:
    s = STATE.get(id(environment))
    if s is not None:  # a new run from the web UI starts counting afresh
        s.counter, s.done, s.first = itertools.count(), 0, None


@events.test_stop.add_listener
def _on_stop(environment, **kwargs) -> None:
    s = STATE.get(id(environment))
    if s is not None:
        s.flush_to_master()
        if s.file is not None:
            s.file.flush()
    o = environment.parsed_options
    if o is not None and o.samples_out and not _is_worker(environment) and environment.stats is not None:
        # Locust's own accounting next to the samples (the smoke test checks it against them)
        totals = {e.name: {"requests": e.num_requests, "failures": e.num_failures,
                           "content_length": e.total_content_length} for e in environment.stats.entries.values()}
        with open(o.samples_out + ".locust.json", "w") as f:
            json.dump(totals, f)


# ---- the users ------------------------------------------------------------------------------------------
class _StreamingUser(User):
    abstract = True
    wait_time = constant(0)  # closed loop: each user sends its next request when the last one ends
    protocol = ""

    def on_start(self) -> None:
        self.state = state(self.environment)
        self.state.refresh()
        self.name = uuid.uuid4().hex[:6]

    @task
    def generate(self) -> None:
        i, model, trial = self.state.next_request()
        o = self.state.options
        prompts = self.state.prompts
        tokens = request_tokens(o.max_tokens, o.max_tokens_spread, i)
        sample = Sample(model, self.protocol, time.time(), i % len(prompts), tokens, o.temperature,
                        worker=self.name, trial=trial)
        body = {"text_input": prompts[i % len(prompts)], "max_tokens": tokens, "stream": True,
                "exclude_input_in_output": True, "temperature": o.temperature, "top_p": o.top_p, "top_k": o.top_k}
        if o.temperature > 0:
            body["seed"] = o.seed + i
        if o.interface == "llmapi":
            body = llmapi_body(body.pop("text_input"), **body)
        t0 = time.perf_counter()
        try:
            self.stream(model, body, sample, t0, o.request_timeout)
        except Exception as exc:  # every failure is a recorded error, never a crashed user
            sample.error = sample.error or f"{type(exc).__name__}: {exc}"
            self.reset()
        except GreenletExit:  # Locust stopped the user mid-request: the server may still serve it
            sample.error = "the user was stopped while its request was in flight"
            raise
        finally:
            sample.e2e = time.perf_counter() - t0
            self.state.record(sample)
        if sample.error:
            gevent.sleep(0.5)  # a failing server must not turn into an error storm

    def reset(self) -> None:
        """Drop connection state after a failure."""

    def stream(self, model: str, body: dict, sample: Sample, t0: float, timeout: float) -> None:
        raise NotImplementedError


class GrpcStreamUser(_StreamingUser):
    """Streams over gRPC with tritonclient: one stream per user, one request at a time on it."""

    protocol = "grpc"

    def on_start(self) -> None:
        super().on_start()
        self.client = None
        self.responses: Queue = Queue()

    def _connect(self) -> None:
        import tritonclient.grpc as grpcclient

        url = self.state.options.grpc_url or _grpc_from_host(self.host)
        self.client = grpcclient.InferenceServerClient(url)
        # each stream's callbacks go to its own queue: a stream given up (`abandon`) still calls
        # back, with its cancellation, and must not answer the next stream's request
        self.responses = responses = Queue()
        self.client.start_stream(callback=lambda result=None, error=None:
                                 responses.put((time.perf_counter(), result, error)))

    def reset(self) -> None:
        self.on_stop()

    def on_stop(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            close_stream(client)

    def abandon(self) -> None:
        """Give the stream up: its requests are cancelled and it is closed in a greenlet of its own,
        and the next request starts a fresh one. Only dropped, the client was closed by tritonclient's
        `__del__` without cancelling, which waits for every response of the stream: where one never
        came (the canary's BLS calls deadlocked), the user hung there, and Locust's exit with it."""
        client, self.client = self.client, None
        gevent.spawn(close_stream, client)

    def stream(self, model: str, body: dict, sample: Sample, t0: float, timeout: float) -> None:
        from tritonclient.utils import InferenceServerException

        from specdec.serving.client import grpc_tensors, llmapi_arrays, parse_chunk, request_inputs

        if self.client is None:
            self._connect()
        tensors = grpc_tensors(llmapi_arrays(body) if self.state.options.interface == "llmapi"
                               else request_inputs(body.pop("text_input"), **body))
        rid = uuid.uuid4().hex[:16]
        self.client.async_stream_infer(model, tensors, request_id=rid, enable_empty_final_response=True)
        deadline = t0 + timeout
        while True:
            try:
                at, result, error = self.responses.get(timeout=min(1.0, max(0.0, deadline - time.perf_counter())))
            except Empty:
                given_up = sample.trial in self.state.gate.given_up
                if time.perf_counter() < deadline and not given_up:
                    continue
                sample.error = (f"no response by the end of trial {sample.trial}'s drain" if given_up else
                                f"no response within {timeout:.0f} s")
                self.abandon()
                return
            if error is not None:
                msg = error.message() if isinstance(error, InferenceServerException) else str(error)
                sample.error = msg
                if "stream" in msg.lower() or "unavailable" in msg.lower():
                    self.on_stop()
                return
            response = result.get_response()
            if response.id and response.id != rid:
                continue  # a late response of an abandoned request
            final = response.parameters["triton_final_response"].bool_param
            if result.as_numpy("text_output") is not None:  # not the empty final response
                sample.update(at - t0, parse_chunk(result.as_numpy, final))
                served = result.as_numpy("served_model")
                if served is not None and served.size:
                    sample.served_model = served[0].decode()
            if final:
                return


class HttpSseUser(_StreamingUser):
    """Streams over HTTP `generate_stream` (server-sent events); --host is the HTTP address."""

    protocol = "http"

    def on_start(self) -> None:
        import requests

        super().on_start()
        self.session = requests.Session()

    def stream(self, model: str, body: dict, sample: Sample, t0: float, timeout: float) -> None:
        from specdec.serving.client import parse_event

        base = self.host if self.host.startswith("http") else f"http://{self.host}"
        with self.session.post(f"{base}/v2/models/{model}/generate_stream", json=body, stream=True,
                               timeout=timeout) as r:
            buffer = ""
            for data in r.iter_content(chunk_size=None, decode_unicode=False):
                at = time.perf_counter()
                buffer += data.decode("utf-8", "replace")
                while "\n\n" in buffer:
                    event, buffer = buffer.split("\n\n", 1)
                    for line in event.splitlines():
                        if not line.startswith("data:"):
                            continue
                        payload = json.loads(line[5:])
                        if "error" in payload:
                            sample.error = payload["error"]
                            return
                        sample.update(at - t0, parse_event(payload))
                        sample.served_model = payload.get("served_model") or sample.served_model
            if r.status_code != 200 and sample.error is None:
                sample.error = f"HTTP {r.status_code}: {r.text[:200]}"
            elif not sample.chunks and sample.error is None:
                sample.error = "the stream ended without a response"


def _grpc_from_host(host: str | None) -> str:
    if not host:
        return DEFAULT_GRPC_URL
    name = host.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
    return f"{name}:{GRPC_PORT}"
