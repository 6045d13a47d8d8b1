"""Output plugin contracts and loading: the only things the pipeline knows about plugins.

A plugin is any object with ``validate(output, context) -> Verdict | None`` (an
:class:`OutputValidator`) or ``process(text) -> str`` (a :class:`TextProcessor`). Config names a
factory (class or function) by dotted path, ``package.module:Name`` or ``package.module.Name``,
plus keyword ``args``; it is imported and called once at startup.
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

ON_FAIL = ("block", "annotate")


@dataclass(frozen=True)
class Verdict:
    """A failed output check. ``plugin`` and ``blocking`` are filled in by the pipeline from
    config (the configured instance name, and whether its ``on_fail`` is ``block``)."""

    message: str
    plugin: str = ""
    blocking: bool = False
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OutputContext:
    """What a validator may know about the request besides the output text.

    The caller sets domain, trace_id, token_entropies (one entropy in nats per generated token,
    from inference), prompt, source and json_schema; the pipeline adds ``probes`` (the
    :class:`~services.validator.probes.ProbeReport` of this output) before validators run.
    """

    domain: str = "default"
    trace_id: str = ""
    token_entropies: Sequence[float] = ()
    prompt: str = ""
    source: str = ""
    json_schema: str = ""  # the JSON Schema the request constrained its answer to ("" = none)
    continuation: bool = False  # the answer continues a raw text, not a conversation's turn
    probes: Any = None


@runtime_checkable
class OutputValidator(Protocol):
    def validate(self, output: str, context: OutputContext) -> Verdict | None: ...


@runtime_checkable
class TextProcessor(Protocol):
    def process(self, text: str) -> str: ...


@dataclass(frozen=True)
class PluginSpec:
    """One configured plugin instance."""

    name: str
    path: str
    args: Mapping[str, Any] = field(default_factory=dict)
    on_fail: str = "block"

    @property
    def blocks(self) -> bool:
        """Whether a failure of this check blocks the answer (else it only annotates it)."""
        return self.on_fail == "block"

    @classmethod
    def from_dict(cls, name: str, d: Mapping[str, Any]) -> PluginSpec:
        where = f"validator config plugins.{name}"
        if not isinstance(d, Mapping) or not isinstance(d.get("path"), str):
            raise ValueError(f"{where}: needs a 'path' (dotted path of the plugin factory)")
        unknown = set(d) - {"path", "args", "on_fail"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        on_fail = d.get("on_fail", "block")
        if on_fail not in ON_FAIL:
            raise ValueError(f"{where}: on_fail must be one of {ON_FAIL}, got {on_fail!r}")
        args = d.get("args") or {}
        if not isinstance(args, Mapping):
            raise ValueError(f"{where}: args must be a mapping")
        return cls(name=name, path=d["path"], args=dict(args), on_fail=on_fail)


def import_object(path: str) -> Any:
    """``pkg.mod:Name`` or ``pkg.mod.Name`` -> the object."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"plugin path {path!r} is not 'package.module:Name'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"plugin path {path!r} cannot be imported: {exc}") from exc
    return obj


def build_plugin(spec: PluginSpec) -> OutputValidator | TextProcessor:
    """Import and instantiate one plugin; refuse objects that satisfy neither protocol."""
    factory = import_object(spec.path)
    try:
        plugin = factory(**spec.args)
    except TypeError as exc:
        raise ValueError(f"plugin {spec.name!r} ({spec.path}): bad args {dict(spec.args)}: {exc}"
                         ) from exc
    if not isinstance(plugin, (OutputValidator, TextProcessor)):
        raise ValueError(f"plugin {spec.name!r} ({spec.path}) has neither validate(output, "
                         f"context) nor process(text)")
    return plugin
