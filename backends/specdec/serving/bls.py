"""Keeping Triton BLS calls alive after use, for decoupled Python models that make inner requests.

Triton 2.51's Python stub appears to route a BLS call's late responses by the address of its
request object. Under 16 concurrent streams the orchestrator's stub (`rounds.py`) crashed in
libpython, and a target call once yielded its draft call's response; the canary router's stub
died under 2 streams in a CI run ("Stub process 'canary_0_0' is not healthy"). Holding every
request and its response iterator for `KEEP` more calls means no address is reused while a
response may still arrive. The root cause is in python_backend and not confirmed; this is a
workaround, kept in one place.
"""

from __future__ import annotations

from collections import deque

KEEP = 4096


class KeepAlive:
    """The last `keep` BLS calls' objects, held so their addresses are not reused."""

    def __init__(self, keep: int = KEEP) -> None:
        self.recent: deque = deque(maxlen=keep)

    def hold(self, *objects: object) -> None:
        self.recent.append(objects)  # appends are atomic: no lock for the stub's worker threads
