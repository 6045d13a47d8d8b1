"""Hostile texts for the validator's input rules (the tests' and bench/bench_hostile_input.py's):
unclosed delimiters of the configured rules and long runs after an opener, 32 KB each, and the
time one rule takes on one text."""
from __future__ import annotations

import time

from services.validator.domains import DomainConfig, InputRule
from services.validator.output_pipeline import PipelineConfig
from services.validator.rules import CompiledRules, RequestText
from shared.config import ROOT_DIR as ROOT

PIPELINE = PipelineConfig.load(ROOT / "config" / "validator" / "pipeline.yaml")
SIZE = 32 * 1024
PATTERN_RULES = {r.name: r for d in PIPELINE.domains.values() for r in d.input_rules if r.kind == "pattern"}
# Unclosed and nested delimiters of the configured rules, each repeated to 32 KB.
DELIMITERS = ["{{", "{%", "{{ {%", "{{{{}", "<", "< ", "</", "< /", "<|", "<| ", "<|im_", "ignore ",
              "ignore all the ", "忽略之前", "<\t/\n", " ", "\u200b<"]

# One opener, then a long run the rule's middle part can take in several ways.
OPENED = ["<" + " " * SIZE, "< /" + "\t" * SIZE, "{{" + "x" * SIZE, "{%" + "}" * SIZE, "<|" + " " * SIZE,
          "ignore " + " " * SIZE]


def fill(piece: str) -> str:
    return (piece * (SIZE // max(1, len(piece)) + 1))[:SIZE]


def cost_s(rule: InputRule, text: str) -> float:
    rules = CompiledRules(DomainConfig(name="probe", input_rules=(rule,)))
    start = time.perf_counter()
    rules.failures(RequestText(text, text))
    return time.perf_counter() - start
