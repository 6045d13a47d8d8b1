"""The output pipeline with the shipped config: built-ins, probes, blocking, review hand-off."""
from __future__ import annotations

from pathlib import Path

import pytest

from services.validator.output_pipeline import OutputPipeline, PipelineConfig
from services.validator.plugins import OutputContext, Verdict
from shared.errors import Fatal, InvalidInput

ROOT = Path(__file__).resolve().parents[2]
CFG = PipelineConfig.load(ROOT / "config" / "validator" / "pipeline.yaml")
VARIED = [2.5] * 20      # healthy generation, well above min_entropy (0.8 nats)
COLLAPSED = [0.1] * 20   # near-certain tokens: collapsed onto a template
GOOD_FINANCE = "本月LPR维持3.45%不变，MLF操作利率亦未调整。以上内容仅供参考，不构成投资建议。"


@pytest.fixture
def reviewed():
    return []


@pytest.fixture
def pipe(reviewed):
    def sink(record):
        reviewed.append(record)
        return record.record_id
    return OutputPipeline.from_config(CFG, review=sink)


def run(pipe, text, domain="finance-cn", entropies=VARIED):
    return pipe.run(text, OutputContext(domain=domain, trace_id="t1", token_entropies=entropies,
                                        prompt="LPR?", source="web"))


def by_plugin(result) -> dict[str, Verdict]:
    return {v.plugin: v for v in result.verdicts}


def test_good_finance_answer_passes_everything(pipe, reviewed):
    result = run(pipe, GOOD_FINANCE)
    assert result.verdicts == [] and not result.blocked and not result.low_confidence
    assert result.probes["disclaimer"] is True and result.probes["term_overlap"] > 0.03
    assert reviewed == []


def test_finance_requires_terms_and_disclaimer_but_only_annotates(pipe):
    result = run(pipe, "今天天气很好，适合出门散步。")
    assert set(by_plugin(result)) == {"finance_terms", "disclaimer"}
    assert not result.blocked and not any(v.blocking for v in result.verdicts)
    # The default domain has neither requirement.
    assert run(pipe, "今天天气很好，适合出门散步。", domain="default").verdicts == []


def test_every_check_that_did_not_fail_is_listed_as_passed_with_its_blocking_flag(pipe):
    ran = {spec.name: spec.blocks for spec in (CFG.plugins[n] for n in CFG.domains["finance-cn"].validators)}
    assert dict(run(pipe, GOOD_FINANCE).passed_checks) == ran
    failed = run(pipe, "今天天气很好，适合出门散步。")
    assert dict(failed.passed_checks) == {n: b for n, b in ran.items() if n not in {"finance_terms", "disclaimer"}}


@pytest.mark.parametrize("text, plugin", [
    ("   \n ", "not_empty"),
    ("这只基金保证收益，稳赚不赔。LPR 仅供参考", "forbidden"),
    ("See <script>steal()</script> LPR 仅供参考", "forbidden"),
])
def test_blocking_validators_block_and_send_to_review(pipe, reviewed, text, plugin):
    result = run(pipe, text)
    assert result.blocked and by_plugin(result)[plugin].blocking
    assert reviewed and reviewed[-1].reason == "OUTPUT_BLOCKED" and reviewed[-1].rule == plugin
    assert reviewed[-1].kind == "output" and reviewed[-1].record_id == result.review_id


def test_length_limit_annotates(pipe):
    result = run(pipe, "LPR " + "很长" * 5000 + " 仅供参考")
    assert "length" in by_plugin(result) and not result.blocked


def test_contradiction_is_annotated_with_the_pair(pipe):
    result = run(pipe, "LPR 明天上涨，也可能下跌。仅供参考")
    assert result.probes["contradiction"] is True
    assert "上涨/下跌" in by_plugin(result)["consistent"].message


def test_processors_strip_leaked_markers_and_whitespace(pipe):
    result = run(pipe, "  LPR 不变<|im_end|>   \n\n\n\n仅供参考  ", domain="default")
    assert result.text == "LPR 不变\n\n仅供参考"


def test_low_confidence_output_goes_to_review_stream(pipe, reviewed):
    result = run(pipe, "The weather is fine and nothing else matters.", entropies=COLLAPSED)
    assert result.low_confidence and "low_confidence_output" in result.flags
    record = reviewed[-1]
    assert (record.kind, record.reason, record.trace_id, record.domain) == (
        "output", "LOW_CONFIDENCE_OUTPUT", "t1", "finance-cn")
    assert record.payload["output"] == result.text and record.payload["prompt"] == "LPR?"
    assert record.probes == result.probes
    # The same text with varied (high-entropy) tokens is not low-confidence.
    assert not run(pipe, "The weather is fine and nothing else matters.").low_confidence


def test_default_domain_never_low_confidence_with_overlap_switched_off(pipe):
    assert not run(pipe, "whatever", domain="default", entropies=COLLAPSED).low_confidence


def test_unknown_domain_is_invalid_input(pipe):
    with pytest.raises(InvalidInput) as exc:
        run(pipe, "x", domain="astrology")
    assert exc.value.reason == "UNKNOWN_DOMAIN"


class Exploding:
    def validate(self, output, context):
        raise RuntimeError("boom")


class WrongType:
    def validate(self, output, context):
        return "fine"


class BadProcessor:
    def process(self, text):
        return None


def _custom(validators, processors=()):
    plugins = {"boom": {"path": f"{__name__}:Exploding", "on_fail": "block"},
               "wrong": {"path": f"{__name__}:WrongType", "on_fail": "annotate"},
               "badproc": {"path": f"{__name__}:BadProcessor"}}
    return OutputPipeline.from_config(PipelineConfig.from_dict({"plugins": plugins, "domains": {
        "default": {"validators": validators, "processors": processors}}}))


def test_raising_validator_fails_closed():
    result = _custom(["boom"]).run("fine text", OutputContext())
    assert result.blocked and "boom" in result.verdicts[0].message
    result = _custom(["wrong"]).run("fine text", OutputContext())
    assert not result.blocked and "not Verdict" in result.verdicts[0].message


def test_processor_returning_non_text_is_fatal():
    with pytest.raises(Fatal, match="badproc"):
        _custom([], ["badproc"]).run("x", OutputContext())


def test_without_review_sink_results_still_carry_flags():
    pipe = OutputPipeline.from_config(CFG)
    result = run(pipe, "   ")
    assert result.blocked and result.review_id is None and result.flags == ["blocked"]


def test_an_empty_continuation_of_a_raw_text_passes_not_empty(pipe):
    ctx = OutputContext(domain="default", trace_id="t1", token_entropies=VARIED, prompt="def f():", continuation=True)
    assert "not_empty" not in by_plugin(pipe.run("  ", ctx)) and not pipe.run("", ctx).blocked
    assert pipe.run("", OutputContext(domain="default", trace_id="t1", token_entropies=VARIED)).blocked
