"""Quality probes: entropy, contradiction, disclaimer, term overlap, low_confidence."""
from __future__ import annotations

import itertools

import pytest

from services.validator.domains import ProbeConfig
from services.validator.probes import Probes, jaccard, mean_entropy
from services.validator.text import cjk_share, content_tokens

CFG = ProbeConfig(min_entropy=0.8, min_term_overlap=0.05,
                  terms=("LPR", "MLF", "降息"),
                  antonyms=(("上涨", "下跌"), ("increase", "decrease"), ("rise", "fall")),
                  disclaimers=("仅供参考", "not financial advice"))
PROBES = Probes(CFG)


def test_mean_entropy_ignores_broken_values():
    assert mean_entropy([1.0, 2.0, 3.0]) == (2.0, 3)
    assert mean_entropy([1.0, float("nan"), float("inf"), -1.0, 3.0]) == (2.0, 2)
    assert mean_entropy([]) == (0.0, 0)


def test_entropy_values_are_mean_nats_and_token_count():
    v = PROBES.measure("x", [0.5, 1.5]).values
    assert v["entropy_mean"] == 1.0 and v["entropy_tokens"] == 2.0
    assert "entropy_confidence" not in v
    empty = PROBES.measure("x", []).values
    assert (empty["entropy_mean"], empty["entropy_tokens"]) == (0.0, 0.0)


@pytest.mark.parametrize("text, pairs", [
    ("利率上涨，之后又下跌。", [("上涨", "下跌")]),
    ("Rates will increase. Later they decreased.", [("increase", "decrease")]),
    ("Prices are rising but will fall", [("rise", "fall")]),
    ("Prices RISE and FALLS", [("rise", "fall")]),
    ("利率上涨，rates increase", []),
    ("a fallacy about the sunrise", []),     # word boundaries: no inflection match inside words
    ("", []),
])
def test_contradiction_pairs(text, pairs):
    report = PROBES.measure(text, [1.0])
    assert list(report.contradictions) == pairs
    assert report.values["contradiction"] is bool(pairs)


@pytest.mark.parametrize("text, found", [
    ("以上内容仅供参考。", True), ("This is NOT FINANCIAL ADVICE.", True),
    ("Ｎｏｔ ｆｉｎａｎｃｉａｌ ａｄｖｉｃｅ", True), ("financial advice follows", False),
])
def test_disclaimer_detection(text, found):
    assert PROBES.measure(text, []).values["disclaimer"] is found


def test_term_overlap_is_jaccard_of_token_sets():
    library = content_tokens("LPR") | content_tokens("MLF") | content_tokens("降息")
    assert library == {"lpr", "mlf", "降息"}
    text = "LPR 降息 预期"
    tokens = content_tokens(text)
    assert tokens == {"lpr", "降息", "预期"}
    assert PROBES.measure(text, []).values["term_overlap"] == pytest.approx(2 / 4)
    assert PROBES.measure("nothing relevant", []).values["term_overlap"] == 0.0
    assert jaccard(set(), set()) == 0.0


def test_cjk_share_counts_letters_only():
    assert cjk_share("利率 rates") == pytest.approx(2 / 7)
    assert cjk_share("，。!? ") == 0.0
    assert cjk_share("降息") == 1.0


@pytest.mark.parametrize("varied, on_topic, disclaimer",
                         list(itertools.product([True, False], repeat=3)))
def test_low_confidence_only_when_all_three_signals_fail(varied, on_topic, disclaimer):
    text = ("LPR MLF 降息" if on_topic else "the weather is nice") + (
        " 仅供参考" if disclaimer else "")
    entropies = [2.5] * 5 if varied else [0.05] * 5
    report = PROBES.measure(text, entropies)
    assert PROBES.low_confidence(report) is not (varied or on_topic or disclaimer)


def test_collapsed_output_is_low_confidence_and_varied_one_is_not():
    # A model collapsed onto a template: near-certain tokens, off-topic, no disclaimer.
    collapsed = PROBES.measure("I am sorry. I am sorry. I am sorry.", [0.01] * 30)
    assert collapsed.values["entropy_mean"] < CFG.min_entropy
    assert PROBES.low_confidence(collapsed)
    varied = PROBES.measure("I am sorry. I am sorry. I am sorry.", [2.0] * 30)
    assert not PROBES.low_confidence(varied)


@pytest.mark.parametrize("entropies", [[0.8] * 4, [0.7, 0.9]])
def test_entropy_at_the_threshold_is_not_low(entropies):
    assert not PROBES.low_confidence(PROBES.measure("the weather is nice", entropies))


@pytest.mark.parametrize("entropies", [[], [float("nan"), -1.0, float("inf")]])
def test_no_usable_entropies_never_trip_the_entropy_signal(entropies):
    assert not PROBES.low_confidence(PROBES.measure("the weather is nice", entropies))


@pytest.mark.parametrize("min_entropy, min_term_overlap", [(0.8, 0.0), (0.0, 0.05)])
def test_zero_threshold_switches_the_rule_off(min_entropy, min_term_overlap):
    probes = Probes(ProbeConfig(min_entropy=min_entropy, min_term_overlap=min_term_overlap,
                                terms=("LPR",)))
    assert not probes.low_confidence(probes.measure("anything", [0.0] * 10))


def test_terms_file_is_read_relative_to_base_dir(tmp_path):
    (tmp_path / "t.txt").write_text("# comment\nLPR\n\n降准\nLPR\n", encoding="utf-8")
    cfg = ProbeConfig.from_dict({"terms": ["MLF"], "terms_file": "t.txt"}, "p", tmp_path)
    assert cfg.terms == ("MLF", "LPR", "降准")
    with pytest.raises(ValueError, match="does not exist"):
        ProbeConfig.from_dict({"terms_file": "missing.txt"}, "p", tmp_path)
    with pytest.raises(ValueError, match="pair"):
        ProbeConfig.from_dict({"antonyms": [["a", "b", "c"]]}, "p", tmp_path)
    with pytest.raises(ValueError, match="0..1"):
        ProbeConfig.from_dict({"min_term_overlap": 2}, "p", tmp_path)


def test_min_entropy_defaults_to_0_8_nats_and_rejects_bad_values(tmp_path):
    assert ProbeConfig.from_dict({}, "p", tmp_path).min_entropy == 0.8
    assert ProbeConfig.from_dict({"min_entropy": 3.5}, "p", tmp_path).min_entropy == 3.5
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="min_entropy"):
            ProbeConfig.from_dict({"min_entropy": bad}, "p", tmp_path)
