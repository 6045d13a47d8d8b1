"""One typed, schema-validated config object per stage.

Each stage has ``config/<stage>.yaml`` and ``config/schemas/<stage>.schema.json``. Loading:
1. parse the YAML (safe loader; ``"16"`` stays a string and fails an integer rule -- no coercion);
2. fill in what the file leaves out of the ports the stage binds and its upstreams' addresses from
   the mesh layout, config/keel.yaml (shared/topology.py), so that each port is written once;
3. apply environment overrides ``KEEL_<STAGE>_<KEY>`` where KEY is the dotted path upper-cased
   with ``__`` for nesting (``KEEL_INFERENCE_SERVER__PORT=50060``); the value is parsed as a YAML
   scalar, so an override is typed exactly like the file;
4. validate against the schema (unknown keys rejected); the first error names the field and rule;
5. build the stage's frozen dataclass.

A changed file is picked up on restart (``keel restart STAGE`` or the supervisor); nothing is built.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Mapping, TypeVar, get_type_hints

import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from shared.errors import KeelError
from shared.topology import Topology

ROOT_DIR = Path(__file__).resolve().parent.parent
CONFIG_DIR = Path(os.environ.get("KEEL_CONFIG_DIR", ROOT_DIR / "config"))
def var_dir() -> Path:
    """Where everything a running mesh writes lives (run state, logs, traces, caches):
    KEEL_VAR_DIR, read now (tests point it at a temporary folder), else var/ in the repository."""
    return Path(os.environ.get("KEEL_VAR_DIR", ROOT_DIR / "var"))


VAR_DIR = var_dir()  # as of process start, for paths fixed at import
T = TypeVar("T")


class ConfigError(Exception):
    """Invalid configuration: the stage must not start."""


# A stage's exit status for a ConfigError: the supervisor does not restart a stage that exits with
# it before it ever served (keelctl/supervisor.py).
EXIT_CONFIG = 2


@dataclass(frozen=True)
class ServerConfig:
    """Transport settings every stage shares (the ``server:`` block)."""

    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    drain_grace_s: float = 10.0
    max_connection_idle_s: float = 120.0  # close a client connection with no call for this long
    keepalive_time_s: float = 60.0        # ping each client connection this often ...
    keepalive_timeout_s: float = 20.0     # ... and close it when a ping is not answered within this
    max_message_bytes: int = 4 * 1024 * 1024
    log_level: str = "INFO"
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    reflection: bool = False  # offer server reflection (v1 and v1alpha): on for the public gateway


def _registry(schema_dir: Path) -> Registry:
    resources = []
    for path in schema_dir.glob("*.schema.json"):
        schema = Resource.from_contents(json.loads(path.read_text()), default_specification=DRAFT202012)
        resources.append((path.name, schema))
    return Registry().with_resources(resources)


def _apply_env(data: dict, stage: str, environ: Mapping[str, str]) -> dict:
    prefix = f"KEEL_{stage.upper()}_"
    for name, raw in environ.items():
        if not name.startswith(prefix):
            continue
        path = name[len(prefix):].lower().split("__")
        node = data
        for key in path[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{name}: {'.'.join(path)} does not name a nested key")
        node[path[-1]] = yaml.safe_load(raw)
    return data


def validate(data: Any, schema_name: str, schema_dir: Path) -> None:
    schema = json.loads((schema_dir / schema_name).read_text())
    validator = Draft202012Validator(schema, registry=_registry(schema_dir))
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        where = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        raise ConfigError(f"{schema_name}: field '{where}' breaks rule '{err.validator}': {err.message}")


def build(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build a (nested) frozen dataclass from validated data; lists become tuples.

    A value that passes the schema but fails the dataclass's own check (``__post_init__``) becomes a
    ConfigError naming the block it sits in and the rule it broke, so the stage stops with exit 2."""
    hints = get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        value, hint = data[f.name], hints[f.name]
        if is_dataclass(hint):
            value = build(hint, value, f"{where}{f.name}.")
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except (ValueError, TypeError, KeelError) as exc:
        raise ConfigError(f"field '{where.rstrip('.') or '(top level)'}' breaks rule '{cls.__name__}': {exc}") from exc


def config_path(stage: str, environ: Mapping[str, str]) -> Path:
    """config/<stage>.yaml, or the file KEEL_<STAGE>_CONFIG names."""
    return Path(environ.get(f"KEEL_{stage.upper()}_CONFIG") or CONFIG_DIR / f"{stage}.yaml")


# Where each port list of a stage's layout goes in the stage's own config: the first replica's port
# (a stage started alone is that replica; the supervisor sets every replica's through the environment).
LAYOUT_PORTS = {"ports": ("server", "port"), "metrics_ports": ("server", "metrics_port"),
                "webhook_ports": ("rotation", "webhook_port")}


def _fill(data: dict, path: tuple[str, ...], value: Any) -> None:
    """Set ``value`` at ``path`` unless the file set it (a non-mapping on the way: the schema names it)."""
    node = data
    for key in path[:-1]:
        node = node.setdefault(key, {}) if isinstance(node, dict) else node
    if isinstance(node, dict):
        node.setdefault(path[-1], value)


def _with_topology(data: dict, stage: str, upstreams: Mapping[tuple[str, ...], str], topo: Topology) -> dict:
    """Fill what the file leaves out from the layout: every port the stage binds (LAYOUT_PORTS), and
    each upstream list at its path (e.g. ("upstreams", "inference") -> the inference stage's addresses)."""
    for key, path in LAYOUT_PORTS.items():
        if topo.listed(stage, key):
            _fill(data, path, topo.listed(stage, key)[0])
    for path, upstream in upstreams.items():
        if topo.ports(upstream):
            _fill(data, path, topo.targets(upstream))
    return data


def load(stage: str, cls: type[T], path: Path | None = None, environ: Mapping[str, str] | None = None,
         schema_dir: Path | None = None, upstreams: Mapping[tuple[str, ...], str] | None = None) -> T:
    """`upstreams`: where in this stage's config the addresses of which stage go (see _with_topology)."""
    environ = os.environ if environ is None else environ
    path = Path(path or config_path(stage, environ))
    schema_dir = schema_dir or CONFIG_DIR / "schemas"
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    data = _with_topology(data, stage, upstreams or {}, Topology(config_path("keel", environ)))
    env = {k: v for k, v in environ.items() if k != f"KEEL_{stage.upper()}_CONFIG"}
    data = _apply_env(data, stage, env)
    validate(data, f"{stage}.schema.json", schema_dir)
    return build(cls, data)
