"""Triton BLS calls from decoupled Python models that make inner requests: the one place they are
made (`BlsCalls`), with two workarounds for Triton 2.51's Python stub.

- **The canary router calls `async_exec` from a coroutine `execute`.** It forwarded each request
  on a thread of its own: every few thousand requests at 2 streams, one thread's
  `exec(decoupled=True)` never returned while another waited for its next response, though the
  inner models had answered both (faulthandler's dump of the stub), and both clients' requests
  hung for good (the distributed canary test failed in 3 of 15 runs). A /tmp script, 2
  closed-loop gRPC streams through the canary: 2 stalls in 5074 requests with threads, 1 in
  111670 with `async_exec` on the stub's event loop, its responses read on worker threads. A lock
  around the threads' `exec` read 2 in 50140, but `exec` waits for the call's first response, so
  a lock serializes the inner calls (it once held the orchestrator at concurrency 8 below its
  concurrency 1, docs/gpu.md): not kept. Reduced, not gone. The orchestrator
  (`rounds.py`) still calls `exec` from its worker threads: the same risk, not changed.
- **Calls held after use.** The stub appears to route a call's late responses by the address of
  its request object: under 16 concurrent streams the orchestrator's stub crashed in libpython, a
  target call once yielded its draft call's response, and the canary router's stub died under 2
  streams in a CI run ("Stub process 'canary_0_0' is not healthy"). Holding every request and its
  response iterator for `KEEP` more calls means no address is reused while a response may still
  arrive.

The root causes are in python_backend and not confirmed; these are workarounds.
"""

from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import ThreadPoolExecutor

KEEP = 4096
READERS = 64  # threads reading `async_exec` responses: one waits on each stream in flight


class BlsCalls:
    """Inner calls of one model, the last `keep` of them held so their addresses are not reused."""

    def __init__(self, keep: int = KEEP) -> None:
        self.recent: deque = deque(maxlen=keep)
        self.readers: ThreadPoolExecutor | None = None  # made on the first `async_exec`

    def exec(self, request, *also: object):
        """`request.exec(decoupled=True)`'s response iterator; the request, the iterator and `also`
        (what the call's tensors were made from) are held."""
        responses = request.exec(decoupled=True)
        self.recent.append((request, responses, *also))  # appends are atomic: no lock for the threads
        return responses

    async def async_exec(self, request, *also: object):
        """The responses of `await request.async_exec(decoupled=True)`, each read on a worker thread
        (the iterator's `next` blocks until the response comes, and would block the event loop)."""
        responses = await request.async_exec(decoupled=True)
        self.recent.append((request, responses, *also))
        self.readers = self.readers or ThreadPoolExecutor(READERS, thread_name_prefix="bls-reader")
        loop, it = asyncio.get_running_loop(), iter(responses)
        while (response := await loop.run_in_executor(self.readers, next, it, None)) is not None:
            yield response
