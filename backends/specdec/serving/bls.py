"""Triton BLS calls from decoupled Python models that make inner requests on worker threads (the
orchestrator, `rounds.py`): the one place they are made (`BlsCalls.exec`), and what is known of
Triton 2.51's Python stub under them.

- **Calls held after use.** The stub appears to route a call's late responses by the address of
  its request object: under 16 concurrent streams the orchestrator's stub crashed in libpython, a
  target call once yielded its draft call's response, and the canary router's stub died under 2
  streams in a CI run ("Stub process 'canary_0_0' is not healthy"). Holding every request and its
  response iterator for `KEEP` more calls means no address is reused while a response may still
  arrive.
- **Calls from threads can deadlock the stub.** In the canary router (which forwarded each request
  through BLS on a thread of its own), one thread's `exec(decoupled=True)` never returned while
  another waited for its next response, though the inner models had answered both
  (faulthandler's dump of the stub); those and every later request hung. A /tmp script, 2
  closed-loop gRPC streams through the router: 2 stalls in 5074 requests; a lock around `exec`,
  2 in 50140, but `exec` waits for the call's first response, so a lock serializes the inner
  calls (docs/gpu.md); `async_exec` from a coroutine `execute`, 1 in 111670 there, yet it stalled
  in 3 of 9 runs of the distributed canary test. The router now forwards over gRPC
  (`tools/loadtest/canary.py`). The orchestrator's did not here: a /tmp script, 4 closed-loop
  gRPC streams of 16-token requests to `spec_draft` over the CPU contract models, ran 7988
  requests (each a few rounds of a draft and a target call) in 180 s without a stall. Why one
  pattern deadlocks and the other not is not known.

Neither root cause, in python_backend, is confirmed.
"""

from __future__ import annotations

from collections import deque

KEEP = 4096


class BlsCalls:
    """Inner calls of one model (`exec`), the last `keep` of them held so their addresses are not reused."""

    def __init__(self, keep: int = KEEP) -> None:
        self.recent: deque = deque(maxlen=keep)

    def exec(self, request, *also: object):
        """`request.exec(decoupled=True)`'s response iterator; the request, the iterator and `also`
        (what the call's tensors were made from) are held."""
        responses = request.exec(decoupled=True)
        self.recent.append((request, responses, *also))  # appends are atomic: no lock for the threads
        return responses
