"""Input contracts (JSON Schema per input source) and the per-domain semantic rules.

A contract is ``config/contracts/<source>.schema.json`` (JSON Schema 2020-12). All of them are
loaded and compiled once by :meth:`InputChecker.from_config`; they may ``$ref`` each other by
``$id`` (``finance-cn`` refines ``default``). A request whose source has no contract of its own
is checked against ``default``.

Three deliberate departures from stock ``jsonschema``, because the payload comes from
protobuf/JSON where they matter: ``number`` excludes NaN and infinities (a NaN temperature
would pass every ``minimum``/``maximum``); ``integer`` excludes floats such as ``3.0`` and
booleans, so the types downstream code gets are the types the schema names; and ``$`` in a
``pattern`` means end of string as in ECMA-262 (the regex dialect JSON Schema specifies),
where Python's ``$`` also matches before a final newline, letting ``"finance\n"`` pass
``^[a-z-]+$``.

:meth:`InputChecker.check` never raises on a bad payload: it returns an :class:`InputVerdict`;
the servicer quarantines it and raises :meth:`InputVerdict.error` when it is a rejection.
"""
from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError, best_match
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from services.validator.cpu_budget import CpuBudget, CpuBudgetExceeded
from services.validator.domains import DomainConfig
from services.validator.rules import CompiledRules, RequestText
from shared.errors import INPUT_CHECK_BUDGET_EXCEEDED, InvalidInput

DEFAULT = "default"
_MESSAGE_LIMIT = 240


def _is_number(_checker: Any, value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int)


def _is_integer(_checker: Any, value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def ecma_to_python(pattern: str) -> str:
    """Rewrite each ``$`` anchor (unescaped, outside a character class) as ``\\Z``."""
    out, in_class, i = [], False, 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if ch == "[" and not in_class:
            in_class = True
        elif ch == "]" and in_class:
            in_class = False
        out.append("\\Z" if ch == "$" and not in_class else ch)
        i += 1
    return "".join(out)


@functools.lru_cache(maxsize=512)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(ecma_to_python(pattern))


def _pattern(validator: Any, pattern: str, instance: Any, _schema: Any):
    if validator.is_type(instance, "string") and not _compiled(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    validators={"pattern": _pattern},
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine_many(
        {"number": _is_number, "integer": _is_integer}),
)


@dataclass(frozen=True)
class InputVerdict:
    """Outcome of checking one request. ``accepted`` with ``flags`` means it may proceed but is
    flagged (``rule``/``reason``/``message`` then describe the first flag)."""

    accepted: bool
    flags: list[str] = field(default_factory=list)
    rule: str | None = None
    reason: str | None = None
    message: str = ""
    contract: str = DEFAULT
    domain: str = DEFAULT
    path: str | None = None   # JSON path of the offending field, for contract failures

    @property
    def needs_quarantine(self) -> bool:
        """Rejected and flagged inputs both go to the quarantine stream."""
        return not self.accepted or bool(self.flags)

    def error(self) -> InvalidInput:
        """The InvalidInput to raise for a rejection (metadata carries the rule)."""
        if self.accepted:
            raise ValueError("an accepted verdict has no error")
        meta = {"rule": self.rule or "", "contract": self.contract, "domain": self.domain}
        if self.path is not None:
            meta["field"] = self.path
        return InvalidInput(self.message, reason=self.reason or "CONTRACT_VIOLATION", metadata=meta)


def _clip(text: str) -> str:
    return text if len(text) <= _MESSAGE_LIMIT else text[:_MESSAGE_LIMIT - 1] + "…"


def load_contracts(contracts_dir: Path) -> dict[str, Any]:
    """``{source: compiled validator}`` for every ``*.schema.json`` in ``contracts_dir``.
    Raises ValueError at startup for a missing ``default``, bad JSON or an invalid schema."""
    files = sorted(Path(contracts_dir).glob("*.schema.json"))
    schemas: dict[str, dict] = {}
    for path in files:
        try:
            schema = json.loads(path.read_text("utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"contract {path}: {exc}") from exc
        try:
            _Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"contract {path}: invalid schema: {exc.message}") from exc
        schemas[path.name.removesuffix(".schema.json")] = schema
    if DEFAULT not in schemas:
        raise ValueError(f"{contracts_dir} has no {DEFAULT}.schema.json")
    resources = [(s["$id"], Resource.from_contents(s, default_specification=DRAFT202012))
                 for s in schemas.values() if "$id" in s]
    registry = Registry().with_resources(resources)
    return {name: _Validator(schema, registry=registry,
                             format_checker=_Validator.FORMAT_CHECKER)
            for name, schema in schemas.items()}


class InputChecker:
    """Contract + semantic checks for gateway requests. Thread-safe (holds no mutable state).

    ``cpu_budget_s`` bounds the CPU time one :meth:`check_json` may use (None: unbounded); an
    input that exhausts it is refused with reason INPUT_CHECK_BUDGET_EXCEEDED."""

    def __init__(self, contracts: Mapping[str, Any], domains: Mapping[str, DomainConfig],
                 cpu_budget_s: float | None = None):
        if DEFAULT not in contracts or DEFAULT not in domains:
            raise ValueError("InputChecker needs a 'default' contract and a 'default' domain")
        self._contracts = dict(contracts)
        self._rules = {name: CompiledRules(d) for name, d in domains.items()}
        self._cpu_budget_s = cpu_budget_s

    @classmethod
    def from_config(cls, contracts_dir: Path, domains: Mapping[str, DomainConfig | Mapping],
                    cpu_budget_s: float | None = None) -> InputChecker:
        """Load and compile every contract once; ``domains`` maps tag -> DomainConfig (raw
        mappings are parsed with :meth:`DomainConfig.from_dict`)."""
        parsed = {name: d if isinstance(d, DomainConfig) else DomainConfig.from_dict(name, d)
                  for name, d in domains.items()}
        return cls(load_contracts(contracts_dir), parsed, cpu_budget_s)

    @property
    def sources(self) -> list[str]:
        return sorted(self._contracts)

    def check(self, payload: Any, *, source: str, domain: str,
              budget: CpuBudget | None = None) -> InputVerdict:
        contract = source if source in self._contracts else DEFAULT
        domain = domain or DEFAULT
        budget = budget or CpuBudget(self._cpu_budget_s)
        try:
            return self._check(payload, contract, domain, budget)
        except CpuBudgetExceeded as exc:
            return InputVerdict(False, rule="cpu_budget", reason=INPUT_CHECK_BUDGET_EXCEEDED,
                                message=_clip(str(exc)), contract=contract, domain=domain)

    def _check(self, payload: Any, contract: str, domain: str, budget: CpuBudget) -> InputVerdict:
        if domain not in self._rules:
            return InputVerdict(False, rule="domain", reason="UNKNOWN_DOMAIN",
                                message=_clip(f"unknown domain {domain!r}; known: "
                                              f"{sorted(self._rules)}"),
                                contract=contract, domain=domain)
        rejected = self._check_contract(payload, contract, domain)
        if rejected is not None:
            return rejected
        budget.charge("the contract")
        failures = self._rules[domain].failures(RequestText.of(payload), budget)
        if not failures:
            return InputVerdict(True, contract=contract, domain=domain)
        first = failures[0]
        flags = list(dict.fromkeys(f.rule.flag for f in failures if f.rule.action == "flag"))
        return InputVerdict(first.rule.action != "reject", flags=flags,
                            rule=f"{domain}.{first.rule.name}", reason=first.rule.reason,
                            message=_clip(first.message), contract=contract, domain=domain)

    def check_json(self, payload_json: str, *, source: str, domain: str
                   ) -> tuple[Any, InputVerdict]:
        """Parse ``payload_json`` (what ValidateInputRequest carries) and check it. Returns the
        payload to quarantine (``{"$raw": text}`` when it is not JSON) and the verdict. The CPU
        budget counts from here, parsing included."""
        budget = CpuBudget(self._cpu_budget_s)
        try:
            payload = json.loads(payload_json)
        except (ValueError, RecursionError) as exc:
            contract = source if source in self._contracts else DEFAULT
            return {"$raw": payload_json[:65536]}, InputVerdict(
                False, rule=f"contract.{contract}.json", reason="CONTRACT_VIOLATION",
                message=_clip(f"payload is not JSON: {exc}"), contract=contract,
                domain=domain or DEFAULT, path="")
        return payload, self.check(payload, source=source, domain=domain, budget=budget)

    def _check_contract(self, payload: Any, contract: str, domain: str) -> InputVerdict | None:
        rule = f"contract.{contract}"
        if not isinstance(payload, Mapping):
            return InputVerdict(False, rule=rule, reason="CONTRACT_VIOLATION",
                                message=f"payload must be an object, got {type(payload).__name__}",
                                contract=contract, domain=domain, path="")
        error = best_match(self._contracts[contract].iter_errors(payload))
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path)
        return InputVerdict(False, rule=f"{rule}.{error.validator}", reason="CONTRACT_VIOLATION",
                            message=_clip(f"{where or '(root)'}: {error.message}"),
                            contract=contract, domain=domain, path=where)
