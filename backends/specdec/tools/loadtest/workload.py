"""Workloads: which prompts, how many output tokens, which sampling settings.

A workload is one (prompt band, output band, sampling) combination. Prompts come from a file:
held-out standard-library code (`specdec.tools.prompts.heldout_prompts`, never trained on) written to
JSONL by the matrix, or the user's own JSONL (`{"prompt": ...}` per line). Every model and load
level of a matrix sees the same prompt file and the same settings; only the model and the
number of concurrent users change.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

OUTPUT_BANDS = {"short": 32, "long": 128}  # max_tokens per request, on average (`OUTPUT_SPREAD`)
OUTPUT_SPREAD = 0.25  # request i asks for max_tokens x uniform(1 - spread, 1 + spread) tokens (`request_tokens`).
# Closed-loop users whose requests all ask the same length run in lockstep on an engine that
# decodes them together: they finish in the same step and send their next requests at once, so a
# baseline at 4 users prefilled 2-4 prompts a call (TTFT p50 16-24 ms) and then decoded without
# interruption, while a speculative engine, whose rows finish at different steps, prefilled one at
# a time (11-12 ms) between the others' decode steps: served, prompt lookup read TPOT 1.13x-1.33x
# and TTFT 0.72x-0.74x the baseline's, an artefact of the arrivals. Spread +-25%, both prefilled
# one prompt a call (TTFT 8-9 ms each) and the TPOT ratio read 1.04x-1.08x (in-process, 4 client
# threads; docs/loadtest.md). 0: every request asks exactly max_tokens (lockstep as before).
SAMPLING = {  # name -> (temperature, top_p)
    "greedy": (0.0, 1.0),
    "t0.7": (0.7, 1.0),
    "t1.0": (1.0, 1.0),
}
PROMPT_BANDS = ("short", "long")


@dataclass(frozen=True)
class Workload:
    prompt_band: str = "short"
    output_band: str = "short"
    sampling: str = "greedy"
    max_tokens: int | None = None  # overrides the output band's token count
    prompts_file: str | None = None  # a user's JSONL replaces the held-out prompts
    max_tokens_spread: float = OUTPUT_SPREAD  # each request's share of it, drawn per request

    def __post_init__(self) -> None:
        if self.prompts_file is None and self.prompt_band not in PROMPT_BANDS:
            raise ValueError(f"unknown prompt band {self.prompt_band!r}; choose from {', '.join(PROMPT_BANDS)}")
        if self.max_tokens is None and self.output_band not in OUTPUT_BANDS:
            raise ValueError(f"unknown output band {self.output_band!r}; choose from {', '.join(OUTPUT_BANDS)}")
        if self.sampling not in SAMPLING:
            raise ValueError(f"unknown sampling {self.sampling!r}; choose from {', '.join(SAMPLING)}")
        check_spread(self.max_tokens_spread)

    @property
    def name(self) -> str:
        prompts = Path(self.prompts_file).stem if self.prompts_file else f"{self.prompt_band}-prompt"
        return f"{prompts}/{self.output_band}-output/{self.sampling}"

    @property
    def tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else OUTPUT_BANDS[self.output_band]

    @property
    def temperature(self) -> float:
        return SAMPLING[self.sampling][0]

    @property
    def top_p(self) -> float:
        return SAMPLING[self.sampling][1]

    def to_dict(self) -> dict:
        return {**asdict(self), "name": self.name, "max_tokens": self.tokens, "temperature": self.temperature,
                "top_p": self.top_p}


def workloads(prompt_bands: list[str], output_bands: list[str], samplings: list[str], max_tokens: int | None = None,
              prompts_file: str | None = None, max_tokens_spread: float = OUTPUT_SPREAD) -> list[Workload]:
    """The grid of workloads (a prompts file stands for every prompt band)."""
    bands = ["file"] if prompts_file else prompt_bands
    return [Workload(p, o, s, max_tokens, prompts_file, max_tokens_spread)
            for p in bands for o in output_bands for s in samplings]


def check_spread(spread: float) -> None:
    """A max_tokens spread must lie in [0, 1): at 1 a request could ask for no tokens."""
    if not 0.0 <= spread < 1.0:  # (NaN fails too)
        raise ValueError(f"max_tokens spread must be in [0, 1), got {spread!r}")


def request_tokens(max_tokens: int, spread: float, index: int) -> int:
    """The tokens request `index` asks for: max_tokens x uniform(1 - spread, 1 + spread), drawn
    from the index alone, as its prompt is (`index % prompts`): request i asks the same of
    whichever model serves it; at least 1 (`OUTPUT_SPREAD`)."""
    if not spread:
        return max_tokens
    return max(1, round(max_tokens * random.Random(index).uniform(1.0 - spread, 1.0 + spread)))


def write_prompts(path: str | Path, prompts: list[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def prompts_for(workload: Workload, n: int, seed: int = 0) -> list[str]:
    """The prompts a workload sends, in order (the users cycle through them)."""
    from specdec.tools.prompts import heldout_prompts, load_jsonl

    if workload.prompts_file:
        prompts = load_jsonl(workload.prompts_file)
        if not prompts:
            raise ValueError(f"{workload.prompts_file}: no prompts")
        return prompts
    return heldout_prompts(n, workload.prompt_band, seed)
