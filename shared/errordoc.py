"""Finds every error reason the code can raise and writes docs/errors.md from shared/errors.py.

    python -m shared.errordoc > docs/errors.md

Reasons are found in the source (services/, shared/, keelctl/) as UPPER_SNAKE string constants
that flow into a reason: the ``reason=`` argument of any call, a positional argument in the
``reason`` slot of a local helper (``def bad(message, reason)``), a value assigned to a name that
contains "reason", and ``reason:`` keys of config/**/*.yaml. ErrorInfo metadata keys are the
constant keys of the ``metadata={...}`` dict at the same call (or of the helper's dict plus the
helper call's keyword names). Status codes and descriptions come from ``errors.REASONS``;
tests/contract/test_errors_doc.py fails when a found reason is not catalogued there, when a raise
site's exception class disagrees with the catalogue, or when docs/errors.md is stale.
"""
from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from shared import errors

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("services", "shared", "keelctl")
_REASON = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+|[A-Z]{4,}")
_CLASSES = {name: cls for name, cls in vars(errors).items()
            if isinstance(cls, type) and issubclass(cls, errors.KeelError)}


@dataclass
class Site:
    """Where a reason appears: file:line, the exception class when the call names one, metadata keys."""
    where: str
    cls: type[errors.KeelError] | None = None
    metadata: set[str] = field(default_factory=set)


# Reasons named once in shared/errors.py as module constants (``reason=errors.SEED_OUT_OF_RANGE``).
_NAMED = {name: value for name, value in vars(errors).items()
          if isinstance(value, str) and _REASON.fullmatch(name) and _REASON.fullmatch(value)}


def _constants(node: ast.AST) -> list[str]:
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and _REASON.fullmatch(n.value):
            out.append(n.value)
        elif isinstance(n, (ast.Name, ast.Attribute)) and (n.id if isinstance(n, ast.Name) else n.attr) in _NAMED:
            out.append(_NAMED[n.id if isinstance(n, ast.Name) else n.attr])
    return out


def _class_of(call: ast.Call) -> type[errors.KeelError] | None:
    f = call.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    return _CLASSES.get(name)


def _dict_keys(node: ast.AST | None) -> set[str]:
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return set()


def _helpers(tree: ast.AST) -> dict[str, tuple[int, Site]]:
    """Local functions with a ``reason`` parameter: name -> (its index, what their body raises)."""
    out = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [a.arg for a in fn.args.args]
            if "reason" in names:
                site = Site("")
                for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call) and _class_of(n)):
                    site.cls = _class_of(call)
                    meta = next((k.value for k in call.keywords if k.arg == "metadata"), None)
                    site.metadata |= _dict_keys(meta)
                out[fn.name] = (names.index("reason") - (1 if names[0] in ("self", "cls") else 0), site)
    return out


def scan_file(path: Path, rel: str) -> dict[str, list[Site]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
    helpers = _helpers(tree)
    found: dict[str, list[Site]] = {}

    def add(reasons: list[str], site: Site) -> None:
        for r in reasons:
            found.setdefault(r, []).append(site)

    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Call):
            kw = {k.arg: k.value for k in node.keywords}
            cls = _class_of(node)
            if "reason" in kw:
                add(_constants(kw["reason"]), Site(where, cls, _dict_keys(kw.get("metadata"))))
            elif cls is not None and not node.args[1:]:
                add([cls.default_reason], Site(where, cls, _dict_keys(kw.get("metadata"))))
            name = node.func.id if isinstance(node.func, ast.Name) else ""
            if name in helpers:
                index, helper = helpers[name]
                if index < len(node.args):
                    extra = {k for k in kw if k is not None}
                    add(_constants(node.args[index]), Site(where, helper.cls, helper.metadata | extra))
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                         and isinstance(node.value, ast.Tuple) else [(target, node.value)])
                for t, v in pairs:
                    if isinstance(t, ast.Name) and "reason" in t.id.lower():
                        add(_constants(v), Site(where))
    return found


def scan(root: Path = ROOT) -> dict[str, list[Site]]:
    """Every reason found under ``root``, with the sites that raise it."""
    found: dict[str, list[Site]] = {}
    for d in SOURCE_DIRS:
        for path in sorted((root / d).rglob("*.py")):
            rel = str(path.relative_to(root))
            if rel == "shared/errordoc.py":
                continue
            for reason, sites in scan_file(path, rel).items():
                found.setdefault(reason, []).extend(sites)
    for path in sorted((root / "config").rglob("*.yaml")):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = re.match(r"\s*-?\s*reason:\s*['\"]?([A-Z][A-Z0-9_]*)", line)
            if m:
                found.setdefault(m.group(1), []).append(Site(f"{path.relative_to(root)}:{i}"))
    return found


def _stages(sites: list[Site]) -> str:
    parts = sorted({s.where.split("/")[1] if s.where.startswith("services/") else s.where.split("/")[0]
                    for s in sites})
    return ", ".join(parts)


def _retry(entry: errors.Reason | None) -> str:
    if entry is None or entry.cls is None or not issubclass(entry.cls, errors.Recoverable):
        return "no"
    return "with more time" if issubclass(entry.cls, errors.DeadlineExpired) else "if RetryInfo"


def render(found: dict[str, list[Site]]) -> str:
    lines = [
        "# Keel's error reasons",
        "",
        "Generated by `python -m shared.errordoc > docs/errors.md` from `shared/errors.py` (the",
        "catalogue `REASONS`) and the raise sites in the code; `tests/contract/test_errors_doc.py`",
        "fails when this page is stale or a reason raised in code is missing from it.",
        "",
        "Every failed call carries a `google.rpc.Status` in the `grpc-status-details-bin` trailer with",
        f"a `google.rpc.ErrorInfo`: `domain` is always `{errors.DOMAIN}`, `reason` is one of the names",
        "below, `metadata` holds the keys listed (all values are strings). An UNAVAILABLE or",
        "RESOURCE_EXHAUSTED error may be retried only when it carries `google.rpc.RetryInfo` (and the",
        "`grpc-retry-pushback-ms` trailer): wait that long first (retry: `if RetryInfo`). A",
        "DEADLINE_EXCEEDED succeeds only with a longer deadline. Every reply carries the request's",
        "trace id in `x-keel-trace-id` (initial and trailing metadata).",
        "",
        "`raised by` names the stage(s) whose code raises the reason; the gateway passes a stage's",
        "error on to its client with the same code, reason and metadata. Reasons raised only at",
        "start-up (config, model and vocabulary files) stop a stage and never reach a client.",
        "",
        "| reason | gRPC status | retry | metadata keys | raised by | meaning |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for reason in sorted(set(found) | set(errors.REASONS)):
        entry = errors.REASONS.get(reason)
        code = entry.cls.code if entry and entry.cls else "-"
        keys = sorted(({k for s in found.get(reason, []) for k in s.metadata} | set(entry.metadata if entry else ()))
                      - errors.INTERNAL_METADATA_KEYS)
        meaning = entry.meaning if entry else "(not catalogued)"
        lines.append(f"| `{reason}` | {code} | {_retry(entry)} | {', '.join(f'`{k}`' for k in keys) or '-'} | "
                     f"{_stages(found.get(reason, [])) or '-'} | {meaning} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render(scan()))
