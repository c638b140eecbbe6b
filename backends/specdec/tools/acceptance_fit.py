"""How well the adaptive policy's acceptance estimates predict the next round (a developer's check).

    python -m specdec.tools.acceptance_fit --method ngram --batch 8 --prompts 16 --decays 0.95,0.8,0.7,0.6

The policy picks k and the drafting rows from each sequence's estimated acceptances (alpha of a
draft's first token, beta of each later one; `core.policy`): an estimate that runs low makes it
draft too little. This runs the engine at a fixed k (greedy, so the rounds do not depend on the
policy), records every sequence's rounds, and replays them through the policy's own estimator at
each per-round decay of `--decays`: before each drafted round, the tokens the estimate expects it
to accept against what it accepted. It prints their means (the bias), the root mean square error,
and the same for the engine-wide estimate (what a sequence would be predicted without its own).
The replay uses `Policy.observe_round`, the code the engine runs, with the decay set per run.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from specdec.core.errors import ConfigurationError
from specdec.core.policy import DECAY, Policy, StepRecord, expected_tokens
from specdec.core.sequence import Sequence

Round = tuple[Sequence, int, int, int]  # (sequence, its slot then, depth drafted, accepted)


@dataclass
class Fit:
    """Predicted against accepted draft tokens over the drafted rounds of one replay."""

    decay: float
    rounds: int
    accepted: float  # mean accepted draft tokens per drafted round
    predicted: float  # mean the sequence's own estimate expected
    rmse: float
    engine_predicted: float  # mean the engine-wide estimate expected
    engine_rmse: float

    @property
    def bias(self) -> float:
        return self.relative(self.predicted)

    @property
    def engine_bias(self) -> float:
        return self.relative(self.engine_predicted)

    def relative(self, predicted: float) -> float:
        """How far a mean prediction lies from the mean accepted, as a fraction of it."""
        return predicted / self.accepted - 1.0 if self.accepted else 0.0


def record_rounds(method: str, batch: int, prompts: int, k: int, max_tokens: int) -> tuple[list[list[Round]], int]:
    """Every decode step's rounds of a fixed-k engine over `prompts` held-out prompts, `batch` at
    a time; and the engine's max_k (the replay's policy must have the same candidates)."""
    from specdec.core.config import EngineConfig
    from specdec.core.engine_config import build_engine
    from specdec.core.sampling import SamplingParams
    from specdec.paths import DEMO_KIT
    from specdec.tools.bench import kit_paths
    from specdec.tools.prompts import heldout_prompts

    engine = build_engine(EngineConfig.of(**kit_paths(DEMO_KIT), method=method, max_batch=batch, policy="fixed", k=k))
    steps: list[list[Round]] = []
    observe = engine.policy.observe

    def record(step: StepRecord) -> None:
        # a sequence that finished in this step has left its slot (-1): the policy learns nothing from it
        steps.append([(s, s.slot, d, a) for s, d, a in zip(step.seqs, step.depths, step.accepted) if s.slot >= 0])
        observe(step)

    engine.policy.observe = record
    texts = heldout_prompts(prompts)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(0, len(texts), batch):
        engine.generate(texts[i:i + batch], params)
    return steps, engine.policy.max_k


def replay(steps: list[list[Round]], max_k: int, decay: float = DECAY) -> Fit:
    """The recorded rounds through a fresh policy's estimator at `decay`, each drafted round
    predicted from the estimates before it."""
    policy = Policy(max_k, True, lambda k: k)
    seen: set[int] = set()
    n = accepted = predicted = se = engine_predicted = engine_se = 0.0
    for rounds in steps:
        for seq, slot, depth, got in rounds:
            if id(seq) not in seen:  # a newcomer, at the slot it held (a finished one's is -1)
                seen.add(id(seq))
                policy.admit(replace(seq, slot=slot))
            if depth > 0:
                state = policy.slots[slot]
                own = expected_tokens(state.acceptance, depth, state.later) - 1.0
                wide = expected_tokens(policy.alpha, depth, policy.beta) - 1.0
                n += 1
                accepted += got
                predicted += own
                engine_predicted += wide
                se += (own - got) ** 2
                engine_se += (wide - got) ** 2
        for _, slot, depth, got in rounds:
            policy.observe_round(policy.slots[slot], depth, got, decay)
    if not n:
        return Fit(decay, 0, 0.0, 0.0, 0.0, 0.0, 0.0)
    return Fit(decay, int(n), accepted / n, predicted / n, (se / n) ** 0.5, engine_predicted / n, (engine_se / n) ** 0.5)


def decays_of(text: str) -> list[float]:
    """`--decays`: comma-separated decays in (0, 1], largest first; anything else is refused by name."""
    try:
        decays = sorted({float(d) for d in text.split(",")}, reverse=True)
    except ValueError:
        raise SystemExit(f"--decays must be numbers separated by commas, got {text!r}") from None
    if any(not 0.0 < d <= 1.0 for d in decays):
        raise SystemExit(f"--decays must lie in (0, 1], got {text!r}")
    return decays


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="ngram", help="a speculative method of the demo kit (default ngram)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("-k", type=int, default=4, help="the fixed draft length the rounds are recorded at")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--decays", default=f"{DECAY},0.95,0.8,0.6",
                    help=f"per-round decays of a sequence's counts to replay (the policy's: {DECAY})")
    args = ap.parse_args(argv)
    decays = decays_of(args.decays)
    for name in ("batch", "prompts", "max_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    try:
        steps, max_k = record_rounds(args.method, args.batch, args.prompts, args.k, args.max_tokens)
    except ConfigurationError as e:  # an unknown method, a negative k: named by the engine's check
        raise SystemExit(f"acceptance_fit: {e}") from None
    print(f"{args.method}, batch {args.batch}, k = {args.k}, {args.prompts} prompts x {args.max_tokens} tokens; "
          "accepted draft tokens per drafted round, predicted before it")
    print("| decay | rounds | accepted | predicted (bias) | rmse | engine-wide predicted (bias) | rmse |")
    print("|---|---|---|---|---|---|---|")
    for decay in decays:
        f = replay(steps, max_k, decay)
        mark = " (the policy's)" if decay == DECAY else ""
        print(f"| {decay:g}{mark} | {f.rounds} | {f.accepted:.3f} | {f.predicted:.3f} ({100 * f.bias:+.1f}%) | {f.rmse:.3f} "
              f"| {f.engine_predicted:.3f} ({100 * f.engine_bias:+.1f}%) | {f.engine_rmse:.3f} |")


if __name__ == "__main__":
    main()
