"""A forced tool call decoded by the engine under the gateway's grammar of a chat template's format
(ResponseFormat kind "lark", services/gateway/toolformats.py): whatever the tiny model samples, the
answer reads back as calls whose arguments validate against the function's schema."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import pytest_asyncio

from services.gateway import tools
from services.gateway.tools import Tool, Toolbox
from services.inference.engine.grammar import Vocabulary
from shared import toolformat
from shared.controls import Controls, ResponseFormat
from shared.errors import InvalidInput
from shared.modelfile import source as model_source
from tests.inference.helpers import collect, ids, prompt, request

EOS = (2,)
TRIP = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome", "Lima"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}
FLAG = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"], "additionalProperties": False}
TOOLS = (Tool("trip", "Plan a trip", json.dumps(TRIP)), Tool("flag", "Set a flag", json.dumps(FLAG)))
SCHEMAS = {"trip": TRIP, "flag": FLAG}


@pytest_asyncio.fixture
async def engine(make_engine):
    e = await make_engine(eos_token_ids=EOS)
    e.install_vocabulary(Vocabulary(model_source().cache_dir / "hf-tokenizer" / "tokenizer.json", EOS))
    return e


@pytest.mark.asyncio
@pytest.mark.parametrize("fmt", [toolformat.HERMES, toolformat.LLAMA3, toolformat.MISTRAL])
async def test_a_forced_call_always_parses_and_validates(engine, fmt):
    boxes = [Toolbox(TOOLS, "required"), Toolbox(TOOLS, function="flag"), Toolbox(TOOLS, "required", parallel=False)]
    reqs = [request(f"t{i}", prompt(i), max_tokens=200, temperature=1.0, seed=i,
                    controls=Controls(response_format=tools.answer_format(boxes[i % len(boxes)], fmt)))
            for i in range(6)]
    results = await asyncio.gather(*(collect(engine, r) for r in reqs))
    for i, (tokens, fin) in enumerate(results):
        text = b"".join(engine.vocabulary.token_bytes[t] for t in ids(tokens)).decode("utf-8")
        assert fin.finish_reason == "stop", text
        reply = tools.parse(text, fmt)
        assert reply is not None and reply.calls, text
        box = boxes[i % len(boxes)]
        parallel = fmt in (toolformat.HERMES, toolformat.MISTRAL) and box.parallel and not box.function
        assert len(reply.calls) == 1 or parallel
        for call in reply.calls:
            assert not box.function or call.name == box.function
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.asyncio
async def test_a_lark_grammar_that_does_not_compile_is_refused_with_a_reason(engine):
    with pytest.raises(InvalidInput) as err:
        await collect(engine, request("b", prompt(1), controls=Controls(response_format=ResponseFormat(
            "lark", "start: undefined_rule\n"))))
    assert err.value.reason == "RESPONSE_FORMAT_INVALID" and err.value.metadata["field"] == "response_format.lark"
