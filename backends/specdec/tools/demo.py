"""`specdec demo` (`make demo`): the whole stack in one command, stage by stage.

1 check       tritonserver binary, Python backend stub, Locust
2 kit         the shipped demo kit (build/demo-kit); without it, the tiny kit is trained (~2 min)
3 repository  one Triton model per method (baseline, spec_draft, spec_medusa, spec_eagle, spec_ngram),
              and baseline_aa: the baseline under a second name, for the A/A self-check
4 serve       tritonserver on free ports, every model loaded
5 stream      one completion from each model, printed as the tokens arrive, with acceptance stats
6 load        a short load matrix (Locust): at each concurrency level the models take turns in short
              trials, round after round, so the machine's slow moments hit every model alike
7 verdict     guardrails on the ratios' confidence intervals -> keep / keep below N / roll back /
              inconclusive per method, the A/A check and the machine's foreign load; report + plots
8 stop        the server is stopped (also when a stage fails)

Exit code 0 only if every stage worked.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

from specdec.paths import CACHE, DEMO_KIT, GUARDRAILS, REPORTS

KIT_PARTS = ("target", "draft", "medusa", "eagle")
STAGES = ["check", "kit", "repository", "serve", "stream", "load", "verdict", "stop"]
DEMO_PROMPT = "def binary_search(items, target):\n"


class Progress:
    """Stage-by-stage progress on the terminal: `[3/8] repository ... ok (0.1 s)`."""

    def __init__(self, out=sys.stdout) -> None:
        self.out, self.t0, self.stage, self.started = out, time.monotonic(), None, 0.0
        self.tty = out.isatty()
        self.results: list[tuple[str, str, float]] = []

    def _c(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.tty else text

    def begin(self, name: str, what: str) -> None:
        self.stage, self.started = name, time.monotonic()
        i = STAGES.index(name) + 1
        self.out.write(self._c(f"\n[{i}/{len(STAGES)}] {name}: {what}", "1;36") + "\n")
        self.out.flush()

    def note(self, text: str) -> None:
        self.out.write(f"      {text}\n")
        self.out.flush()

    def end(self, ok: bool = True, text: str = "") -> None:
        took = time.monotonic() - self.started
        mark = self._c("ok", "32") if ok else self._c("FAILED", "1;31")
        self.out.write(f"      {mark} ({took:.1f} s){' - ' + text if text else ''}\n")
        self.out.flush()
        self.results.append((self.stage, "ok" if ok else "failed", took))

    def summary(self) -> None:
        total = time.monotonic() - self.t0
        self.out.write(self._c("\nstages: ", "1") + "  ".join(
            f"{n} {self._c(s, '32' if s == 'ok' else '1;31')}" for n, s, _ in self.results) + f"   ({total:.0f} s)\n")
        self.out.flush()


def find_kit(kit: str | None, progress: Progress) -> Path:
    """The demo kit folder; trains the tiny kit into .cache when the shipped kit is not there."""
    if kit:
        path = Path(kit)
        missing = [p for p in KIT_PARTS if not (path / p).is_dir()]
        if missing:
            raise RuntimeError(f"{path}: missing {', '.join(missing)}")
        return path
    shipped = DEMO_KIT
    if all((shipped / p / "config.json").exists() for p in ("target", "draft")) and \
            all((shipped / p).is_dir() for p in KIT_PARTS):
        return shipped
    tiny = CACHE / "demo-tiny-kit"
    if all((tiny / p).is_dir() for p in KIT_PARTS) and (tiny / "kit.json").exists():
        progress.note(f"the shipped kit ({shipped}) is not there; using the tiny kit trained earlier at {tiny}")
        return tiny
    progress.note(f"the shipped kit ({shipped}) is not there; training the tiny kit into {tiny} (a few minutes)")
    from specdec.tools.kit.build import build_kit
    from specdec.tools.kit.profiles import PROFILES

    build_kit(PROFILES["tiny"], tiny, CACHE / "demo-tiny-kit-cache")
    return tiny


def stream_each(server, models: list[str], max_tokens: int, progress: Progress) -> list[dict]:
    from specdec.serving.client import run

    rows = []
    for model in models:
        progress.out.write(f"\n      \033[2m{model} <<\033[0m " if progress.tty else f"\n      {model} << ")
        progress.out.write(DEMO_PROMPT.rstrip("\n").replace("\n", "\n      ") + "\n")

        def echo(text: str) -> None:
            progress.out.write(text.replace("\n", "\n      "))
            progress.out.flush()

        progress.out.write("      ")
        s = run(server.grpc_url, model, DEMO_PROMPT, echo=echo, timeout_s=300, max_tokens=max_tokens,
                exclude_input_in_output=True, stream=True)
        stats = (f"{s.tokens} tokens in {s.chunks} responses, TTFT {s.ttft_s * 1000:.0f} ms, "
                 f"{s.tokens_per_s:.0f} tokens/s")
        if s.draft_tokens:
            stats += (f", drafts: {s.accepted_tokens}/{s.draft_tokens} accepted "
                      f"(rate {s.acceptance_rate:.2f}, {s.tokens / max(1, s.chunks - 1):.2f} tokens/response)")
        progress.out.write(f"\n      -- {stats}\n")
        rows.append({"model": model, "tokens": s.tokens, "ttft_s": s.ttft_s, "tokens_per_s": s.tokens_per_s,
                     "acceptance_rate": s.acceptance_rate})
        if s.tokens == 0:
            raise RuntimeError(f"{model} streamed no tokens")
    return rows


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="specdec demo", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--kit", help="kit folder (default: build/demo-kit, else the tiny kit)")
    ap.add_argument("--out", default=str(REPORTS / "demo"), help="report folder")
    ap.add_argument("--concurrency", default="1,4,16")
    # 10 short trials rather than 5 of 1.5 s + 0.5 s: the same wall time (172 s a 4-model matrix),
    # and the ratios' 90% intervals ~20% narrower (two runs of each; docs/verdicts.md)
    ap.add_argument("--rounds", type=int, default=10, help="interleaved trials per model and load level")
    ap.add_argument("--duration", type=float, default=0.75, help="measured seconds per trial")
    ap.add_argument("--warmup", type=float, default=0.3, help="seconds per trial before measuring")
    ap.add_argument("--servers", type=int, default=1,
                    help="server lives to split the rounds over (a fresh tritonserver each; the intervals hold "
                         "the instances' luck: docs/verdicts.md)")
    ap.add_argument("--no-aa", dest="aa", action="store_false", help="skip the A/A self-check (saves a sixth of the load stage)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (stream and load)")
    ap.add_argument("--models", help="comma-separated subset (default: every model the kit allows)")
    ap.add_argument("--guardrails", default=str(GUARDRAILS))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    p = Progress()
    out = Path(a.out)
    server = None
    ok = True
    try:
        p.begin("check", "tritonserver, Python backend, Locust")
        from specdec.serving.server import assemble_backends, tritonserver_binary

        binary = tritonserver_binary()
        assemble_backends()
        # find, not import: importing locust monkey-patches this process for gevent (and hangs gRPC here)
        import importlib.metadata
        import importlib.util

        for module in ("locust", "matplotlib", "tritonclient.grpc"):
            if importlib.util.find_spec(module) is None:
                raise RuntimeError(f"{module} is not installed: pip install -e '.[serve,loadtest]'")

        from specdec.tools.loadtest.guardrails import load_guardrails

        rules = load_guardrails(a.guardrails)
        p.end(text=f"{binary.name} from nvidia-pytriton, locust {importlib.metadata.version('locust')}")

        p.begin("kit", "the demo model kit (target, draft, Medusa heads, EAGLE head)")
        kit = find_kit(a.kit, p)
        detail = str(kit)
        if (kit / "checksums.json").exists():
            from specdec.tools.kit.export import verify_checksums

            bad = verify_checksums(kit)
            if bad:
                raise RuntimeError(f"{kit}: files differ from checksums.json: {', '.join(bad[:5])}")
            detail += " (checksums verified)"
        p.end(text=detail)

        p.begin("repository", "one Triton model per method")
        from specdec.tools.loadtest.matrix import aa_name, start_server, write_repository_for

        repo = out / "model_repository"
        models = write_repository_for(kit, repo, a.models.split(",") if a.models else None)
        if a.aa:
            models.insert(1, aa_name(rules.baseline))
        p.end(text=f"{repo}: {', '.join(models)}")

        p.begin("serve", "tritonserver with every model")
        server = start_server(repo, out, aa_of=rules.baseline if a.aa else None, timeout_s=900)
        p.end(text=f"gRPC {server.grpc_url}, HTTP {server.http_url}, metrics {server.metrics_url}")

        p.begin("stream", "one completion per model, tokens as they arrive (gRPC stream)")
        stream_each(server, models, a.max_tokens, p)
        if server.proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited (code {server.proc.returncode})")
        p.end()

        p.begin("load", "load matrix: interleaved trials of every model at each concurrency (Locust, headless)")
        from specdec.tools.loadtest.matrix import MatrixConfig, run_matrix
        from specdec.tools.loadtest.workload import Workload

        cfg = MatrixConfig(models=models, concurrency=[int(c) for c in a.concurrency.split(",")],
                           workloads=[Workload(max_tokens=a.max_tokens)], rounds=a.rounds, duration_s=a.duration,
                           warmup_s=a.warmup, grpc_url=server.grpc_url, http_url=server.http_url,
                           metrics_url=server.metrics_url, baseline=rules.baseline,
                           aa_model=aa_name(rules.baseline) if a.aa else None, servers=a.servers, out=str(out))
        t0 = time.monotonic()

        def restart(life: int):
            nonlocal server
            server.stop()
            server = None
            server = start_server(repo, out / f"life{life}", aa_of=rules.baseline if a.aa else None, timeout_s=900)
            return server

        def show(done, total, text):
            if done < total:
                eta = "" if not done else f"  (about {(time.monotonic() - t0) / done * (total - done):.0f} s left)"
                p.note(f"level {done + 1}/{total}: {text}{eta}")
        report = run_matrix(cfg, progress=show, restart=restart)
        if server.proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited (code {server.proc.returncode}) during the load matrix")
        failed = [f"{c['model']} at concurrency {c['concurrency']}: {c['figures']['error']}"
                  for c in report["cells"] if c["figures"].get("error")]
        failed += [f"{c['model']} at concurrency {c['concurrency']}: {c['figures']['error_rate']:.0%} of requests failed"
                   for c in report["cells"] if (c["figures"].get("error_rate") or 0) > 0.05]
        if failed:
            raise RuntimeError("; ".join(dict.fromkeys(failed)))
        p.end(text=f"{len(report['cells'])} cells, {sum(len(c['trials']) for c in report['cells'])} trials")

        p.begin("verdict", "guardrails on the intervals -> keep / keep below N / roll back / inconclusive")
        from specdec.tools.loadtest.report import write_report

        paths = write_report(report, rules, out)
        print(_summary_table(paths["report"]))
        print()
        print(paths["verdict_table"])
        p.end(text=f"report: {paths['md']} (+ report.json, {len(paths['plots'])} plots)")
    except BaseException as exc:  # noqa: BLE001 - any failure ends the demo with a clear message
        ok = False
        if p.stage and (not p.results or p.results[-1][0] != p.stage):
            p.end(False, f"{type(exc).__name__}: {exc}")
        if not isinstance(exc, (RuntimeError, OSError, ValueError, KeyboardInterrupt)):
            traceback.print_exc()
        if server is not None:
            print(server.log_tail(15), file=sys.stderr)
    finally:
        p.begin("stop", "stop tritonserver")
        if server is not None:
            server.stop()
            p.end(text="stopped")
        else:
            p.end(text="no server was running")
        p.summary()
    return 0 if ok else 1


def _summary_table(report: dict) -> str:
    """Headline figures per model at each load level, as ratios to the baseline."""
    from specdec.tools.loadtest.report import fmt, fmt_ratio

    rows = [("model", "conc", "TPOT p50 ms", "x base TPOT [interval]", "out tok/s", "x base tok/s [interval]",
             "CPU ms/tok", "accept")]
    for c in report["cells"]:
        f, r = c["figures"], c["ratios"]
        rows.append((c["model"], str(c["concurrency"]), fmt(f.get("tpot_p50"), 1000, "{:.1f}"),
                     fmt_ratio(r.get("tpot_p50")), fmt(f.get("output_tokens_per_s"), 1, "{:.0f}"),
                     fmt_ratio(r.get("output_tokens_per_s")), fmt(f.get("cpu_ms_per_token"), 1, "{:.2f}"),
                     fmt(f.get("acceptance_rate"), 1, "{:.2f}")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.rjust(w) if i > 1 else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
