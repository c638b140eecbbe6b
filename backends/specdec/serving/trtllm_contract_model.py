"""The Triton model around `trtllm_contract.ContractModel` (`backend: "python"`, decoupled, its
`1/model.py` imports this class). execute() parses and queues each request and returns at once;
one worker thread admits queued requests into KV slots and steps all active ones together (the
in-flight batching of the real backend), sending each request's responses through its sender.
Bad input gets an error naming the input. Counters: `specdec:contract_*` series, labelled by model.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from collections import deque
from pathlib import Path

import torch
import triton_python_backend_utils as pb_utils

from specdec.core.config import DTYPES
from specdec.core.errors import ConfigurationError, SpecdecError
from specdec.core.models.checkpoint import load_model
from specdec.serving.config import resolve_path
from specdec.serving.trtllm_contract import ContractModel, parse_inputs

SETTINGS = {"checkpoint": None, "max_batch": "8", "cache_slots": "", "max_context": "1024", "max_draft_len": "8",
            "tokens_per_block": "8", "dtype": "float32", "device": "cpu", "threads": "1"}
COUNTERS = {  # series -> (CacheStats field, description)
    "specdec:contract_requests": ("requests", "Requests received by a tensorrt_llm-contract model"),
    "specdec:contract_prompt_tokens": ("prompt_tokens", "input_ids tokens received"),
    "specdec:contract_reused_tokens": ("reused_tokens", "input_ids tokens whose KV came from the prefix cache"),
    "specdec:contract_reused_blocks": ("reused_blocks", "KV blocks reused (kv_cache_reused_blocks summed)"),
    "specdec:contract_forward_tokens": ("forward_tokens", "Tokens run through the model"),
    "specdec:contract_compute_seconds": ("seconds", "Seconds in model forwards and token choice"),
}
FLUSH_S = 0.2


def settings(parameters: dict[str, str], model_dir: Path) -> dict[str, object]:
    unknown = sorted(set(parameters) - set(SETTINGS))
    if unknown:
        raise ConfigurationError(f"unknown model parameter {unknown[0]!r}; known: {', '.join(SETTINGS)}")
    raw = {**SETTINGS, **{k: v.strip() for k, v in parameters.items()}}
    if not raw["checkpoint"]:
        raise ConfigurationError("model parameter 'checkpoint' (the model's Hugging Face folder) is required")
    if raw["dtype"] not in DTYPES:
        raise ConfigurationError(f"dtype must be one of {', '.join(DTYPES)}, got {raw['dtype']!r}")
    try:
        ints = {k: int(raw[k]) for k in ("max_batch", "max_context", "max_draft_len", "tokens_per_block", "threads")}
        ints["cache_slots"] = int(raw["cache_slots"]) if raw["cache_slots"] else None
    except ValueError as exc:
        raise ConfigurationError(f"a numeric model parameter is not an integer ({exc})") from None
    return {**ints, "checkpoint": resolve_path(raw["checkpoint"], model_dir), "dtype": raw["dtype"], "device": raw["device"]}


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        self.name = args["model_name"]
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ConfigurationError(f"{self.name}: needs model_transaction_policy {{ decoupled: true }} (streaming)")
        parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        s = settings(parameters, Path(args["model_repository"]))
        if str(s["device"]).startswith("cpu"):
            torch.set_num_threads(s["threads"])
        model = load_model(s["checkpoint"], getattr(torch, s["dtype"]), s["device"])
        self.core = ContractModel(model, s["max_batch"], s["cache_slots"], s["max_context"], s["max_draft_len"],
                                  s["tokens_per_block"])
        self.families = {name: pb_utils.MetricFamily(name=name, description=desc, kind=pb_utils.MetricFamily.COUNTER)
                         for name, (_, desc) in COUNTERS.items()}
        self.counters = {name: f.Metric(labels={"model": self.name}) for name, f in self.families.items()}
        self.flushed = {name: 0 for name in COUNTERS}
        self.waiting: deque = deque()
        self.senders: dict[int, tuple] = {}  # id(Active) -> (request, sender)
        self.cv = threading.Condition()
        self.stopping = False
        self.worker = threading.Thread(target=self._loop, name=f"{self.name}-contract", daemon=True)
        self.worker.start()
        pb_utils.Logger.log_info(f"{self.name}: tensorrt_llm-contract model ready ({s})")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                req = parse_inputs({t.name(): t.as_numpy() for t in request.inputs()})
                self.core.check(req)
            except SpecdecError as exc:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{self.name}: {exc}")),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            with self.cv:
                self.waiting.append((req, request, sender))
                self.cv.notify()
        return None

    def _loop(self) -> None:
        last_flush = time.monotonic()
        while True:
            with self.cv:  # no IPC under this lock: execute() (the stub's main thread) waits on it
                if not self.stopping and not self.waiting and not self.core.active:
                    self.cv.wait(FLUSH_S)
                if self.stopping:
                    break
                idle = not self.waiting and not self.core.active
                while self.waiting and self.core.can_admit():
                    req, request, sender = self.waiting.popleft()
                    self.senders[id(self.core.admit(req))] = (request, sender)
            if idle:
                self._flush()
                last_flush = time.monotonic()
                continue
            try:
                replies = self.core.step()
            except Exception as exc:
                pb_utils.Logger.log_error(f"{self.name}: step failed:\n{traceback.format_exc()}")
                for act in list(self.core.active):
                    act.done = True
                    self._send_error(act, f"{self.name}: internal error: {exc!r}")
                    self.core._release(act)
                continue
            for act, reply in replies:
                self._send(act, reply)
            for act in self.core.active:  # a streaming client that went away stops its request
                if act.req.streaming and not act.done and self.senders[id(act)][0].is_cancelled():
                    act.cancelled = True
            if time.monotonic() - last_flush > FLUSH_S:
                self._flush()
                last_flush = time.monotonic()
        for act in list(self.core.active):
            self._send_error(act, f"{self.name}: the server is shutting down")
        for _, _, sender in self.waiting:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{self.name}: shutting down")),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _send(self, act, reply) -> None:
        _, sender = self.senders.pop(id(act)) if reply.final else self.senders[id(act)]
        tensors = [pb_utils.Tensor(name, value) for name, value in reply.tensors().items()]
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if reply.final else 0)
        except Exception:
            pb_utils.Logger.log_error(f"{self.name}: sending failed:\n{traceback.format_exc()}")
            act.cancelled = True

    def _send_error(self, act, message: str) -> None:
        entry = self.senders.pop(id(act), None)
        if entry is not None:
            entry[1].send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
                          flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _flush(self) -> None:
        try:
            for name, (attr, _) in COUNTERS.items():
                value = getattr(self.core.stats, attr)
                if value > self.flushed[name]:
                    self.counters[name].increment(value - self.flushed[name])
                    self.flushed[name] = value
        except Exception as exc:  # metrics never take the model down
            pb_utils.Logger.log_warn(f"{self.name}: metrics flush failed: {exc!r}")

    def finalize(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify()
        self.worker.join(timeout=10)
        self._flush()

