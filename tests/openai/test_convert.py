"""The gateway request built from an OpenAI body: every field lands on its gRPC control, and what
the gRPC API cannot express is refused naming the field (never sent on silently changed)."""
from __future__ import annotations

import json

import pytest

from keel.gateway.v1 import gateway_pb2
from services.openai import convert
from services.openai.schemas import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody, parse
from shared import errors
from shared.modelfile import model_id

MODEL_ID = model_id()  # the served model's name (shared/modelfile.py)


def chat(**fields):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], **fields}
    return convert.chat_request(parse(ChatBody, body))


def completion(**fields):
    return convert.completion_request(parse(CompletionBody, {"model": MODEL_ID, "prompt": "hi", **fields}))


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
    assert req.WhichOneof("input") == "prompt" and req.prompt == "hi"
    assert (req.sampling.max_tokens, req.sampling.logprobs, req.sampling.top_logprobs) == (5, True, 2)
    assert not completion().sampling.logprobs
    assert completion(prompt=["only one"]).prompt == "only one"


@pytest.mark.parametrize("fn,fields,field,reason", [
    (completion, {"prompt": ["a", "b"]}, "prompt", "UNSUPPORTED_PARAMETER"),
    (completion, {"echo": True}, "echo", "UNSUPPORTED_PARAMETER"),
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
