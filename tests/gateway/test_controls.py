"""Generation controls at the gateway: the contract's checks of every new field, stop strings cut
on the decoded text (unary and streamed, across token boundaries), logprobs passed through."""
from __future__ import annotations

import pytest

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2
from services.gateway.contract import Limits, check_ask
from services.gateway.servicer import to_ask, to_response
from services.gateway.stops import StopText
from services.gateway.values import Call, Delta, Step
from shared import errors
from shared.controls import MAX_FORMAT_BYTES, Controls, ResponseFormat
from testing.upstreams import FakeUpstreams
from tests.gateway.test_pipeline import ask, pipeline

CALL = Call(1e12, "t" * 32)


def test_stop_text_holds_a_possible_start_and_releases_it_when_it_cannot_match():
    st = StopText(("END", "xy"))
    assert st.feed("abcE") == "abc"      # "E" may begin "END"
    assert st.feed("Nd") == "ENd"        # it did not
    assert st.feed("x") == ""            # may begin "xy"
    assert st.flush() == "x" and not st.cut


def test_stop_text_cuts_at_the_earliest_stop_split_over_pieces():
    st = StopText(("cd", "bcx"))
    assert st.feed("ab") == "a" and st.feed("c") == "" and st.feed("de") == "b"  # "ab" in all
    assert st.cut and st.feed("more") == "" and st.flush() == ""
    assert StopText(("zz",)).whole("no stop here") == "no stop here"
    assert StopText(("b", "ab")).whole("xxabc") == "xx"


class LogprobUpstreams(FakeUpstreams):
    async def generate(self, enc, ask, seed, timeout, md):
        async for ev in super().generate(enc, ask, seed, timeout, md):
            if isinstance(ev, Step) and ask.controls.logprobs:  # as the engine: only when asked
                ev = Step(ev.token_id, ev.entropy, common_pb2.TokenLogprob(token=chr(96 + ev.token_id),
                                                                          token_id=ev.token_id, logprob=-0.5))
            yield ev


@pytest.mark.asyncio
async def test_unary_answer_is_cut_before_the_stop_string_with_finish_stop():
    up = LogprobUpstreams(tokens=(2, 3, 4, 5))  # "b", "c", "d", "e"
    a = await pipeline(up).generate(ask(controls=Controls(stop=("cd",), logprobs=True)), CALL)
    assert a.text == "B" and a.finish_reason == "stop"  # the fake validator upper-cases
    assert [lp.token_id for lp in a.logprobs] == [2, 3, 4, 5]
    assert to_response(a).logprobs[0].token == "b"
    plain = await pipeline(LogprobUpstreams(tokens=(2, 3, 4, 5))).generate(ask(controls=Controls(stop=("zz",))), CALL)
    assert plain.text == "BCDE" and plain.finish_reason == "stop" and plain.logprobs == []


@pytest.mark.asyncio
async def test_stream_holds_back_a_stop_prefix_and_never_sends_the_stop_string():
    up = LogprobUpstreams(tokens=(2, 3, 4, 3, 5), paced=True)  # "b c d c e", one token per delta
    items = [x async for x in pipeline(up).stream(ask(controls=Controls(stop=("ce",), logprobs=True)), CALL)]
    deltas = [x for x in items if isinstance(x, Delta)]
    # "c" waited for "d"; the second "c" began "ce"; the tokens whose text never went out bring
    # their logprobs on a last, empty delta
    assert [d.text for d in deltas] == ["b", "cd", ""]
    assert [lp.token_id for d in deltas for lp in d.logprobs] == [2, 3, 4, 3, 5]
    assert items[-1].text == "BCD" and items[-1].finish_reason == "stop"


BAD = [
    (Controls(stop=("a", "b", "c", "d", "e")), "STOP_INVALID", "sampling.stop"),
    (Controls(stop=("",)), "STOP_INVALID", "sampling.stop"),
    (Controls(stop=("x" * 65,)), "STOP_INVALID", "sampling.stop"),
    (Controls(repetition_penalty=-1.0), "REPETITION_PENALTY_OUT_OF_RANGE", "sampling.repetition_penalty"),
    (Controls(repetition_penalty=2.5), "REPETITION_PENALTY_OUT_OF_RANGE", "sampling.repetition_penalty"),
    (Controls(repetition_penalty=float("nan")), "REPETITION_PENALTY_OUT_OF_RANGE", "sampling.repetition_penalty"),
    (Controls(frequency_penalty=2.5), "FREQUENCY_PENALTY_OUT_OF_RANGE", "sampling.frequency_penalty"),
    (Controls(frequency_penalty=float("inf")), "FREQUENCY_PENALTY_OUT_OF_RANGE", "sampling.frequency_penalty"),
    (Controls(presence_penalty=-2.01), "PRESENCE_PENALTY_OUT_OF_RANGE", "sampling.presence_penalty"),
    (Controls(logprobs=True, top_logprobs=6), "TOP_LOGPROBS_OUT_OF_RANGE", "sampling.top_logprobs"),
    (Controls(logprobs=True, top_logprobs=-1), "TOP_LOGPROBS_OUT_OF_RANGE", "sampling.top_logprobs"),
    (Controls(top_logprobs=2), "TOP_LOGPROBS_WITHOUT_LOGPROBS", "sampling.top_logprobs"),
    (Controls(response_format=ResponseFormat("choice")), "CHOICE_INVALID", "response_format.choice"),
    (Controls(response_format=ResponseFormat("choice", choices=("a", ""))), "CHOICE_INVALID", "response_format.choice"),
    (Controls(response_format=ResponseFormat("choice", choices=tuple("x" * 65))), "CHOICE_INVALID",
     "response_format.choice"),
    (Controls(response_format=ResponseFormat("json_schema", " " * (MAX_FORMAT_BYTES + 1))),
     "RESPONSE_FORMAT_TOO_LARGE", "response_format.json_schema"),
    (Controls(response_format=ResponseFormat("regex", "a" * (MAX_FORMAT_BYTES + 1))),
     "RESPONSE_FORMAT_TOO_LARGE", "response_format.regex"),
]


@pytest.mark.parametrize("controls, reason, field", BAD)
def test_every_bad_control_is_refused_with_its_reason_and_field(controls, reason, field):
    with pytest.raises(errors.InvalidInput) as err:
        check_ask(ask(controls=controls), Limits(max_context_tokens=2048))
    assert err.value.reason == reason and err.value.metadata["field"] == field


def test_the_proto_fields_map_onto_the_controls():
    req = gateway_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(
        stop=["\n\n"], repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=-0.5, logprobs=True,
        top_logprobs=3), response_format=common_pb2.ResponseFormat(choice=common_pb2.Choices(values=["a", "b"])))
    c = to_ask(req, Limits(max_context_tokens=2048)).controls
    assert c == Controls(stop=("\n\n",), repetition_penalty=pytest.approx(1.2), frequency_penalty=0.5,
                         presence_penalty=-0.5, logprobs=True, top_logprobs=3,
                         response_format=ResponseFormat("choice", choices=("a", "b")))
    assert to_ask(gateway_pb2.GenerateRequest(prompt="hi"), Limits(max_context_tokens=2048)).controls == Controls()
