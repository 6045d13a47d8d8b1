"""The gateway request built from an OpenAI body: every field lands on its gRPC control, and what
the gRPC API cannot express is refused naming the field (never sent on silently changed)."""
from __future__ import annotations

import json

import pytest

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2
from services.openai import convert
from services.openai.schemas import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody, parse
from shared import errors
from shared.modelfile import model_id

MODEL_ID = model_id()  # the served model's name (shared/modelfile.py)


def chat(**fields):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], **fields}
    return convert.chat_request(parse(ChatBody, body))


def completions(**fields):
    return convert.completion_requests(parse(CompletionBody, {"model": MODEL_ID, "prompt": "hi", **fields}))


def completion(**fields):
    (req,) = completions(**fields)
    return req


def refused(fn, **fields) -> errors.InvalidInput:
    with pytest.raises(errors.InvalidInput) as exc:
        fn(**fields)
    return exc.value


def test_sampling_fields_map_onto_the_grpc_controls():
    req = chat(max_tokens=7, temperature=0.5, top_p=0.9, seed=42, stop=["\n", "END"], frequency_penalty=0.25,
               presence_penalty=-0.5, logprobs=True, top_logprobs=3)
    s = req.sampling
    assert (s.max_tokens, s.temperature, round(s.top_p, 6), s.seed) == (7, 0.5, 0.9, 42)
    assert list(s.stop) == ["\n", "END"]
    assert (s.frequency_penalty, s.presence_penalty, s.logprobs, s.top_logprobs) == (0.25, -0.5, True, 3)
    assert req.adapter == ""  # the base model's name selects no adapter
    s = chat(min_tokens=4, ignore_eos=True).sampling  # vLLM's extensions
    assert (s.min_tokens, s.ignore_eos) == (4, True)


def test_absent_fields_take_openai_defaults_and_the_gateway_default_length():
    s = chat().sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.HasField("seed"), list(s.stop)) == (0, 1.0, 1.0, False, [])
    assert not s.logprobs and s.top_logprobs == 0


def test_null_means_the_default():
    s = chat(temperature=None, stop=None, n=None, logprobs=None, stream=None, max_tokens=None).sampling
    assert (s.temperature, list(s.stop), s.logprobs, s.max_tokens) == (1.0, [], False, 0)


def test_a_single_stop_string_and_max_completion_tokens():
    req = chat(stop="###", max_completion_tokens=9)
    assert list(req.sampling.stop) == ["###"] and req.sampling.max_tokens == 9
    assert chat(max_tokens=9, max_completion_tokens=9).sampling.max_tokens == 9
    assert refused(chat, max_tokens=8, max_completion_tokens=9).metadata["field"] == "max_tokens"


def test_messages_keep_their_order_roles_and_text_parts():
    req = convert.chat_request(parse(ChatBody, {"model": MODEL_ID, "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]}))
    assert [(m.role, m.content) for m in req.chat.messages] == [
        ("system", "be brief"), ("user", "two parts"), ("assistant", "ok"), ("user", "again")]


def test_response_format_json_object_is_the_object_schema():
    req = chat(response_format={"type": "json_object"})
    assert req.response_format.WhichOneof("format") == "json_schema"
    assert json.loads(req.response_format.json_schema) == {"type": "object"}


def test_response_format_json_schema_sends_its_schema():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    req = chat(response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}})
    assert json.loads(req.response_format.json_schema) == schema
    assert not chat(response_format={"type": "text"}).HasField("response_format")
    assert not chat().HasField("response_format")


def test_model_selects_the_adapter():
    assert chat(model="french@2").adapter == "french@2"
    assert chat(model="french").adapter == "french"
    assert convert.model_of("") == MODEL_ID and convert.model_of("french@2") == "french@2"


def test_completions_map_prompt_and_legacy_logprobs():
    req = completion(max_tokens=5, logprobs=2, seed=1)
    assert req.WhichOneof("input") == "text" and req.text == "hi"  # continued as it is: no chat template
    assert (req.sampling.max_tokens, req.sampling.logprobs, req.sampling.top_logprobs) == (5, True, 2)
    assert not req.sampling.echo and not req.sampling.HasField("prompt_logprobs")
    assert not completion().sampling.logprobs
    assert completion(prompt=["only one"]).text == "only one"


@pytest.mark.parametrize("fn,fields,field,reason", [
    (completion, {"max_tokens": 0}, "max_tokens", "MAX_TOKENS_INVALID"),  # 0 scores only with echo
    (completion, {"prompt": [[1, -1]]}, "prompt.0.1", "TOKEN_ID_OUT_OF_RANGE"),
    (completion, {"prompt": [[1, 2**32]]}, "prompt.0.1", "TOKEN_ID_OUT_OF_RANGE"),
    (chat, {"max_tokens": 0}, "max_tokens", "MAX_TOKENS_INVALID"),
    (chat, {"max_completion_tokens": -1}, "max_completion_tokens", "MAX_TOKENS_INVALID"),
    (chat, {"seed": -1}, "seed", "SEED_OUT_OF_RANGE"),
    (chat, {"top_p": 0}, "top_p", "TOP_P_OUT_OF_RANGE"),  # the proto's 0 is "unset": not served as 1
    (chat, {"store": True}, "store", "UNSUPPORTED_PARAMETER"),
    (completion, {"service_tier": "priority"}, "service_tier", "UNSUPPORTED_PARAMETER"),
])
def test_what_the_grpc_api_cannot_express_is_refused_naming_the_field(fn, fields, field, reason):
    err = refused(fn, **fields)
    assert (err.reason, err.metadata["field"]) == (reason, field)


def test_ignored_fields_change_nothing_sent():
    plain = chat()
    assert chat(metadata={"a": "b"}, store=False, user="u", service_tier="default",
                messages=[{"role": "user", "content": "hi", "name": "ann"}]) == plain
    req = chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                         {"role": "user", "content": "more"}])
    assert [(m.role, m.content) for m in req.chat.messages] == [("user", "hi"), ("assistant", ""), ("user", "more")]


def test_truncate_prompt_tokens_is_vllms_extension():
    assert chat(truncate_prompt_tokens=50).sampling.truncate_prompt_tokens == 50
    assert completion().sampling.truncate_prompt_tokens == 0  # absent: the prompt is never cut
    assert chat(truncate_prompt_tokens=-5).sampling.truncate_prompt_tokens == -5  # the gateway refuses it
    assert chat(truncate_prompt_tokens=10**12).sampling.truncate_prompt_tokens == 2**31 - 1


def test_the_cut_prompt_is_flagged_on_the_answer_and_the_closing_chunk():
    r = gateway_pb2.GenerateResponse(text="x", trace_id="t", finish_reason="stop", prompt_truncated=True)
    assert convert.answer(convert.Reply.start(True, "t"), [r], False)["prompt_truncated"] is True
    answer = convert.answer(convert.Reply.start(True, "t"), [gateway_pb2.GenerateResponse()], False)
    assert "prompt_truncated" not in answer
    shaper = convert.StreamShaper(convert.Reply.start(False, "t"), MODEL_ID, False, False)
    assert shaper.event(gateway_pb2.GenerateStreamResponse(done=r))[-1]["prompt_truncated"] is True


def test_values_beyond_the_wire_types_reach_the_gateway_as_out_of_range():
    """Too large for int32/uint64: sent as the largest value, which the gateway refuses with its reason."""
    s = chat(max_tokens=10**12, seed=2**70).sampling
    assert s.max_tokens == 2**31 - 1 and s.seed == 2**64 - 1


def tokenize(**fields):
    return convert.tokenize_request(parse(TokenizeBody, fields))


def test_tokenize_maps_vllms_two_shapes():
    req = tokenize(model=MODEL_ID, prompt="hi", add_special_tokens=True)
    assert req.WhichOneof("input") == "text" and req.text == "hi"
    req = tokenize(messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "be brief"), ("user", "hi")]
    assert req.add_generation_prompt  # vLLM's default
    assert not tokenize(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=False).add_generation_prompt
    weather = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    req = tokenize(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                                               "tool_calls": [call]},
                             {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}],
                   tools=[weather], tool_choice="required", parallel_tool_calls=False)
    assert [t.name for t in req.tools] == ["weather"] and req.tool_choice.mode == "required"
    assert req.HasField("parallel_tool_calls") and not req.parallel_tool_calls
    assert req.chat.messages[1].tool_calls[0].id == "call_1" and req.chat.messages[2].tool_call_id == "call_1"
    assert convert.tokenized(gateway_pb2.TokenizeResponse(token_ids=[5, 6], context_tokens=2048)) == {
        "count": 2, "max_model_len": 2048, "tokens": [5, 6], "token_strs": None}


@pytest.mark.parametrize("fields,field,reason", [
    ({"prompt": "hi", "return_token_strs": True}, "return_token_strs", "UNSUPPORTED_PARAMETER"),
    ({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, "continue_final_message",
     "UNSUPPORTED_PARAMETER"),
    ({"prompt": "hi", "chat_template": "{{x}}"}, "chat_template", "UNSUPPORTED_PARAMETER"),
    ({"prompt": "hi", "messages": []}, "(body)", "INVALID_BODY"),
    ({}, "(body)", "INVALID_BODY"),
    ({"prompt": 5}, "prompt", "INVALID_BODY"),
    ({"prompt": "hi", "tools": []}, "tools", "UNSUPPORTED_PARAMETER"),
])
def test_bad_tokenize_bodies_name_the_field(fields, field, reason):
    err = refused(tokenize, **fields)
    assert (err.reason, err.metadata["field"]) == (reason, field)


def test_detokenize_sends_the_ids_and_refuses_what_is_no_id():
    req = convert.detokenize_request(parse(DetokenizeBody, {"model": MODEL_ID, "tokens": [1, 2]}))
    assert list(req.token_ids) == [1, 2]
    assert convert.detokenized(gateway_pb2.DetokenizeResponse(text="hi")) == {"prompt": "hi"}
    for tokens, field, reason in (([1, -1], "tokens.1", "TOKEN_ID_OUT_OF_RANGE"), ([2**32], "tokens.0",
                                  "TOKEN_ID_OUT_OF_RANGE"), (["1"], "tokens.0", "INVALID_BODY")):
        with pytest.raises(errors.InvalidInput) as exc:
            convert.detokenize_request(parse(DetokenizeBody, {"tokens": tokens}))
        assert (exc.value.reason, exc.value.metadata["field"]) == (reason, field)


def test_each_of_openais_four_prompt_forms_is_one_request_per_prompt_in_order():
    assert [r.text for r in completions(prompt="a")] == ["a"]
    assert [r.text for r in completions(prompt=["a", "b"])] == ["a", "b"]
    assert [list(r.token_ids) for r in completions(prompt=[1, 2, 3])] == [[1, 2, 3]]
    reqs = completions(prompt=[[1, 2], [3]])
    assert [list(r.token_ids) for r in reqs] == [[1, 2], [3]] and all(r.WhichOneof("input") is None for r in reqs)


@pytest.mark.parametrize("prompt", [[], [1, "a"], [["a"]], 5, [[1.5]], [True]])
def test_a_prompt_of_no_form_is_invalid_body(prompt):
    assert refused(completion, prompt=prompt).reason == "INVALID_BODY"


def test_echo_with_logprobs_scores_the_prompt_with_as_many_alternatives():
    s = completion(echo=True, logprobs=3, max_tokens=1).sampling
    assert s.echo and s.prompt_logprobs == 3 and s.top_logprobs == 3
    assert not completion(echo=True, max_tokens=1).sampling.HasField("prompt_logprobs")  # echo alone: text only
    assert completion(prompt_logprobs=0, max_tokens=1).sampling.prompt_logprobs == 0  # vLLM's field, as asked
    assert chat(prompt_logprobs=2).sampling.prompt_logprobs == 2


def test_echo_with_max_tokens_0_generates_one_token_that_the_answer_leaves_out():
    body = parse(CompletionBody, {"model": MODEL_ID, "prompt": ["ab", "c"], "echo": True, "max_tokens": 0,
                                  "logprobs": 1})
    (a, b) = convert.completion_requests(body)
    assert convert.scoring_only(body) and a.sampling.max_tokens == 1 == b.sampling.max_tokens
    lp = common_pb2.TokenLogprob
    r = gateway_pb2.GenerateResponse(
        text="abX", finish_reason="length", usage=common_pb2.Usage(prompt_tokens=2, completion_tokens=1),
        prompt_logprobs=[lp(token="a", token_id=1), lp(token="b", token_id=2, logprob=-0.5, top_logprobs=[
            common_pb2.TopLogprob(token="b", token_id=2, logprob=-0.5)])],
        logprobs=[lp(token="X", token_id=9, logprob=-1.0)])
    r2 = gateway_pb2.GenerateResponse(text="cY", usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=1))
    out = convert.answer(convert.Reply.start(False, "t"), [r, r2], True, 1, ["ab", "c"])
    first = out["choices"][0]
    assert first["text"] == "ab" and out["choices"][1]["text"] == "c"
    assert first["logprobs"] == {"tokens": ["a", "b"], "token_logprobs": [None, -0.5],
                                 "top_logprobs": [None, {"b": -0.5}], "text_offset": [0, 1]}
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}


def test_echo_logprobs_run_on_from_the_prompt_into_the_answer():
    lp = common_pb2.TokenLogprob
    r = gateway_pb2.GenerateResponse(text="hi there", prompt_logprobs=[lp(token="hi", token_id=1),
                                                                       lp(token=" there", token_id=2, logprob=-2.0)],
                                     logprobs=[lp(token="!", token_id=3, logprob=-0.25)])
    got = convert.answer(convert.Reply.start(False, "t"), [r], True)["choices"][0]
    assert got["logprobs"]["tokens"] == ["hi", " there", "!"]
    assert got["logprobs"]["token_logprobs"] == [None, -2.0, -0.25]
    assert got["logprobs"]["text_offset"] == [0, 2, 8]
    assert got["prompt_logprobs"] == [None, {"2": {"logprob": -2.0, "rank": None, "decoded_token": " there"}}]


def test_usage_counts_each_prompt_once_and_every_choice():
    us = [common_pb2.Usage(prompt_tokens=p, completion_tokens=c) for p, c in ((4, 1), (4, 2), (7, 3), (7, 4))]
    assert convert.total_usage(us, 2) == {"prompt_tokens": 11, "completion_tokens": 10, "total_tokens": 21}
