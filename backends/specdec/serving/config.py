"""Model config parameters (config.pbtxt, all strings) -> EngineConfig. No Triton imports, so the
tests and the benchmark build the same engine in-process from the same config file."""

from __future__ import annotations

import re
from dataclasses import fields, replace
from pathlib import Path

from specdec.core.engine_config import EngineConfig
from specdec.core.errors import ConfigurationError

PATH_KEYS = ("target", "draft", "medusa", "eagle")
BACKEND_KEYS = {"stream_interval": 1}  # backend (not engine) settings and their defaults


def backend_options(parameters: dict[str, str]) -> dict[str, int]:
    """The backend's own settings. stream_interval: a streamed response goes out once at least this
    many new tokens are pending (the first token and the last response always go at once); 1 =
    every engine step. Larger values trade streaming smoothness for less per-response work."""
    options = dict(BACKEND_KEYS)
    raw = parameters.get("stream_interval", "").strip()
    if raw and raw.lower() != "none":
        try:
            options["stream_interval"] = int(raw)
        except ValueError:
            raise ConfigurationError(f"model parameter stream_interval={raw!r} is not an integer") from None
        if options["stream_interval"] < 1:
            raise ConfigurationError(f"model parameter stream_interval must be >= 1, got {raw}")
    return options


def engine_config(parameters: dict[str, str], model_dir: str | Path) -> EngineConfig:
    """config.pbtxt string parameters -> EngineConfig. Relative checkpoint paths are resolved
    against the config's folder, then against the folder holding the model repository."""
    model_dir = Path(model_dir)
    types = {f.name: f.type for f in fields(EngineConfig)}
    values: dict[str, object] = {}
    for key, raw in parameters.items():
        raw = raw.strip()
        if key == "policy":
            if raw not in ("adaptive", "fixed"):
                raise ConfigurationError(f"parameter policy must be 'adaptive' or 'fixed', got {raw!r}")
            values["adaptive"] = raw == "adaptive"
            continue
        if key in BACKEND_KEYS:
            continue
        if key not in types:
            raise ConfigurationError(
                f"unknown model parameter {key!r}; known: policy, {', '.join([*types, *BACKEND_KEYS])}")
        if raw == "" or raw.lower() == "none":
            continue
        kind = str(types[key])
        try:
            if key in PATH_KEYS:
                values[key] = resolve_path(raw, model_dir)
            elif kind.startswith("bool"):
                values[key] = {"true": True, "1": True, "false": False, "0": False}[raw.lower()]
            elif kind.startswith("int"):
                values[key] = int(raw)
            elif kind.startswith("float"):
                values[key] = float(raw)
            else:
                values[key] = raw
        except (KeyError, ValueError):
            raise ConfigurationError(f"model parameter {key}={raw!r} is not a valid {kind}") from None
    if "target" not in values:
        raise ConfigurationError("model parameter 'target' (the target checkpoint folder) is required")
    return EngineConfig(**values)


def placed(config: EngineConfig, instance_kind: str, device_id: int | str) -> EngineConfig:
    """A GPU instance runs on the GPU Triton gave it (`cuda` in the config names no index)."""
    if instance_kind == "GPU":
        if not config.device.startswith("cuda"):
            raise ConfigurationError(f"instance kind GPU but parameter device={config.device!r}; set device to cuda")
        return replace(config, device=f"cuda:{device_id}")
    return config


def resolve_path(raw: str, model_dir: Path) -> str:
    path = Path(raw).expanduser()
    if path.is_absolute():
        return str(path)
    for base in (model_dir, model_dir.parent.parent):
        if (base / path).exists():
            return str((base / path).resolve())
    return str((model_dir / path).resolve())  # build_engine reports the missing folder


PARAMETER = re.compile(r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}')


def read_parameters(config_pbtxt: str | Path) -> dict[str, str]:
    """The string parameters of a config.pbtxt (the subset of protobuf text format we write)."""
    return dict(PARAMETER.findall(Path(config_pbtxt).read_text()))


def engine_config_for(model_dir: str | Path) -> EngineConfig:
    """The EngineConfig a served model folder describes."""
    return engine_config(read_parameters(Path(model_dir) / "config.pbtxt"), model_dir)
