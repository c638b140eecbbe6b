"""Canary routing on the server: a Triton model that sends a configurable share of its requests to a
speculative model and the rest to the baseline, so both run on the same live traffic and the load
report compares them side by side. Clients keep calling one model name (`canary` by default).

`write_canary_model(repo, ...)` writes `<repo>/<name>/config.pbtxt` (the standard Python backend,
the specdec request/response tensors plus a `served_model` output naming where each request went)
and `1/model.py` (imports `TritonPythonModel` from here). The router is a decoupled Python model
that forwards each request, on a thread of its own, as a streaming gRPC request to the same
server (`grpc_url`, the server's own address; default Triton's localhost:8001), and passes every
response through unchanged (one response held back so the last one carries the final
flag: `/generate` still sees exactly one response). Routing is deterministic: request n goes to the
candidate when floor((n + 1) * share) > floor(n * share), so any window of requests holds the share.

Why gRPC and not BLS: forwarded with `InferenceRequest.exec(decoupled=True)` from threads, the
router's calls deadlocked Triton 2.51's Python stub (`serving/bls.py`): the distributed canary test
failed in 3 of 15 runs, and `async_exec` from a coroutine `execute` in 3 of 9.

    specdec loadtest canary --model-repository model_repository --candidate spec_eagle --share 0.2
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import sys
import threading
from pathlib import Path

from specdec.serving.client import close_stream, grpc_tensors
from specdec.serving.interface import DEFAULT_GRPC_URL

ENTRY = "from specdec.tools.loadtest.canary import TritonPythonModel  # noqa: F401\n"


def routes_to_candidate(n: int, share: float) -> bool:
    return math.floor((n + 1) * share) > math.floor(n * share)


def write_canary_model(repo: str | Path, baseline: str = "baseline", candidate: str = "spec_eagle",
                       share: float = 0.1, name: str = "canary", grpc_url: str = DEFAULT_GRPC_URL) -> Path:
    from specdec.serving.repository import config_pbtxt

    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share}")
    folder = Path(repo) / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    text = config_pbtxt(name, {"baseline": baseline, "candidate": candidate, "share": share, "grpc_url": grpc_url})
    text = text.replace('backend: "specdec"', 'backend: "python"')
    text = text.replace("output [\n", 'output [\n  {\n    name: "served_model"\n    data_type: TYPE_STRING\n'
                                      '    dims: [ 1 ]\n  },\n', 1)
    text = text.replace("# Written by `specdec build-repo`; the parameters configure the specdec engine.",
                        "# Written by `specdec loadtest canary`: routes `share` of the requests to `candidate`.")
    (folder / "config.pbtxt").write_text(text)
    (folder / "1" / "model.py").write_text(ENTRY)
    return folder


class _Stream:
    """A gRPC stream to the server, used by one forward at a time: its callbacks fill `responses`."""

    def __init__(self, url: str) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.responses: queue.SimpleQueue = queue.SimpleQueue()
        self.client.start_stream(callback=lambda result=None, error=None: self.responses.put((result, error)))

    def close(self) -> None:
        close_stream(self.client)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.baseline, self.candidate = params["baseline"], params["candidate"]
        self.share = float(params.get("share", "0"))
        self.url = params.get("grpc_url") or DEFAULT_GRPC_URL
        self.outputs = [o["name"] for o in config["output"] if o["name"] != "served_model"]
        self.count = 0
        self.lock = threading.Lock()
        self.idle: queue.SimpleQueue = queue.SimpleQueue()  # streams no forward is using
        self.family = pb_utils.MetricFamily(name="specdec:canary_requests", description="Requests routed by the canary",
                                            kind=pb_utils.MetricFamily.COUNTER)
        self.counters = {m: self.family.Metric(labels={"model": args["model_name"], "routed_to": m})
                         for m in (self.baseline, self.candidate)}

    def execute(self, requests):
        for request in requests:
            with self.lock:
                n, self.count = self.count, self.count + 1
            target = self.candidate if routes_to_candidate(n, self.share) else self.baseline
            self.counters[target].increment(1)
            threading.Thread(target=self._forward, args=(request, target), daemon=True).start()
        return None

    def _forward(self, request, target: str) -> None:
        pb = self.pb
        sender = request.get_response_sender()
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        stream = None
        try:
            try:
                stream = self.idle.get_nowait()
            except queue.Empty:
                stream = _Stream(self.url)
            inputs = grpc_tensors({t.name(): t.as_numpy() for t in request.inputs()})
            parameters = {k: v for k, v in json.loads(request.parameters() or "{}").items() if not k.startswith("triton_")}
            stream.client.async_stream_infer(target, inputs, parameters=parameters or None, enable_empty_final_response=True)
            held = None
            while True:
                result, error = stream.responses.get()
                if error is not None:
                    raise RuntimeError(f"{target}: {error}")
                arrays = {name: result.as_numpy(name) for name in self.outputs}
                if all(a is not None for a in arrays.values()):  # not the empty final response
                    if held is not None:
                        sender.send(held)
                    held = pb.InferenceResponse(output_tensors=[
                        *(pb.Tensor(name, a) for name, a in arrays.items()), pb.Tensor("served_model", _bytes(target))])
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            self.idle.put(stream)
            stream = None
            if held is None:
                sender.send(flags=final)
            else:
                sender.send(held, flags=final)
        except Exception as exc:  # the client must always get a final response
            if stream is not None:  # in an unknown state: not reused
                stream.close()
            sender.send(pb.InferenceResponse(error=pb.TritonError(f"canary: {exc}")), flags=final)

    def finalize(self) -> None:
        while True:
            try:
                self.idle.get_nowait().close()
            except queue.Empty:
                return


def _bytes(text: str):
    import numpy as np

    return np.array([text.encode()], dtype=np.object_)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specdec loadtest canary", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-repository", default="model_repository")
    ap.add_argument("--baseline", default="baseline")
    ap.add_argument("--candidate", default="spec_eagle")
    ap.add_argument("--share", type=float, default=0.1, help="share of requests for the candidate (0..1)")
    ap.add_argument("--name", default="canary")
    ap.add_argument("--grpc-url", default=DEFAULT_GRPC_URL,
                    help=f"the serving tritonserver's gRPC address, where the router sends its requests (default: {DEFAULT_GRPC_URL})")
    a = ap.parse_args(argv)
    try:
        folder = write_canary_model(a.model_repository, a.baseline, a.candidate, a.share, a.name, a.grpc_url)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {folder}: {a.share:.0%} of requests to {a.candidate}, the rest to {a.baseline}")
    return 0
