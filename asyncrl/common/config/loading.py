"""A config from its TOML file: the ``preset`` it overlays (a file beside it, or one of the package's presets in
``asyncrl/presets/``, read through ``importlib.resources``), ``--set a.b=c`` overrides, the
resolved config written to the run folder, this host's CURVE key paths from the environment (and whether its reward
workers can bind with them), and the field reference ``rl-learner fields`` prints."""

from __future__ import annotations

import importlib.resources
import json
import os
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
)

from asyncrl.common.config.base import MAX_CONFIG_BYTES, MAX_DEPTH, ConfigError, check_values
from asyncrl.common.config.run import RunConfig, validated
from asyncrl.common.net import is_loopback


def preset_dir() -> Path:
    """The presets the package ships (``asyncrl/presets/*.toml``; the checkout's ``configs/`` links to them). An
    installed package is unpacked on disk, from a wheel as from a checkout, so the resource is a folder."""
    folder = importlib.resources.files("asyncrl") / "presets"
    if not isinstance(folder, Path):  # only a zipped install would do this
        raise ConfigError("asyncrl's presets are not in a folder on disk; install asyncrl unpacked (pip install)")
    return folder


def known_presets() -> list[str]:
    return sorted(p.stem for p in preset_dir().glob("*.toml"))


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The config in ``path`` (over its ``preset``, if any) with ``key.path=value`` overrides applied. ``path`` may
    also be a preset's bare name (``demo``) where no such file exists: an installed package has no ``configs/``."""
    parsed = [_parse_override(item) for item in overrides]
    switch = [value for key, value in parsed if key in PRESET_KEYS]
    data = _read_with_preset(_config_path(Path(path)) if path else None, str(switch[-1]) if switch else None)
    for key, value in parsed:
        if key in PRESET_KEYS:
            continue
        check_values(value, key.split("."))
        _set_dotted(data, key, value)
    return validated(data)


PRESET_KEYS = ("preset", "algorithm.preset")
"""``--set preset=dapo`` (or ``algorithm.preset``, the label a config records) switches the preset under the config:
the named preset, then the file's own settings over it — never a label that disagrees with what trains."""


def _read_with_preset(path: Path | None, switch: str | None) -> dict[str, Any]:
    """The config file over its own preset chain, or — with ``switch`` — over the packaged preset ``switch``."""
    if switch is not None and switch not in known_presets():
        raise ConfigError(f"preset {switch!r} not found; known presets: {', '.join(known_presets())}")
    if path is None:
        return _read_toml_with_preset(preset_dir() / f"{switch}.toml") if switch else {}
    return _read_toml_with_preset(path, switch=switch)


def _read_toml_with_preset(path: Path, seen: tuple[Path, ...] = (), switch: str | None = None) -> dict[str, Any]:
    data = _parse_toml(path, _read_config_file(path))
    check_values(data, [], f"{path}: ")
    base_name = data.pop("preset", None)
    if switch is not None:  # the file's own settings over the packaged preset `switch`, its label included
        data.get("algorithm", {}).pop("preset", None)
        return _deep_merge(_read_toml_with_preset(preset_dir() / f"{switch}.toml"), data)
    if base_name is None:
        return data
    base_path = _preset_path(str(base_name), path.parent, (*seen, path))
    return _deep_merge(_read_toml_with_preset(base_path, (*seen, path)), data)


def _read_config_file(path: Path) -> str:
    """The text of a config file, at most :data:`MAX_CONFIG_BYTES` of it (``/dev/zero`` never ends)."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: a config file of over {MAX_CONFIG_BYTES // 2**20} MiB; give a TOML file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 text at byte {exc.start}") from None


def _parse_toml(path: Path, text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise ConfigError(f"{path}: not valid TOML: nested more than {MAX_DEPTH} levels deep") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except ValueError:  # a number beyond Python's int-string conversion limit
        raise ConfigError(
            f"{path}: a number of over {sys.get_int_max_str_digits()} digits; no setting takes one"
        ) from None


def _config_path(path: Path) -> Path:
    """``path``, or the package's preset of that name when ``path`` is a bare name and no such file exists."""
    packaged = preset_dir() / f"{path.name}.toml"
    if not path.exists() and path.name == str(path) and packaged.is_file():
        return packaged
    return path


def _preset_path(name: str, relative_to: Path, chain: tuple[Path, ...]) -> Path:
    """The file ``preset = name`` names: beside the config first (a user's own base), else the package's preset. A
    file already in the chain is passed over, so a user's ``grpo.toml`` may itself say ``preset = "grpo"``."""
    reading = {p.resolve() for p in chain}
    candidates = (relative_to / name, relative_to / f"{name}.toml", preset_dir() / f"{name}.toml")
    found = [c for c in candidates if c.is_file()]
    for candidate in found:
        if candidate.resolve() not in reading:
            return candidate
    if found:
        raise ConfigError(f"{chain[-1]}: preset cycle through {' -> '.join(map(str, chain))}")
    raise ConfigError(f"preset {name!r} not found; known presets: {', '.join(known_presets()) or 'none'}")


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, tables merged key by key — except ``*_options`` tables, which belong to the variant
    named beside them and are replaced whole (a preset that switches ``loss`` must not inherit the old loss's
    options)."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and not key.endswith("_options"):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _parse_override(item: str) -> tuple[str, Any]:
    """``a.b=c`` → (``a.b``, value); the value is read as TOML (``3``, ``true``, ``[1,2]``) or else a string.

    A field whose type is a string takes the text as it is (``rollout.cpu_threads=1`` is the string ``"1"``, not
    the integer 1); a quoted TOML string is unquoted first.
    """
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not of the form section.field=value")
    if raw.strip().lstrip("+-") in ("nan", "inf"):
        return key, raw.strip()  # a name such as run.name=nan, not a float: no field takes NaN or infinity
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except RecursionError:
        raise ConfigError(f"invalid config: {key}: nested more than {MAX_DEPTH} levels deep; flatten it") from None
    except ValueError:  # not TOML (or a number beyond Python's int-string limit): the text itself
        value = raw.strip()
    if not isinstance(value, str) and _field_type(key) is str:
        value = raw.strip()
    return key, value


def _field_type(key: str) -> Any:
    """The annotation of the config field at dotted ``key`` (``rollout.cpu_threads`` → ``str``), None if unknown."""
    model: Any = RunConfig
    annotation: Any = None
    for part in key.split("."):
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return None
        annotation = fields[part].annotation
        model = annotation
    return annotation


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def field_help(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, docstring) of every field: the config reference."""
    rows = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += field_help(ann, f"{prefix}{name}.")
            continue
        default = info.get_default(call_default_factory=True)
        rows.append((f"{prefix}{name}", json.dumps(default, default=str), info.description or ""))
    return rows


def write_resolved(config: RunConfig) -> Path:
    """Write ``runs/<name>/config.json`` (creating the run folder) and return its path."""
    config.run_dir.mkdir(parents=True, exist_ok=True)
    out = config.run_dir / "config.json"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(config.to_json())
    tmp.replace(out)
    return out


HOST_KEY_ENV = {
    "ASYNCRL_CURVE_SERVER_KEY": "curve_server_key",
    "ASYNCRL_CURVE_CLIENT_KEYS": "curve_client_keys",
    "ASYNCRL_CURVE_CLIENT_KEY": "curve_client_key",
}
"""Environment variables that set this process's CURVE key paths over the run's config (each host mounts its own)."""


def with_host_keys(config: RunConfig, environ: Mapping[str, str] | None = None) -> RunConfig:
    """``config`` with the CURVE key paths of this host, where :data:`HOST_KEY_ENV` variables are set."""
    environ = os.environ if environ is None else environ
    changes = {field: environ[var] for var, field in HOST_KEY_ENV.items() if environ.get(var)}
    if not changes:
        return config
    return config.model_copy(update={"transport": config.transport.model_copy(update=changes)})


def bind_refusal(config: RunConfig, environ: Mapping[str, str] | None = None) -> str | None:
    """Why a reward worker of this host would refuse to bind ``transport.zmq_endpoint``, with this host's CURVE key
    paths applied (:func:`with_host_keys`): beyond loopback without ``curve_server_key`` and ``curve_client_keys``
    (``common/transport/channel.py`` refuses it when the worker binds, after the run has started). None when it binds.
    """
    transport = with_host_keys(config, environ).transport
    if is_loopback(transport.zmq_endpoint) or (transport.curve_server_key and transport.curve_client_keys):
        return None
    return (
        f"transport.zmq_endpoint = {transport.zmq_endpoint!r} binds the reward workers beyond loopback without CURVE "
        "keys, which they refuse: set transport.curve_server_key and transport.curve_client_keys (rl-launch --curve "
        "makes a run's keys), or bind tcp://127.0.0.1:0"
    )
