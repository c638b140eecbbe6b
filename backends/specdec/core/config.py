"""The engine's configuration, defined once: every setting, its type, default and meaning.

`EngineConfig` nests four sections: `checkpoints` (which folders), `proposer` (method, k, trees),
`scheduler` (policy, KV slots, context, queue timeout) and `runtime` (dtype, device, threads).
Each leaf setting also has a flat key, unique across sections (`k`, `policy`, `max_batch`, ...):
the name a `config.pbtxt` parameter, a `specdec` flag (`--max-batch`) and `EngineConfig.of(...)`
use. The CLI flags (`add_arguments`), the model config parameters (`to_strings`/`from_strings`)
and `specdec build-repo` are all derived from the dataclasses below, so a default or a meaning
changes here and nowhere else.

Structured values are typed: an EAGLE-2 tree is a (top_k, depth, total_tokens) tuple, a Medusa
tree a tuple of index paths. Their text forms ("top_k,depth,total_tokens", JSON paths) exist only
at the edges (flags, and config.pbtxt, whose parameters are strings by Triton's design) and are
parsed here. No torch import: the CLI's help and the model repository writer do not load it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from specdec.core.errors import ConfigurationError

POLICIES = ("adaptive", "fixed")
ACCEPTANCES = ("exact", "typical")
DTYPES = ("float32", "float64", "float16", "bfloat16")
DRAFT_DTYPES = ("float32", "bfloat16", "int8")  # a drafter's matmuls, widest first (`linear.narrow`)


# ---- text forms of the structured values ------------------------------------------------------

def parse_eagle_tree(text: str) -> tuple[int, int, int]:
    """'top_k,depth,total_tokens' -> (top_k, depth, total_tokens), each >= 1."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"an EAGLE-2 tree is top_k,depth,total_tokens (three integers >= 1), got {text!r}")
    top_k, depth, total = (int(p) for p in parts)
    return top_k, depth, total


def show_eagle_tree(tree: tuple[int, int, int]) -> str:
    return ",".join(str(x) for x in tree)


def parse_medusa_tree(text: str) -> tuple[tuple[int, ...], ...]:
    """JSON list of top-k index paths ('[[0], [0, 0], [1]]') -> tuple of tuples."""
    try:
        paths = json.loads(text)
    except ValueError:
        raise ValueError(f"a Medusa tree is a JSON list of index paths like [[0], [0, 0], [1]], got {text!r}") from None
    if not isinstance(paths, list) or not all(
            isinstance(p, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in p) for p in paths):
        raise ValueError(f"a Medusa tree is a JSON list of lists of integers, got {text!r}")
    return tuple(tuple(p) for p in paths)


def show_medusa_tree(tree: tuple[tuple[int, ...], ...]) -> str:
    return json.dumps([list(p) for p in tree], separators=(",", ":"))


@dataclass(frozen=True)
class Setting:
    """One leaf setting: its flat key, section, default and how it reads and writes as text."""

    key: str
    section: str
    default: Any
    help: str
    parse: Callable[[str], Any]
    show: Callable[[Any], str] = str
    choices: tuple[str, ...] | None = None
    flags: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    def from_text(self, raw: str) -> Any:
        """Parse a flag or config parameter; ValueError names the setting and what it expects."""
        try:
            value = self.parse(raw.strip())
        except ValueError as exc:
            raise ValueError(f"{self.key}={raw!r}: {exc}") from None
        if self.choices and value not in self.choices:
            raise ValueError(f"{self.key} must be one of {', '.join(self.choices)}, got {raw!r}")
        return value

    def to_text(self, value: Any) -> str:
        return "" if value is None else self.show(value)


def setting(default: Any, help: str, parse: Callable[[str], Any] | None = None, show: Callable[[Any], str] = str,
            choices: tuple[str, ...] | None = None, flags: tuple[str, ...] = ()) -> Any:
    """A dataclass field carrying what `Setting` needs (parse defaults to the default's type)."""
    if parse is None:
        parse = type(default) if default is not None else str
    return field(default=default, metadata={"help": help, "parse": parse, "show": show, "choices": choices,
                                            "flags": flags})


# ---- the sections ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Checkpoints:
    """Hugging Face checkpoint folders (relative ones resolve against the config's folder when served)."""

    target: str | None = setting(None, "target checkpoint folder (HF layout)")
    draft: str | None = setting(None, "draft model folder (same tokenizer as the target)")
    medusa: str | None = setting(None, "Medusa heads folder")
    eagle: str | None = setting(None, "EAGLE head folder")


@dataclass(frozen=True)
class ProposerConfig:
    """What drafts the tokens the target verifies, and how many.

    `k` caps the speculated tokens per step for every method: a chain's length, a tree's node
    count (a Medusa or EAGLE-2 tree is pruned to its best k nodes by the proposer)."""

    method: str = setting("baseline", "baseline (no speculation) or a registered proposer: draft, medusa, eagle, "
                                      "eagle2, ngram (`specdec.core.proposers`)")
    k: int = setting(4, "draft tokens (tree nodes) per step, at most", flags=("-k",))
    medusa_tree: tuple[tuple[int, ...], ...] | None = setting(
        None, "Medusa tree: JSON list of top-k index paths, best first; none = mc_sim_7b_63",
        parse_medusa_tree, show_medusa_tree)
    eagle_tree: tuple[int, int, int] = setting(
        (4, 5, 24), "EAGLE-2 dynamic tree: top_k,depth,total_tokens", parse_eagle_tree, show_eagle_tree)
    # a drafter's proposal is matmuls of one or a few rows, and on CPU they bound it: rounded to
    # bfloat16 the kernel multiplies twice as much per instruction, in int8 four times from half
    # the bytes (`decoder.c`'s WT_BF16, WT_I8). Only what is proposed can change; the target
    # verifies in `dtype` as before. On the demo kit int8 drafts were accepted as often as
    # bfloat16 ones (EAGLE's fc stays bfloat16: `EagleHead.draft_in`) and EAGLE ran 1.11x faster
    draft_dtype: str = setting("int8", "drafters' matmuls on CPU (draft model, EAGLE and Medusa heads): int8 where "
                                       "the CPU has AVX512-VNNI, else bfloat16 where it has AVX512-BF16, else "
                                       "float32; lossless either way: only acceptance can move", choices=DRAFT_DTYPES)
    # a match of 1-2 tokens drafts little that is accepted (on the demo kit at fixed k = 4, after a
    # one-token match 0.97 of 4 draft tokens, after a 4-token one 3.70), and where the target's
    # verification is compute-bound each draft token costs about a plain step's arithmetic: 3
    # drafted only after longer matches, 1.38x the baseline at batch 1 against 1.27x for 1, 1.08x
    # at batch 8 against 0.95x (reports/benchmarks-log.md, "Prompt lookup drafts after longer matches")
    ngram_min: int = setting(3, "prompt lookup: shortest n-gram matched")
    ngram_max: int = setting(4, "prompt lookup: longest n-gram matched")
    acceptance: str = setting("exact", "exact (lossless) or typical (Medusa-2, LOSSY when sampling)",
                              choices=ACCEPTANCES)
    typical_threshold: float = setting(0.09, "typical acceptance: probability floor epsilon")
    typical_alpha: float = setting(0.3, "typical acceptance: entropy scale")


@dataclass(frozen=True)
class SchedulerConfig:
    """How requests share the engine: draft length policy, KV slots, context, queueing."""

    policy: str = setting("adaptive", "adaptive: k per step from acceptance and load; fixed: always k",
                          choices=POLICIES)
    max_batch: int = setting(8, "KV slots: requests decoded together, at most")
    max_context: int = setting(1024, "prompt + output tokens per request, at most")
    queue_timeout_s: float = setting(60.0, "seconds a request waits for a KV slot before it fails")


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and how the models run."""

    dtype: str = setting("float32", "model weights and activations", choices=DTYPES)
    device: str = setting("cpu", "cpu, cuda or cuda:N")
    threads: int = setting(1, "CPU threads of torch and of the native decoder (1 is fastest when cores are shared)")
    prefill_threads: int = setting(0, "native decoder threads for a prompt's prefill, where decode keeps `threads` "
                                      "(0: `threads`)")


PATH_KEYS = tuple(f.name for f in fields(Checkpoints))  # settings that name folders
SECTIONS = {"checkpoints": Checkpoints, "proposer": ProposerConfig, "scheduler": SchedulerConfig,
            "runtime": RuntimeConfig}


def settings_of(section: str, cls: type) -> dict[str, Setting]:
    """The `Setting`s of one flat dataclass (also used for the Triton backend's own options)."""
    out = {}
    for f in fields(cls):
        m = f.metadata
        out[f.name] = Setting(f.name, section, f.default, m["help"], m["parse"], m["show"], m["choices"], m["flags"])
    return out


def _all_settings() -> dict[str, Setting]:
    table: dict[str, Setting] = {}
    for name, cls in SECTIONS.items():
        for key, s in settings_of(name, cls).items():
            if key in table:
                raise TypeError(f"setting {key} is in sections {table[key].section} and {name}: keys must be unique")
            table[key] = s
    return table


SETTINGS = _all_settings()  # every leaf setting by flat key, in section order


@dataclass(frozen=True)
class EngineConfig:
    """Everything `build_engine` needs; immutable, so a copy with changes is `with_(...)`."""

    checkpoints: Checkpoints = field(default_factory=Checkpoints)
    proposer: ProposerConfig = field(default_factory=ProposerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    @classmethod
    def of(cls, **settings: Any) -> EngineConfig:
        """Build from flat keys (`EngineConfig.of(target=..., method="eagle", k=3, policy="fixed")`);
        anything not given keeps its default."""
        return cls().with_(**settings)

    def with_(self, **settings: Any) -> EngineConfig:
        """A copy with some flat settings changed; an unknown key raises ConfigurationError."""
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise ConfigurationError(f"unknown setting {unknown[0]!r}; known: {', '.join(SETTINGS)}")
        sections = {}
        for name in SECTIONS:
            changes = {k: v for k, v in settings.items() if SETTINGS[k].section == name}
            sections[name] = replace(getattr(self, name), **changes) if changes else getattr(self, name)
        return EngineConfig(**sections)

    def settings(self) -> dict[str, Any]:
        """Every leaf setting by flat key."""
        return {key: getattr(getattr(self, s.section), key) for key, s in SETTINGS.items()}


# ---- edges: text (config.pbtxt parameters) and command-line flags -----------------------------

def from_strings(raw: dict[str, str], table: dict[str, Setting] = SETTINGS) -> dict[str, Any]:
    """Text values by key -> typed values; empty or 'none' means the default. Errors name the key."""
    values = {}
    for key, text in raw.items():
        if key not in table:
            raise ConfigurationError(f"unknown setting {key!r}; known: {', '.join(table)}")
        if text.strip() == "" or text.strip().lower() == "none":
            continue
        try:
            values[key] = table[key].from_text(text)
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
    return values


def to_strings(values: dict[str, Any], table: dict[str, Setting] = SETTINGS) -> dict[str, str]:
    """Typed values by key -> their text form (None values are left out)."""
    return {key: table[key].to_text(v) for key, v in values.items() if v is not None}


def add_arguments(parser: argparse.ArgumentParser, keys: list[str], table: dict[str, Setting] = SETTINGS,
                  given_only: bool = False) -> None:
    """One flag per key, typed and documented from its Setting. `given_only`: flags left out of
    the command line stay out of the namespace (the caller applies the defaults itself)."""
    for key in keys:
        s = table[key]
        parser.add_argument(*s.flags, s.flag, dest=key, type=_argparse_type(s), choices=s.choices,
                            default=argparse.SUPPRESS if given_only else s.default,
                            help=s.help if s.default is None else f"{s.help} (default: {s.to_text(s.default)})")


def given(args: argparse.Namespace, keys: list[str]) -> dict[str, Any]:
    """The values of `keys` in parsed arguments (those present)."""
    return {k: getattr(args, k) for k in keys if hasattr(args, k)}


def _argparse_type(s: Setting) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return s.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = s.key  # argparse names it in "invalid k value: 'x'"
    return parse

