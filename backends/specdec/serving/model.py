"""The decoupled Python-based Triton backend (`backend: "specdec"` in config.pbtxt).

initialize: config parameters -> EngineConfig -> engine (background thread) + metrics.
execute: parse + validate each request, submit it to the engine, return None at once; every
request then gets its responses from the engine thread through its `Stream` and always ends with
the final flag (also on errors, queue timeouts, cancellation and shutdown).
Cancellation: each streamed step checks `request.is_cancelled()`; a watcher thread checks the
requests still waiting for a slot. Either calls engine.cancel, which frees the slot within a step.
Drain (`control.py`): the same watcher reads the drain deadline `specdec serve` writes on SIGINT or
SIGTERM; from then on new requests get DRAINING as their error, requests still running at the
deadline end with DRAIN_EXPIRED, and an instance with nothing left says so (`drained-<pid>`).
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import subprocess
import threading
import time
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

from specdec.core.engine_config import build_engine, freeze_heap
from specdec.core.errors import ConfigurationError, SpecdecError
from specdec.serving import control
from specdec.serving.config import backend_options, engine_config, placed
from specdec.serving.metrics import Metrics, RequestTimer
from specdec.serving.request import ParsedRequest, parse
from specdec.serving.rounds import build_rounds_engine, is_rounds

WATCH_INTERVAL_S = 0.05
DRAINING = "the server is draining (shutting down) and admits no new requests; retry on another replica"
DRAIN_EXPIRED = "the server shut down before this request finished (its drain deadline passed)"


class Stream:
    """One request's responses. The engine thread hands Outputs to `on_output` (a queue put: the
    engine never waits for IPC); the model's sender thread delivers them, merging what piled up."""

    def __init__(self, model: "TritonPythonModel", request, sender, parsed: ParsedRequest) -> None:
        self.model, self.request, self.sender, self.parsed = model, request, sender, parsed
        self.seq = None
        self.key = None
        self.prefix = "" if parsed.exclude_input else parsed.prompt  # sent with the first response
        self.text: list[str] = []
        self.ids: list[int] = []
        self.timer = RequestTimer(model.metrics)
        self.done = False
        self.abort_error: str | None = None  # set by abort(): the cancelled request ends with this error
        # is_cancelled() on a request whose final response was sent crashes tritonserver (signal 11
        # in TRITONBACKEND_ResponseFactoryIsCancelled): `done` is set, and checked, under this lock
        self.guard = threading.Lock()
        self.interval = model.stream_interval if parsed.stream else 1 << 30
        self.pending: list = []
        self.pending_tokens = 0
        self.sent_first = not parsed.stream

    def on_output(self, out) -> None:
        """Engine thread: cheap and never raises. Holds streamed steps back until stream_interval
        tokens are pending (the first token and the end go at once)."""
        try:
            self.timer.on_output(out)
        except Exception:
            pass
        self.pending.append(out)
        self.pending_tokens += len(out.token_ids)
        if out.finished or self.pending_tokens >= self.interval or not self.sent_first:
            self.sent_first = self.sent_first or self.pending_tokens > 0
            for o in self.pending:
                self.model.outbox.put((self, o))
            self.pending, self.pending_tokens = [], 0

    def deliver(self, outs: list) -> None:
        """Sender thread: one response for the Outputs of this request that arrived together."""
        last = outs[-1]
        try:
            text = "".join(o.text for o in outs)
            ids = [i for o in outs for i in o.token_ids]
            if last.finished:
                self.finish(last, text, ids)
            elif self.parsed.stream:
                self.sender.send(self.response(text, ids, last.stats, ""))
                self.check_cancelled()
            else:
                self.text.append(text)
                self.ids += ids
        except Exception:
            pb_utils.Logger.log_error(f"specdec: sending a response failed:\n{traceback.format_exc()}")
            if last.finished:
                self.model.forget(self)
                try:  # the final flag must go out, or the client waits forever
                    self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        "internal error while sending the response")), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                except Exception:
                    pass
            elif self.seq is not None:
                self.model.engine.cancel(self.seq)

    def finish(self, out, text: str, ids: list[int]) -> None:
        with self.guard:
            self.done = True
        try:  # forgotten only after the final response went out: the drain waits for `active` to empty
            error = out.error or (self.abort_error if out.finish_reason == "cancelled" else None)
            if error:
                self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(error)),
                                 flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            if not self.parsed.stream:
                text, ids = "".join(self.text) + text, self.ids + ids
            self.sender.send(self.response(text, ids, out.stats, out.finish_reason or ""),
                             flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            self.model.forget(self)

    def abort(self, error: str) -> None:
        """End the request early; its final response is `error` (unless it finished meanwhile)."""
        with self.guard:
            if self.done or self.abort_error is not None or self.seq is None:
                return
            self.abort_error = error
        self.model.engine.cancel(self.seq)

    def response(self, text: str, ids: list[int], stats, reason: str):
        if self.prefix:
            text, self.prefix = self.prefix + text, ""
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("output_ids", np.array(ids, dtype=np.int32)),
            pb_utils.Tensor("total_draft_tokens", np.array([stats.draft_tokens], dtype=np.int32)),
            pb_utils.Tensor("total_accepted_draft_tokens", np.array([stats.accepted_tokens], dtype=np.int32)),
            pb_utils.Tensor("acceptance_rate", np.array([stats.acceptance_rate], dtype=np.float32)),
            pb_utils.Tensor("finish_reason", np.array([reason.encode()], dtype=np.object_)),
        ])

    def check_cancelled(self) -> bool:
        with self.guard:
            if self.done or self.seq is None or self.seq.cancelled or not self.request.is_cancelled():
                return False
        self.model.engine.cancel(self.seq)
        return True


def exit_with_server(server_pid: int) -> None:
    """Kill this stub once tritonserver is gone (killed, say): the stub's own check takes minutes,
    holding the model's memory. The guard is a tiny shell process, not a thread of ours: a stub
    whose thread blocks in a send to the dead server while holding the GIL (seen: every thread in
    a futex wait, parent pid 1) never runs a Python check again. It ends with the stub."""
    subprocess.Popen(
        ["/bin/sh", "-c", 'while kill -0 "$1" && kill -0 "$2"; do sleep 0.2; done 2>/dev/null; kill -9 "$2" 2>/dev/null',
         "specdec-stub-guard", str(server_pid), str(os.getpid())],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        exit_with_server(os.getppid())  # first: a server killed while the model loads must not leave it behind
        config = json.loads(args["model_config"])
        self.name = args["model_name"]
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ConfigurationError(f"{self.name}: the specdec backend needs model_transaction_policy "
                                     "{ decoupled: true }")
        parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        if is_rounds(parameters):  # draft-then-verify over inner tensorrt_llm-contract models (BLS)
            self.config, self.engine = build_rounds_engine(parameters, args["model_repository"], pb_utils)
            self.stream_interval = self.config.stream_interval
        else:
            self.config = placed(engine_config(parameters, args["model_repository"]),
                                 args.get("model_instance_kind", "CPU"), args.get("model_instance_device_id", 0))
            self.stream_interval = backend_options(parameters).stream_interval
            self.engine = build_engine(self.config)
        freeze_heap()
        self.metrics = Metrics(pb_utils, self.name, self.engine)
        self.ids = itertools.count()
        self.active: dict[int, Stream] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.control = control.control_dir()
        self.draining = False
        counts = control.restarts(self.control)
        self.metrics.restarts(counts["models"].get(self.name, 0), counts.get("server", 0))
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.sender = threading.Thread(target=self._send_loop, name="specdec-sender", daemon=True)
        self.sender.start()
        self.engine.start()
        self.watcher = threading.Thread(target=self._watch, name="specdec-cancel-watcher", daemon=True)
        self.watcher.start()
        proposer = self.engine.proposer
        drafts_in = proposer.drafts_in if proposer is not None else None  # None: no drafter model
        pb_utils.Logger.log_info(f"specdec: {self.name} ready ({self.config})"
                                 + (f"; its drafter's matmuls take {drafts_in}" if drafts_in else ""))

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            n = None
            try:
                inputs = {t.name(): t.as_numpy() for t in request.inputs()}
                parsed = parse(inputs, request.parameters())
                stream = Stream(self, request, sender, parsed)
                with self.lock:  # the same lock as the drain's look at `active`: none slips past it
                    admitted = not self.draining
                    if admitted:
                        n = next(self.ids)
                        self.active[n] = stream
                if not admitted:
                    self._fail(sender, DRAINING)
                    continue
                stream.key = n
                rid = f"{request.request_id() or 'req'}#{n}"
                stream.seq = self.engine.submit(parsed.prompt, parsed.params, stream.on_output, request_id=rid)
            except SpecdecError as exc:  # InvalidRequest: the message names the input
                self._fail(sender, str(exc))
                self.forget_key(n)
            except Exception as exc:
                pb_utils.Logger.log_error(f"specdec: execute failed:\n{traceback.format_exc()}")
                self._fail(sender, f"internal error: {exc!r}")
                self.forget_key(n)
        return None

    @staticmethod
    def _fail(sender, message: str) -> None:
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def forget(self, stream: Stream) -> None:
        self.forget_key(getattr(stream, "key", None))

    def forget_key(self, key) -> None:
        if key is not None:
            with self.lock:
                self.active.pop(key, None)

    def _watch(self) -> None:
        """Streaming requests are checked by the sender after each response; requests still queued
        for a slot and non-streaming ones send nothing until the end, so poll those here. Also
        follows the drain deadline (`exit_with_server` ends the stub when tritonserver is gone)."""
        while not self.stopping.wait(WATCH_INTERVAL_S):
            with self.lock:
                waiting = [s for s in self.active.values()
                           if s.seq is not None and not s.done and (s.seq.slot < 0 or not s.parsed.stream)]
            for stream in waiting:
                try:
                    stream.check_cancelled()
                except Exception:
                    pass
            if self.control is not None:
                try:
                    self._follow_drain()
                except Exception:
                    pb_utils.Logger.log_error(f"specdec: drain: {traceback.format_exc()}")

    def _follow_drain(self) -> None:
        deadline = control.drain_deadline(self.control)
        if deadline is None:
            self.draining = False
            return
        if not self.draining:
            with self.lock:
                self.draining = True
            pb_utils.Logger.log_info(f"specdec: {self.name} draining: {len(self.active)} requests in flight, "
                                     f"{max(0.0, deadline - time.time()):.1f} s to finish")
        with self.lock:
            left = list(self.active.values())
        if not left:
            if not control.drained(self.control, os.getpid()):
                control.mark_drained(self.control, os.getpid())
                pb_utils.Logger.log_info(f"specdec: {self.name} drained")
        elif time.time() >= deadline:
            for stream in left:
                stream.abort(DRAIN_EXPIRED)

    def _send_loop(self) -> None:
        while True:
            batch = [self.outbox.get()]
            while True:  # take everything that piled up while the last responses were sent
                try:
                    batch.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            groups: dict[Stream, list] = {}
            for item in batch:
                if item is not None:
                    groups.setdefault(item[0], []).append(item[1])
            cpu = time.thread_time()
            for stream, outs in groups.items():
                try:
                    stream.deliver(outs)  # catches its own errors; this is the last line of defence
                except Exception:
                    pb_utils.Logger.log_error(f"specdec: sender: {traceback.format_exc()}")
            alone = sum(1 for outs in groups.values() if len(outs) == 1)
            self.engine.note_responses(time.thread_time() - cpu, sum(map(len, groups.values())), len(groups), alone)
            if None in batch:
                return

    def finalize(self) -> None:
        self.stopping.set()
        self.engine.stop()  # ends queued and running requests: their final Outputs go to the outbox
        self.outbox.put(None)
        self.sender.join(timeout=10)
        self.metrics.stop()
