"""Canary routing on the server: a Triton model that sends a configurable share of its requests to a
speculative model and the rest to the baseline, so both run on the same live traffic and the load
report compares them side by side. Clients keep calling one model name (`canary` by default).

`write_canary_model(repo, ...)` writes `<repo>/<name>/config.pbtxt` (the standard Python backend,
the specdec request/response tensors plus a `served_model` output naming where each request went)
and `1/model.py` (imports `TritonPythonModel` from here). The router is a decoupled BLS model with a
coroutine `execute`: each request is forwarded with `await InferenceRequest(...).async_exec(decoupled=True)`
on the stub's event loop, its responses read on worker threads (`serving.bls`), and every
response is passed through unchanged (one response held back so the last one carries the final
flag: `/generate` still sees exactly one response). Routing is deterministic: request n goes to the
candidate when floor((n + 1) * share) > floor(n * share), so any window of requests holds the share.

    specdec loadtest canary --model-repository model_repository --candidate spec_eagle --share 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

from specdec.serving.bls import BlsCalls

ENTRY = "from specdec.tools.loadtest.canary import TritonPythonModel  # noqa: F401\n"


def routes_to_candidate(n: int, share: float) -> bool:
    return math.floor((n + 1) * share) > math.floor(n * share)


def write_canary_model(repo: str | Path, baseline: str = "baseline", candidate: str = "spec_eagle",
                       share: float = 0.1, name: str = "canary") -> Path:
    from specdec.serving.repository import config_pbtxt

    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share}")
    folder = Path(repo) / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    text = config_pbtxt(name, {"baseline": baseline, "candidate": candidate, "share": share})
    text = text.replace('backend: "specdec"', 'backend: "python"')
    text = text.replace("output [\n", 'output [\n  {\n    name: "served_model"\n    data_type: TYPE_STRING\n'
                                      '    dims: [ 1 ]\n  },\n', 1)
    text = text.replace("# Written by `specdec build-repo`; the parameters configure the specdec engine.",
                        "# Written by `specdec loadtest canary`: routes `share` of the requests to `candidate`.")
    (folder / "config.pbtxt").write_text(text)
    (folder / "1" / "model.py").write_text(ENTRY)
    return folder


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.baseline, self.candidate = params["baseline"], params["candidate"]
        self.share = float(params.get("share", "0"))
        self.outputs = [o["name"] for o in config["output"] if o["name"] != "served_model"]
        self.count = 0  # requests routed (`execute` runs on the stub's one event loop)
        self.calls = BlsCalls()  # (specdec.serving.bls: why async, why calls are held after use)
        self.family = pb_utils.MetricFamily(name="specdec:canary_requests", description="Requests routed by the canary",
                                            kind=pb_utils.MetricFamily.COUNTER)
        self.counters = {m: self.family.Metric(labels={"model": args["model_name"], "routed_to": m})
                         for m in (self.baseline, self.candidate)}

    async def execute(self, requests):
        """Route and forward each request; Triton runs a decoupled model's coroutine in the
        background, so the next requests come in while these stream."""
        forwards = []
        for request in requests:
            n, self.count = self.count, self.count + 1
            target = self.candidate if routes_to_candidate(n, self.share) else self.baseline
            self.counters[target].increment(1)
            forwards.append(self._forward(request, target))
        await asyncio.gather(*forwards)
        return None

    async def _forward(self, request, target: str) -> None:
        pb = self.pb
        sender = request.get_response_sender()
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            inner = pb.InferenceRequest(model_name=target, inputs=request.inputs(),
                                        requested_output_names=self.outputs,
                                        parameters=json.loads(request.parameters() or "{}"))
            held = None
            async for response in self.calls.async_exec(inner):
                if response.has_error():
                    sender.send(pb.InferenceResponse(error=pb.TritonError(response.error().message())), flags=final)
                    return
                # copies: the held response outlives the inner one, whose tensors live in its own
                # shared memory (held as they were, a client once got a tensor whose shape and data
                # did not match: "cannot reshape array of size 1 into shape (0,)")
                tensors = [pb.Tensor(t.name(), t.as_numpy().copy()) for t in response.output_tensors()]
                if not tensors:  # the inner model's empty final response
                    continue
                if held is not None:
                    sender.send(held)
                held = pb.InferenceResponse(output_tensors=[
                    *tensors, pb.Tensor("served_model", _bytes(target))])
            if held is None:
                sender.send(flags=final)
            else:
                sender.send(held, flags=final)
        except Exception as exc:  # the client must always get a final response
            sender.send(pb.InferenceResponse(error=pb.TritonError(f"canary: {exc!r}")), flags=final)

    def finalize(self) -> None:
        pass


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
    a = ap.parse_args(argv)
    try:
        folder = write_canary_model(a.model_repository, a.baseline, a.candidate, a.share, a.name)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {folder}: {a.share:.0%} of requests to {a.candidate}, the rest to {a.baseline}")
    return 0
