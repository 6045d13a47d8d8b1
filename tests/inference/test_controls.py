"""Generation controls in the engine: penalties, logprobs, stop strings, response formats, and the
batch invariance of rows that use them (the tiny model over the real vocabulary)."""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import pytest_asyncio
import torch

from services.inference.engine.controls import RowControls, shape
from services.inference.engine.grammar import GrammarLimits, Grammars, MaskExecutor, Vocabulary, recursive_ref
from shared.controls import Controls, ResponseFormat
from shared.errors import InvalidInput
from shared.modelfile import source as model_source
from tests.inference.helpers import collect, ids, prompt, request
from tests.inference.schemas import SCHEMAS

EOS = (2,)


@pytest.fixture(scope="module")
def vocab():
    return Vocabulary(model_source().cache_dir / "hf-tokenizer" / "tokenizer.json", EOS)


@pytest_asyncio.fixture
async def engine(make_engine, vocab):
    e = await make_engine(eos_token_ids=EOS)
    e.install_vocabulary(vocab)
    return e


def text_of(vocab: Vocabulary, token_ids: list[int]) -> str:
    return b"".join(vocab.token_bytes[i] for i in token_ids).decode("utf-8", "replace")


def test_penalties_follow_their_definitions(vocab):
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    row = RowControls(Controls(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25), [0, 1], vocab)
    row.accept(3)
    row.accept(3)
    row.accept(4)
    # prompt and answer tokens divided (positive) or multiplied (negative) by 2; answer tokens
    # then lose 0.5 per occurrence and 0.25 once
    expected = torch.tensor([1.0, -2.0, 0.5, 1.5 - 1.0 - 0.25, -4.0 - 0.5 - 0.25])
    assert torch.equal(shape([row], logits[None], MaskExecutor(1)).scores[0], expected)
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0]))  # the batch's row is left alone


@pytest.mark.asyncio
async def test_logprobs_are_of_the_sampled_distribution_with_alternatives(engine):
    plain, _ = await collect(engine, request("p", prompt(1), max_tokens=6))
    tokens, _ = await collect(engine, request("l", prompt(1), max_tokens=6, controls=Controls(logprobs=True,
                                                                                              top_logprobs=5)))
    assert ids(tokens) == ids(plain)
    for t in tokens:
        lp = t.logprobs
        assert lp.token_id == t.token_id and lp.logprob == pytest.approx(t.logprob, abs=1e-5)  # greedy, unpenalised
        assert [a.token_id for a in lp.top][0] == t.token_id and len(lp.top) == 5
        assert [a.logprob for a in lp.top] == sorted((a.logprob for a in lp.top), reverse=True)
        assert lp.token == engine.vocabulary.text(t.token_id)
    hot, _ = await collect(engine, request("h", prompt(1), max_tokens=6, temperature=0.5, seed=3,
                                           controls=Controls(logprobs=True)))
    assert all(t.logprobs.logprob != pytest.approx(t.logprob, abs=1e-4) for t in hot)  # after temperature


@pytest.mark.asyncio
async def test_stop_string_split_over_two_tokens_ends_the_answer(engine, vocab):
    ref, _ = await collect(engine, request("r", prompt(4), max_tokens=12))
    out = ids(ref)
    k = next(i for i in range(2, 11) if vocab.token_bytes[out[i]] and vocab.token_bytes[out[i + 1]]
             and vocab.token_bytes[out[i]][-1] < 128 and vocab.token_bytes[out[i + 1]][0] < 128)
    stop = (vocab.token_bytes[out[k]][-1:] + vocab.token_bytes[out[k + 1]][:1]).decode()
    first = next(j for j in range(len(out)) if stop in text_of(vocab, out[:j + 1]))
    tokens, fin = await collect(engine, request("s", prompt(4), max_tokens=12, controls=Controls(stop=(stop,))))
    assert ids(tokens) == out[:first + 1] and first <= k + 1
    assert fin.finish_reason == "stop" and fin.completion_tokens == first + 1


@pytest.mark.asyncio
async def test_every_constrained_answer_parses_and_validates(engine):
    assert len(SCHEMAS) >= 20
    reqs = [request(f"j{i}", prompt(i), max_tokens=160, temperature=1.0, seed=i,
                    controls=Controls(response_format=ResponseFormat("json_schema", json.dumps(schema))))
            for i, schema in enumerate(SCHEMAS)]
    results = await asyncio.gather(*(collect(engine, r) for r in reqs))
    for schema, (tokens, fin) in zip(SCHEMAS, results):
        assert fin.finish_reason == "stop", schema
        jsonschema.validate(json.loads(text_of(engine.vocabulary, ids(tokens))), schema)


@pytest.mark.asyncio
async def test_regex_and_choice_constrain_the_answer(engine):
    regex = ResponseFormat("regex", r"[a-z]{2,4}-[0-9]{3}")
    choice = ResponseFormat("choice", choices=("yes", "no", "maybe not"))
    for i in range(4):
        tokens, fin = await collect(engine, request(f"r{i}", prompt(i), max_tokens=30, temperature=1.0, seed=i,
                                                    controls=Controls(response_format=regex)))
        assert re.fullmatch(r"[a-z]{2,4}-[0-9]{3}", text_of(engine.vocabulary, ids(tokens))), fin
        tokens, fin = await collect(engine, request(f"c{i}", prompt(i), max_tokens=30, temperature=1.0, seed=i,
                                                    controls=Controls(response_format=choice)))
        assert text_of(engine.vocabulary, ids(tokens)) in choice.choices and fin.finish_reason == "stop"


@pytest.mark.asyncio
async def test_bad_documents_are_refused_with_a_reason_and_hold_nobody_up(make_engine, vocab):
    engine = await make_engine(eos_token_ids=EOS)
    engine.install_vocabulary(vocab, GrammarLimits(compile_timeout_s=0))
    plain = asyncio.create_task(collect(engine, request("p", prompt(2), max_tokens=8)))
    for fmt, reason in ((ResponseFormat("regex", "(a"), "RESPONSE_FORMAT_TOO_COMPLEX"),):
        with pytest.raises(InvalidInput) as err:
            await collect(engine, request("b", prompt(1), controls=Controls(response_format=fmt)))
        assert err.value.reason == reason and err.value.metadata["field"] == "response_format.regex"
    tokens, fin = await plain
    assert fin.finish_reason == "length" and len(tokens) == 8
    engine.install_vocabulary(vocab)
    for fmt, field in ((ResponseFormat("regex", "(a"), "regex"), (ResponseFormat("json_schema", "{no"), "json_schema"),
                       (ResponseFormat("json_schema", '{"type": "frobnicate"}'), "json_schema"),
                       (ResponseFormat("json_schema", json.dumps(TREE)), "json_schema")):
        with pytest.raises(InvalidInput) as err:
            await collect(engine, request("b", prompt(1), controls=Controls(response_format=fmt)))
        assert err.value.reason == "RESPONSE_FORMAT_INVALID"
        assert err.value.metadata["field"] == f"response_format.{field}"
    assert "recursive" in err.value.message  # refused when compiled, not while decoding


# A tree node whose children are tree nodes: no finite answer is forced to end.
TREE = {"$defs": {"node": {"type": "object", "properties": {"children": {"type": "array",
                                                                          "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}


def testrecursive_refs_are_found_and_shared_ones_are_not():
    shared = {"type": "object", "$defs": {"name": {"type": "string"}},
              "properties": {"a": {"$ref": "#/$defs/name"}, "b": {"$ref": "#/$defs/name"}}}
    mutual = {"$defs": {"a": {"properties": {"b": {"$ref": "#/$defs/b"}}},
                        "b": {"properties": {"a": {"$ref": "#/$defs/a"}}}},
              "properties": {"x": {"$ref": "#/$defs/a"}}}
    root = {"type": "object", "properties": {"self": {"$ref": "#"}}}
    assert recursive_ref(TREE) == "#/$defs/node"
    assert recursive_ref(mutual) in ("#/$defs/a", "#/$defs/b")
    assert recursive_ref(root) == "#"
    assert recursive_ref(shared) is None
    assert recursive_ref({"$ref": "#/$defs/missing"}) is None  # the grammar engine says what is wrong


def mixed_controls(i: int) -> Controls:
    kind = i % 4
    if kind == 0:
        return Controls()
    if kind == 1:
        return Controls(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.4, logprobs=True,
                        top_logprobs=2)
    if kind == 2:
        return Controls(response_format=ResponseFormat("json_schema", json.dumps(SCHEMAS[i % len(SCHEMAS)])))
    return Controls(response_format=ResponseFormat("regex", r"[a-z ]{1,12}\."), frequency_penalty=1.0)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_mixed_rows_are_bit_identical_alone_and_in_batches(engine):
    reqs = [request(f"m{i}", prompt(i, 3 + i % 9), max_tokens=6, temperature=(i % 3) * 0.5, seed=i,
                    controls=mixed_controls(i)) for i in range(200)]
    alone = [await collect(engine, r) for r in reqs]
    together = []
    for start in range(0, 200, 16):
        together += await asyncio.gather(*(collect(engine, r) for r in reqs[start:start + 16]))
    same = sum(ids(a) == ids(b) and [t.logprobs for t in a] == [t.logprobs for t in b]
               and (fa.finish_reason, fa.completion_tokens) == (fb.finish_reason, fb.completion_tokens)
               for (a, fa), (b, fb) in zip(alone, together))
    assert same == 200


@pytest.mark.asyncio
async def test_a_compile_given_up_on_is_cached_once_done(vocab):
    grammars = Grammars(vocab, GrammarLimits(compile_timeout_s=0))
    fmt = ResponseFormat("regex", "[0-9]{2}")
    with pytest.raises(InvalidInput):
        await grammars.matcher(fmt)
    for _ in range(200):
        if fmt.digest in grammars._cache:
            break
        await asyncio.sleep(0.01)
    assert (await grammars.matcher(fmt)).consume_tokens(vocab.tokenizer.tokenize_str("42"))  # no wait any more
    grammars.close()
