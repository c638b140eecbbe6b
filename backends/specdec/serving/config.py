"""Model config parameters (config.pbtxt, all strings by Triton's design) -> EngineConfig and the
backend's own options. The text is parsed by `specdec.core.config`, the one definition of every
setting; no Triton imports, so the tests and the benchmark build the same engine in-process from
the same config file."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from specdec.core.config import PATH_KEYS, SETTINGS, EngineConfig, from_strings, setting, settings_of
from specdec.core.errors import ConfigurationError

@dataclass(frozen=True)
class BackendOptions:
    """The Triton backend's settings (not the engine's)."""

    stream_interval: int = setting(
        1, "a streamed response goes out once at least this many new tokens are pending (the first token "
           "and the last response always go at once); 1 = every engine step. Larger values trade "
           "streaming smoothness for less per-response work")


BACKEND_SETTINGS = settings_of("backend", BackendOptions)
PARAMETERS = {**SETTINGS, **BACKEND_SETTINGS}  # every key a config.pbtxt may carry


def split(parameters: dict[str, str]) -> tuple[dict[str, object], BackendOptions]:
    """config.pbtxt string parameters -> (typed engine settings by key, backend options). An
    unknown key or a value that does not parse fails, naming the parameter."""
    try:
        values = from_strings(parameters, PARAMETERS)
    except ConfigurationError as exc:
        raise ConfigurationError(f"model parameter {exc}") from None
    backend = {k: values.pop(k) for k in list(values) if k in BACKEND_SETTINGS}
    if backend.get("stream_interval", 1) < 1:
        raise ConfigurationError(f"model parameter stream_interval must be >= 1, got {backend['stream_interval']}")
    return values, BackendOptions(**backend)


def backend_options(parameters: dict[str, str]) -> BackendOptions:
    return split(parameters)[1]


def engine_config(parameters: dict[str, str], model_dir: str | Path) -> EngineConfig:
    """config.pbtxt string parameters -> EngineConfig. Relative checkpoint paths are resolved
    against the config's folder, then against the folder holding the model repository."""
    values, _ = split(parameters)
    if "target" not in values:
        raise ConfigurationError("model parameter 'target' (the target checkpoint folder) is required")
    for key in PATH_KEYS:
        if key in values:
            values[key] = resolve_path(values[key], Path(model_dir))
    return EngineConfig.of(**values)


def placed(config: EngineConfig, instance_kind: str, device_id: int | str) -> EngineConfig:
    """A GPU instance runs on the GPU Triton gave it (`cuda` in the config names no index)."""
    if instance_kind == "GPU":
        if not config.runtime.device.startswith("cuda"):
            raise ConfigurationError(
                f"instance kind GPU but parameter device={config.runtime.device!r}; set device to cuda")
        return config.with_(device=f"cuda:{device_id}")
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
