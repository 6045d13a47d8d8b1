"""Built-in output plugins. Each is configured by dotted path, e.g.
``services.validator.builtins:RequiredTerms`` with ``args: {terms: [LPR, MLF, SLF]}``.

Validators return ``None`` when the output passes, a :class:`Verdict` when it fails. Text
matching uses the probe report's normalised text (NFKC, casefolded), so ``ｌｐｒ`` counts as LPR.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

import jsonschema

from services.validator.linear import compile_linear
from services.validator.plugins import OutputContext, Verdict
from services.validator.text import normalise, term_regex
from shared import modelcard, modelfile


def _normalised(output: str, context: OutputContext) -> str:
    report = context.probes
    return report.normalised if report is not None else normalise(output)


class EmptyOutput:
    """Fails when the answer to a conversation is empty or whitespace only. A raw text's
    continuation may end at once (the model judged the text complete): that passes."""

    def validate(self, output: str, context: OutputContext) -> Verdict | None:
        return None if output.strip() or context.continuation else Verdict("output is empty")


class LengthLimit:
    """Fails when the output has fewer than ``min_chars`` or more than ``max_chars``
    characters (whitespace excluded from the count)."""

    def __init__(self, min_chars: int = 0, max_chars: int | None = None):
        if min_chars < 0 or (max_chars is not None and max_chars < min_chars):
            raise ValueError(f"LengthLimit: need 0 <= min_chars <= max_chars, got "
                             f"{min_chars}, {max_chars}")
        self.min_chars, self.max_chars = min_chars, max_chars

    def validate(self, output: str, context: OutputContext) -> Verdict | None:
        n = len("".join(output.split()))
        if n < self.min_chars:
            return Verdict(f"output has {n} characters, fewer than {self.min_chars}",
                           details={"chars": n})
        if self.max_chars is not None and n > self.max_chars:
            return Verdict(f"output has {n} characters, more than {self.max_chars}",
                           details={"chars": n})
        return None


class RequiredTerms:
    """Fails unless at least ``min_count`` of ``terms`` occur (ASCII terms as whole words)."""

    def __init__(self, terms: Sequence[str], min_count: int = 1):
        if not terms or not 1 <= min_count <= len(terms):
            raise ValueError("RequiredTerms: need terms and 1 <= min_count <= len(terms)")
        self.terms = tuple(terms)
        self.min_count = min_count
        self._regex = [re.compile(term_regex(t)) for t in self.terms]

    def validate(self, output: str, context: OutputContext) -> Verdict | None:
        norm = _normalised(output, context)
        found = [t for t, r in zip(self.terms, self._regex) if r.search(norm)]
        if len(found) >= self.min_count:
            return None
        return Verdict(f"output names {len(found)} of the required terms {list(self.terms)}; "
                       f"at least {self.min_count} needed", details={"found": found})


class DisclaimerPresence:
    """Fails when no disclaimer occurs: ``patterns`` (RE2 regexes) if given, else the domain's
    configured disclaimers as measured by the probes."""

    def __init__(self, patterns: Sequence[str] | None = None):
        self._regex = [compile_linear(p, dot_all=False, ignore_case=True) for p in patterns or ()]

    def validate(self, output: str, context: OutputContext) -> Verdict | None:
        if self._regex:
            norm = _normalised(output, context)
            present = any(r.search(norm) for r in self._regex)
        else:
            present = bool(context.probes is not None and context.probes.values["disclaimer"])
        return None if present else Verdict("output carries no disclaimer")


class ForbiddenPatterns:
    """Fails when any pattern matches. ``patterns`` maps a name to an RE2 regex (or is a list of
    them, named by themselves); the verdict names every pattern that matched."""

    def __init__(self, patterns: Mapping[str, str] | Sequence[str]):
        items = patterns.items() if isinstance(patterns, Mapping) else ((p, p) for p in patterns)
        self._regex = {name: compile_linear(p, dot_all=False, ignore_case=True) for name, p in items}
        if not self._regex:
            raise ValueError("ForbiddenPatterns: no patterns")

    def validate(self, output: str, context: OutputContext) -> Verdict | None:
        norm = _normalised(output, context)
        hits = [name for name, r in self._regex.items() if r.search(norm)]
        return Verdict(f"output matches forbidden pattern(s) {hits}", details={"matched": hits}
                       ) if hits else None


class NoContradiction:
    """Fails when the contradiction probe found an antonym pair (e.g. 上涨 and 下跌)."""

    def validate(self, output: str, context: OutputContext) -> Verdict | None:
        pairs = context.probes.contradictions if context.probes is not None else ()
        if not pairs:
            return None
        return Verdict("output asserts both sides of " + ", ".join(f"{a}/{b}" for a, b in pairs),
                       details={"pairs": [list(p) for p in pairs]})


class StripSpecialTokens:
    """Removes chat-template markers that leaked into the generated text: `tokens`, or (None) the
    served model's special and control tokens (shared/modelcard.py), read once when the plugin is made."""

    def __init__(self, tokens: Sequence[str] | None = None):
        if tokens is None:
            tokens = tuple(modelcard.read(modelfile.source()).special_tokens)
        # longest first, so a marker that contains another is removed whole
        tokens = sorted(tokens, key=len, reverse=True)
        self._regex = re.compile("|".join(re.escape(t) for t in tokens)) if tokens else None

    def process(self, text: str) -> str:
        return self._regex.sub("", text) if self._regex else text


class NormalizeWhitespace:
    """Trims the ends, strips trailing spaces per line and collapses 3+ newlines to 2."""

    _blank_runs = re.compile(r"\n{3,}")

    def process(self, text: str) -> str:
        lines = "\n".join(line.rstrip() for line in text.strip().splitlines())
        return self._blank_runs.sub("\n\n", lines)


class JsonSchemaOutput:
    """Fails ("format_error") unless the output is JSON that validates against the JSON Schema the
    request constrained its answer to (draft 2020-12); passes when the request had none."""

    def validate(self, output: str, context: OutputContext) -> Verdict | None:
        if not context.json_schema:
            return None
        try:
            schema = json.loads(context.json_schema)
            jsonschema.validate(json.loads(output), schema, cls=jsonschema.Draft202012Validator)
        except json.JSONDecodeError as exc:
            return Verdict(f"format_error: not JSON: {exc.msg} at {exc.pos}", details={"error": "format_error"})
        except jsonschema.ValidationError as exc:
            return Verdict(f"format_error: {exc.message[:200]}", details={"error": "format_error"})
        except jsonschema.SchemaError as exc:
            return Verdict(f"format_error: the schema is invalid: {exc.message[:200]}",
                           details={"error": "format_error"})
        return None
