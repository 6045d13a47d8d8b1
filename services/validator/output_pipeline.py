"""Output pipeline: processors, then probes, then validators, chosen per request by domain.

Per request: the domain's processors rewrite the text in order; the probes measure it; every
validator of the domain runs (a failing one does not stop the others, so the result lists all
problems). A verdict blocks the answer if its plugin's ``on_fail`` is ``block``, else it only
annotates it. Blocked and ``low_confidence`` outputs are handed to the ``review`` callback
(normally :meth:`Quarantine.put`, which writes to the review stream).

A validator that raises fails closed: its exception becomes its verdict. A processor that
raises is a bug with no safe fallback text, so it surfaces as :class:`Fatal`.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from services.validator.domains import DomainConfig, domains_from_dict
from services.validator.plugins import OutputContext, OutputValidator, PluginSpec, TextProcessor, Verdict, build_plugin
from services.validator.probes import Probes
from services.validator.records import QuarantineRecord
from shared.errors import Fatal, InvalidInput

ReviewSink = Callable[[QuarantineRecord], str]


@dataclass(frozen=True)
class PipelineConfig:
    plugins: Mapping[str, PluginSpec]
    domains: Mapping[str, DomainConfig]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], base_dir: Path = Path(".")) -> PipelineConfig:
        """``{"plugins": {name: {path, args, on_fail}}, "domains": {tag: {...}}}``; relative
        ``terms_file`` paths are resolved against ``base_dir``. A ``shared`` key (YAML anchors
        for the domains to reference) is ignored."""
        unknown = set(d) - {"plugins", "domains", "shared"}
        if unknown:
            raise ValueError(f"validator config: unknown keys {sorted(unknown)}")
        plugins = {str(n): PluginSpec.from_dict(str(n), s) for n, s in (d.get("plugins") or {}).items()}
        domains = domains_from_dict(d.get("domains") or {}, base_dir)
        for dom in domains.values():
            for name in dom.processors + dom.validators:
                if name not in plugins:
                    raise ValueError(f"validator config domains.{dom.name}: unknown plugin {name!r}")
        return cls(plugins=plugins, domains=domains)

    @classmethod
    def load(cls, path: Path) -> PipelineConfig:
        """Read a YAML file holding ``plugins`` and ``domains`` (config/validator/pipeline.yaml)."""
        path = Path(path)
        return cls.from_dict(yaml.safe_load(path.read_text("utf-8")) or {}, path.parent)


@dataclass(frozen=True)
class OutputResult:
    text: str                       # the processed text (returned even when blocked: see blocked)
    blocked: bool                   # True: do not send ``text`` to the client
    verdicts: list[Verdict]         # the failed checks
    probes: dict[str, float | bool]
    low_confidence: bool
    review_id: str | None = None    # record_id in the review stream, if it was sent there
    flags: list[str] = field(default_factory=list)
    # The checks that passed, as (plugin name, blocking: would its failure have blocked).
    passed_checks: tuple[tuple[str, bool], ...] = ()


@dataclass(frozen=True)
class _Chain:
    processors: tuple[tuple[str, TextProcessor], ...]
    validators: tuple[tuple[PluginSpec, OutputValidator], ...]
    probes: Probes


class OutputPipeline:
    def __init__(self, cfg: PipelineConfig, plugins: Mapping[str, Any],
                 review: ReviewSink | None = None):
        self.cfg = cfg
        self._review = review
        self._chains: dict[str, _Chain] = {}
        for dom in cfg.domains.values():
            procs = []
            for name in dom.processors:
                if not isinstance(plugins[name], TextProcessor):
                    raise ValueError(f"domain {dom.name}: plugin {name!r} is not a TextProcessor")
                procs.append((name, plugins[name]))
            vals = []
            for name in dom.validators:
                if not isinstance(plugins[name], OutputValidator):
                    raise ValueError(f"domain {dom.name}: plugin {name!r} is not an OutputValidator")
                vals.append((cfg.plugins[name], plugins[name]))
            self._chains[dom.name] = _Chain(tuple(procs), tuple(vals), Probes(dom.probes))

    @classmethod
    def from_config(cls, cfg: PipelineConfig, review: ReviewSink | None = None) -> OutputPipeline:
        """Import and build every configured plugin once (one instance shared by domains)."""
        return cls(cfg, {name: build_plugin(spec) for name, spec in cfg.plugins.items()}, review)

    def run(self, text: str, context: OutputContext) -> OutputResult:
        domain = context.domain or "default"
        chain = self._chains.get(domain)
        if chain is None:
            raise InvalidInput(f"unknown domain {domain!r}", reason="UNKNOWN_DOMAIN",
                               metadata={"rule": "domain", "domain": domain})
        for name, proc in chain.processors:
            try:
                text = proc.process(text)
            except Exception as exc:
                raise Fatal(f"output processor {name!r} failed: {exc!r}") from exc
            if not isinstance(text, str):
                raise Fatal(f"output processor {name!r} returned {type(text).__name__}, not str")
        report = chain.probes.measure(text, context.token_entropies)
        ctx = replace(context, domain=domain, probes=report)
        verdicts = [v for spec, plugin in chain.validators
                    if (v := self._validate(spec, plugin, text, ctx)) is not None]
        blocked = any(v.blocking for v in verdicts)
        low = chain.probes.low_confidence(report)
        flags = (["blocked"] if blocked else []) + (["low_confidence_output"] if low else [])
        review_id = None
        if flags and self._review is not None:
            review_id = self._review(self._review_record(text, ctx, verdicts, report.values, flags))
        failed = {v.plugin for v in verdicts}
        passed = tuple((spec.name, spec.blocks) for spec, _ in chain.validators if spec.name not in failed)
        return OutputResult(text, blocked, verdicts, dict(report.values), low, review_id, flags, passed)

    @staticmethod
    def _validate(spec: PluginSpec, plugin: OutputValidator, text: str,
                  ctx: OutputContext) -> Verdict | None:
        try:
            verdict = plugin.validate(text, ctx)
        except Exception as exc:  # noqa: BLE001 - a broken check must fail closed, not pass
            verdict = Verdict(f"validator raised {exc!r}", details={"error": type(exc).__name__})
        if verdict is not None and not isinstance(verdict, Verdict):
            verdict = Verdict(f"validator returned {type(verdict).__name__}, not Verdict")
        if verdict is None:
            return None
        return replace(verdict, plugin=spec.name, blocking=spec.blocks)

    @staticmethod
    def _review_record(text: str, ctx: OutputContext, verdicts: list[Verdict],
                       probes: dict[str, float | bool], flags: list[str]) -> QuarantineRecord:
        blocking = [v for v in verdicts if v.blocking]
        if blocking:
            reason, rule, message = "OUTPUT_BLOCKED", blocking[0].plugin, blocking[0].message
        else:
            reason, rule = "LOW_CONFIDENCE_OUTPUT", "probes.low_confidence"
            message = "entropy, term overlap and disclaimer all below their thresholds"
        return QuarantineRecord(
            kind="output", reason=reason, rule=rule, trace_id=ctx.trace_id, source=ctx.source,
            domain=ctx.domain, payload={"prompt": ctx.prompt, "output": text,
                                        "verdicts": [[v.plugin, v.message] for v in verdicts]},
            message=message, flags=tuple(flags), probes=dict(probes))
