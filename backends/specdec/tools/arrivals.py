"""Requests arriving as others finish: a closed loop of `in_flight` users, in one process.

`Engine.generate` admits every prompt at once and its batch only shrinks; served, users' requests
come and go, the batch changes every few steps, and every change makes the adaptive policy search
again (a paused engine's bookkeeping, a newcomer's catch-up). `specdec bench --in-flight` and
`tools.forward_ab --in-flight` time engines under that churn. It drives an engine through
`submit` and `step` alone, so `forward_ab` drives an earlier commit's engine with it too.
"""

from __future__ import annotations

from dataclasses import replace

from specdec.core.engine import Result

ARRIVALS = 48  # requests of a run with requests in flight, at least: the prompts repeated


def repeated(prompts: list, at_least: int = ARRIVALS) -> list:
    """The prompts over and over, at least `at_least` of them: each user of the loop sends several."""
    return prompts * -(-at_least // len(prompts))


def staggered(params, in_flight: int, requests: int) -> list:
    """Each request's sampling parameters: the first `in_flight` stop after (i + 1) / in_flight of
    max_tokens, the rest after all of it. Requests of one length, started together, finish
    together (with ignore_eos, the baseline's in one step), and a closed loop of them is a
    batch admitted in cohorts; staggered, from the start one request finishes every
    max_tokens / in_flight steps or so, as a served closed loop's users' do."""
    return [replace(params, max_tokens=max(1, params.max_tokens * (i + 1) // in_flight)) if i < in_flight else params
            for i in range(requests)]


def arrivals(engine, params, prompts: list[str | list[int]], in_flight: int) -> list[Result]:
    """Run prompts with `in_flight` of them in flight, each finished one submitting the next,
    their lengths `staggered`; returns each prompt's Result, in order."""
    results = [Result() for _ in prompts]
    plist = staggered(params, in_flight, len(prompts))
    waiting = iter(range(len(prompts)))

    def submit() -> None:
        i = next(waiting, None)
        if i is not None:
            engine.submit(prompts[i], plist[i], lambda out, i=i: collect(i, out))

    def collect(i: int, out) -> None:
        results[i].add(out)
        if out.finished:
            submit()

    for _ in range(in_flight):
        submit()
    while engine.has_work():
        engine.step()
    return results
