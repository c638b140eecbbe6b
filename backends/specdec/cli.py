"""The `specdec` command: generate, bench, build-kit, and (from the serving and load-test modules)
serve, build-repo, client, loadtest, demo."""

from __future__ import annotations

import argparse
import importlib
import sys

from specdec.core.config import PATH_KEYS, SETTINGS, EngineConfig, add_arguments, given
from specdec.paths import DEMO_KIT


# subcommands implemented elsewhere: name -> "module:function" taking argv
DELEGATED = {
    "build-kit": "specdec.tools.kit.cli:main",
    "serve": "specdec.serving.server:main",
    "build-repo": "specdec.serving.repository:main",
    "client": "specdec.serving.client:main",
    "serve-bench": "specdec.tools.serve_bench:main",
    "loadtest": "specdec.tools.loadtest.matrix:main",
    "demo": "specdec.tools.demo:main",
}


# engine settings the commands take as flags (method and max_batch each command sets itself)
ENGINE_FLAGS = [k for k in SETTINGS if k not in ("method", "max_batch", "queue_timeout_s", *PATH_KEYS)]


def engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kit", default=str(DEMO_KIT), help="folder with target/ draft/ medusa/ eagle/ (default: demo kit)")
    add_arguments(p, list(PATH_KEYS), given_only=True)
    add_arguments(p, ENGINE_FLAGS)


def engine_config(a: argparse.Namespace, method: str, max_batch: int) -> EngineConfig:
    from specdec.tools.bench import kit_paths

    paths = {**(kit_paths(a.kit) if a.kit else {}), **given(a, list(PATH_KEYS))}
    if "target" not in paths:
        sys.exit(f"specdec: no target checkpoint: {a.kit}/target does not exist and --target was not given")
    return EngineConfig.of(method=method, max_batch=max_batch, **paths, **given(a, ENGINE_FLAGS))


def cmd_generate(a: argparse.Namespace) -> int:
    from specdec.core.engine_config import build_engine
    from specdec.core.sampling import SamplingParams

    engine = build_engine(engine_config(a, a.method, 1))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed, stop=a.stop or [])

    def show(out):
        sys.stdout.write(out.text)
        sys.stdout.flush()

    prompt = a.prompt if a.prompt is not None else sys.stdin.read()
    sys.stdout.write(prompt)
    outputs = []
    engine.submit(prompt, params, lambda out: (show(out), outputs.append(out)))
    while engine.has_work():
        engine.step()
    last = outputs[-1]
    st = last.stats
    elapsed = st.finished - st.arrival
    print(f"\n\n[{a.method}] {st.output_tokens} tokens in {elapsed:.2f} s ({st.output_tokens / elapsed:.1f} tok/s), "
          f"TTFT {1000 * (st.first_token - st.arrival):.0f} ms, finish: {last.finish_reason}")
    if st.draft_tokens:
        pos = " ".join(f"{x / st.drafts:.2f}" for x in st.accepted_per_position)
        print(f"acceptance rate {st.acceptance_rate:.2f}, mean accepted length {st.mean_accepted_length:.2f}, "
              f"accepted per position {pos}")
    return 0 if last.error is None else 1


def counts(flag: str, text: str | None) -> list[int]:
    """A flag's comma-separated whole numbers, each at least 1 (none given: [])."""
    if not text:
        return []
    try:
        values = [int(b) for b in text.split(",")]
    except ValueError:
        sys.exit(f"specdec bench: {flag} must be whole numbers separated by commas, got {text!r}")
    if min(values) < 1:
        sys.exit(f"specdec bench: {flag} must be at least 1, got {text!r}")
    return values


def cmd_bench(a: argparse.Namespace) -> int:
    from specdec.tools.bench import (available_methods, bench, peer_table, profile_table, table,
                                      write_json)
    from specdec.tools.prompts import heldout_prompts, load_jsonl

    cfg = engine_config(a, "baseline", 1)
    methods = a.methods.split(",") if a.methods else available_methods(
        {k: v for k, v in vars(cfg.checkpoints).items() if v})
    if "baseline" not in methods:
        methods.insert(0, "baseline")
    prompts = load_jsonl(a.prompts_file)[: a.prompts] if a.prompts_file else heldout_prompts(a.prompts, a.band, a.seed)
    sizes = counts("--batch-sizes", a.batch_sizes if a.batch_sizes is not None or a.in_flight else "1,8")
    in_flight = counts("--in-flight", a.in_flight)
    if not sizes and not in_flight:
        sys.exit("specdec bench: nothing to run: give --batch-sizes, --in-flight or both")
    try:
        policies = [SETTINGS["policy"].from_text(p) for p in a.policies.split(",")] if a.policies else [cfg.scheduler.policy]
    except ValueError as e:
        sys.exit(f"specdec bench: --policies: {e}")
    print(f"bench: {len(prompts)} {a.band} held-out code prompts, {a.max_tokens} greedy tokens each, "
          f"batch sizes {sizes}{f', {in_flight} in flight' if in_flight else ''}, k={cfg.proposer.k} ({', '.join(policies)}), {a.repeats} interleaved repeats, "
          f"{cfg.runtime.device} {cfg.runtime.dtype}")
    figures = bench(cfg, methods, prompts, sizes, a.max_tokens, a.repeats, peer=a.peer, policies=policies,
                    aa=a.aa, seed=a.seed, in_flight=in_flight)
    print(table(figures))
    if a.peer:
        print(f"\n{a.peer} peer, interleaved with specdec (same checkpoints, prompt ids, k):")
        print(peer_table(figures))
    if a.profile:
        print("\nwhere a decode step's time goes (ms per step, share of the step):")
        print(profile_table(figures))
    if a.json:
        setup = {k: SETTINGS[k].to_text(v) if isinstance(v, tuple) else v  # trees in their flag form
                 for k, v in vars(a).items() if k != "func"}
        write_json(figures, a.json, setup)
        print(f"wrote {a.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED:
        module, func = DELEGATED[argv[0]].split(":")
        return getattr(importlib.import_module(module), func)(argv[1:]) or 0
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name in DELEGATED:
        sub.add_parser(name, help=f"see `specdec {name} --help`", add_help=False)

    g = sub.add_parser("generate", help="run one prompt in-process with any method, print text and stats")
    engine_args(g)
    g.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    g.add_argument("--method", default="eagle", help="baseline, draft, medusa, eagle, eagle2, ngram")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="baseline vs every method side by side: tok/s, speedup, acceptance")
    engine_args(b)
    b.add_argument("--methods", help="comma-separated (default: every method the kit supports)")
    b.add_argument("--batch-sizes", help="comma-separated, each a batch of that many prompts admitted at once "
                   "(default: 1,8, or none with --in-flight)")
    b.add_argument("--in-flight", help="comma-separated: also keep this many requests in flight, each finished "
                   "one submitting the next (the prompts repeated, the first ones' lengths staggered: "
                   "specdec.tools.arrivals): the batch changes as a served engine's does")
    b.add_argument("--prompts", type=int, default=8)
    b.add_argument("--prompts-file", help="JSONL with a \"prompt\" per line (default: held-out stdlib code)")
    b.add_argument("--band", default="short", choices=["short", "long"])
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--seed", type=int, default=0, help="the held-out prompts drawn and the order of each repeat's runs")
    b.add_argument("--json", help="also write the figures to this JSON file")
    b.add_argument("--profile", action="store_true", help="also split a decode step's time by phase, per method")
    b.add_argument("--policies", help="comma-separated draft-length policies (fixed,adaptive): every method runs "
                   "under each, interleaved in the same repeats (overrides --policy)")
    b.add_argument("--aa", action="store_true", help="also run a second baseline engine (baseline_aa) as a method: "
                   "an A/A pair showing what two identical engines differ by in this run")
    b.add_argument("--peer", choices=["hf"], help="also run HF transformers' plain, assisted and prompt-lookup "
                   "generation on the same checkpoints, interleaved, and print the ratios")
    b.set_defaults(func=cmd_bench)

    a = parser.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
