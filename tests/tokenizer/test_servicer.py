"""The tokenizer servicer behind the stage's interceptor, over real gRPC on the real vocabulary:
protobuf <-> domain conversion of Encode and Decode, and the DecodeStream contract."""
from __future__ import annotations

import grpc
import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry

from keel.common.v1 import common_pb2
from keel.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.core import EncodeOptions
from services.tokenizer.servicer import TokenizerServicer
from shared import client, metrics
from shared.interceptor import ServerInterceptor
from shared.meshauth import HEADER as MESH_TOKEN_KEY

MESH = ((MESH_TOKEN_KEY, "s3cret"),)
EMOJI = "\U0001F600"


@pytest_asyncio.fixture
async def stub(tok):
    servicer = TokenizerServicer(TokenizerConfig(max_length=64), metrics.metrics_for("tokenizer", CollectorRegistry()))
    servicer.tok = tok
    srv = grpc.aio.server(interceptors=[ServerInterceptor("tokenizer", mesh_token="s3cret")])
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = tokenizer_pb2_grpc.TokenizerStub(ch)
    stub.channel = ch
    yield stub
    await ch.close()
    await srv.stop(None)


async def reason_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call
    return exc.value.code(), client.translate(exc.value).reason


async def exchange(stub, batches: list[list[int]], skip: bool = True) -> list[str]:
    """One DecodeStream: each batch in turn, the last with finish; the response text of each."""
    call = stub.DecodeStream(metadata=MESH)
    out = []
    for n, ids in enumerate(batches):
        await call.write(tokenizer_pb2.DecodeStreamRequest(ids=ids, skip_special_tokens=skip,
                                                           finish=n == len(batches) - 1))
        out.append((await call.read()).text)
    assert await call.read() is grpc.aio.EOF  # the stage ends the stream after finish
    return out


@pytest.mark.asyncio
async def test_encode_text_converts_every_field(stub, tok):
    resp = await stub.Encode(tokenizer_pb2.EncodeRequest(text="hello world".encode(), max_length=8,
                                                         pad_to_max_length=True), metadata=MESH)
    enc = tok.encode("hello world", EncodeOptions(max_length=8, pad_to_max_length=True))
    assert list(resp.input_ids) == enc.input_ids and list(resp.attention_mask) == enc.attention_mask
    assert list(resp.position_ids) == enc.position_ids and resp.fingerprint == enc.fingerprint
    assert len(resp.input_ids) == 8 and not resp.truncated and resp.original_length == enc.original_length


@pytest.mark.asyncio
async def test_encode_chat_renders_the_template_and_caps_max_length_at_the_stage_limit(stub, tok):
    chat = tokenizer_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", content="hi " * 100)],
                                   add_generation_prompt=True)
    resp = await stub.Encode(tokenizer_pb2.EncodeRequest(chat=chat, max_length=10_000), metadata=MESH)
    full = tok.encode(tok.render_chat([("user", "hi " * 100)], add_generation_prompt=True))
    assert resp.truncated and len(resp.input_ids) == 64 and resp.original_length == len(full.input_ids)
    assert list(resp.input_ids) == full.input_ids[-64:]  # left truncation keeps the end


@pytest.mark.asyncio
@pytest.mark.parametrize("request_,reason", [
    (tokenizer_pb2.EncodeRequest(text=b"x", max_length=-1), "MAX_LENGTH_OUT_OF_RANGE"),
    (tokenizer_pb2.EncodeRequest(text=b"x", pad_to_max_length=True), "MAX_LENGTH_REQUIRED"),
    (tokenizer_pb2.EncodeRequest(), "EMPTY_INPUT"),
    (tokenizer_pb2.EncodeRequest(text=b"\xff"), "INVALID_UTF8"),
])
async def test_encode_rejects_with_reason(stub, request_, reason):
    assert await reason_of(stub.Encode(request_, metadata=MESH)) == (grpc.StatusCode.INVALID_ARGUMENT, reason)


@pytest.mark.asyncio
async def test_decode_converts_and_honours_skip_special_tokens(stub, tok):
    ids = tok.encode_ids("hi".encode()) + [2]
    assert (await stub.Decode(tokenizer_pb2.DecodeRequest(ids=ids), metadata=MESH)).text == "hi<|im_end|>"
    assert (await stub.Decode(tokenizer_pb2.DecodeRequest(ids=ids, skip_special_tokens=True),
                              metadata=MESH)).text == "hi"


@pytest.mark.asyncio
async def test_stream_sends_a_real_replacement_character_at_once(stub, tok):
    ids = tok.encode_ids("a\ufffd".encode())
    texts = await exchange(stub, [ids, []])
    assert texts == ["a\ufffd", ""]  # with the ids that complete it, not held to the end


@pytest.mark.asyncio
async def test_stream_sends_a_split_character_whole_with_its_last_byte(stub, tok):
    ids = tok.encode_ids(EMOJI)
    assert len(ids) > 1  # byte-level tokens: the emoji's bytes are split across them
    texts = await exchange(stub, [[i] for i in ids] + [tok.encode_ids(b"!")])
    assert texts == [""] * (len(ids) - 1) + [EMOJI, "!"]


@pytest.mark.asyncio
async def test_stream_concatenation_equals_decode_of_all_ids(stub, tok):
    text = "Grüße, 世界! " + EMOJI + " \ufffd ok"
    ids = tok.encode_ids(text.encode()) + tok.encode_ids(EMOJI)[:1] + [2]  # ends on half a character
    batches = [ids[i:i + 3] for i in range(0, len(ids), 3)]
    texts = await exchange(stub, batches)
    whole = await stub.Decode(tokenizer_pb2.DecodeRequest(ids=ids, skip_special_tokens=True), metadata=MESH)
    assert "".join(texts) == whole.text == text + "\ufffd"  # the cut character flushed by finish


@pytest.mark.asyncio
async def test_stream_keeps_special_tokens_when_asked(stub, tok):
    assert await exchange(stub, [[2]], skip=False) == ["<|im_end|>"]


@pytest.mark.asyncio
async def test_stream_rejects_an_out_of_range_id_with_its_reason(stub, tok):
    call = stub.DecodeStream(metadata=MESH)
    await call.write(tokenizer_pb2.DecodeStreamRequest(ids=tok.encode_ids(b"ok")))
    assert (await call.read()).text == "ok"
    await call.write(tokenizer_pb2.DecodeStreamRequest(ids=[tok.vocab_size]))
    assert await reason_of(call.read()) == (grpc.StatusCode.INVALID_ARGUMENT, "TOKEN_ID_OUT_OF_RANGE")


@pytest.mark.asyncio
async def test_stream_needs_the_mesh_credential(stub):
    call = stub.DecodeStream()
    await call.write(tokenizer_pb2.DecodeStreamRequest(ids=[1], finish=True))
    assert await reason_of(call.read()) == (grpc.StatusCode.UNAUTHENTICATED, "MISSING_MESH_CREDENTIAL")


@pytest.mark.asyncio
async def test_stream_message_that_does_not_parse_is_malformed_request(stub):
    raw = stub.channel.stream_stream(  # bytes as they are, no serializer
        "/keel.tokenizer.v1.Tokenizer/DecodeStream", request_serializer=None, response_deserializer=None)
    call = raw(metadata=MESH)
    await call.write(b"\x0a\x05\xff\xff")  # field 1, length 5, only 2 bytes follow
    assert await reason_of(call.read()) == (grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_REQUEST")


@pytest.mark.asyncio
async def test_stream_before_the_stage_is_ready_is_unavailable_with_a_retry_hint():
    servicer = TokenizerServicer(TokenizerConfig(), metrics.metrics_for("tokenizer", CollectorRegistry()))
    srv = grpc.aio.server(interceptors=[ServerInterceptor("tokenizer", mesh_token="s3cret", is_ready=lambda: False)])
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = tokenizer_pb2_grpc.TokenizerStub(ch).DecodeStream(metadata=MESH)
            await call.write(tokenizer_pb2.DecodeStreamRequest(ids=[1], finish=True))
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await call.read()
    finally:
        await srv.stop(None)
    err = client.translate(exc.value)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and err.reason == "NOT_SERVING" and err.retry_after_ms
