"""Chats with tools through a template that has a tools section: the rendered text equals
transformers' apply_chat_template(messages, tools=tools) for the real Qwen2.5-Instruct, Llama 3.1
Instruct and Mistral Nemo Instruct templates (tests/tokenizer/fixtures), the format is told from the
template's text, and the servicer hands a ChatInput's tools and a message's calls to the template in
transformers' shape (Mistral's with call ids of 9 characters)."""
from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry

from keel.common.v1 import common_pb2
from keel.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer.chat import ChatRenderer
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.servicer import TokenizerServicer
from shared import metrics, toolformat
from shared.errors import InvalidInput
from tests.tokenizer.conftest import HF_TOKENIZER_DIR

FIXTURES = Path(__file__).parent / "fixtures"
QWEN = (FIXTURES / "qwen2.5-instruct.jinja").read_text(encoding="utf-8")
LLAMA = (FIXTURES / "llama-3.1-instruct.jinja").read_text(encoding="utf-8")
MISTRAL = (FIXTURES / "mistral-nemo-instruct-2407.jinja").read_text(encoding="utf-8")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the web.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


def call(id_: str, name: str, arguments: dict) -> dict:
    return {"type": "function", "id": id_, "function": {"name": name, "arguments": arguments}}


# (messages as transformers takes them, tools); Llama 3.1 takes one call per assistant turn.
HERMES_CHATS = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}], [WEATHER, SEARCH]),
    ([{"role": "user", "content": "Weather in Paris and Rome?"},
      {"role": "assistant", "content": "", "tool_calls": [call("call_1", "get_weather", {"city": "Paris"}),
                                                          call("call_2", "get_weather", {"city": "Rome", "days": 2})]},
      {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
      {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}], [WEATHER]),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Let me look.",
                                          "tool_calls": [call("c", "search", {"q": "ünï"})]},
      {"role": "tool", "tool_call_id": "c", "content": "nothing"}, {"role": "user", "content": "ok"}], [SEARCH]),
]
LLAMA_CHATS = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}], [WEATHER, SEARCH]),
    ([{"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "", "tool_calls": [call("call_1", "get_weather", {"city": "Paris"})]},
      {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}], [WEATHER]),
]

# Mistral's template wants user and assistant turns to alternate (call turns and tool turns aside)
# and call ids of 9 characters.
MISTRAL_CHATS = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}], [WEATHER, SEARCH]),
    ([{"role": "user", "content": "Weather in Paris and Rome?"},
      {"role": "assistant", "content": "", "tool_calls": [
          call("a1b2c3d4e", "get_weather", {"city": "Paris"}),
          call("Z9y8X7w6V", "get_weather", {"city": "Rome", "days": 2})]},
      {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "{\"temp\": 21}"},
      {"role": "tool", "tool_call_id": "Z9y8X7w6V", "content": "sunny"}], [WEATHER]),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
      {"role": "assistant", "content": "Let me look.", "tool_calls": [call("abcdefghi", "search", {"q": "ünï"})]},
      {"role": "tool", "tool_call_id": "abcdefghi", "content": "nothing"},
      {"role": "assistant", "content": "Nothing found."}, {"role": "user", "content": "ok"}], [SEARCH]),
]


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(HF_TOKENIZER_DIR))


def renderer(hf, template: str) -> ChatRenderer:
    return ChatRenderer(template, {k: v for k, v in hf.special_tokens_map.items() if isinstance(v, str)})


def ours(r: ChatRenderer, messages: list[dict], tools: list[dict]) -> str:
    pairs = [(m["role"], m["content"]) for m in messages]
    extras = [{k: v for k, v in m.items() if k not in ("role", "content")} for m in messages]
    return r.render(pairs, True, tools, extras)


@pytest.mark.parametrize("template, chats", [(QWEN, HERMES_CHATS), (LLAMA, LLAMA_CHATS), (MISTRAL, MISTRAL_CHATS)],
                         ids=["qwen2.5", "llama3.1", "mistral-nemo"])
def test_render_with_tools_matches_transformers(hf, template, chats):
    r = renderer(hf, template)
    for messages, tools in chats:
        expected = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                          chat_template=template)
        assert ours(r, messages, tools) == expected
        # and without tools (the template's own branch for a plain chat)
        plain = [m for m in messages if m["role"] != "tool" and "tool_calls" not in m]
        assert r.render([(m["role"], m["content"]) for m in plain]) == hf.apply_chat_template(
            plain, add_generation_prompt=True, tokenize=False, chat_template=template)


def test_the_tool_format_is_told_from_the_templates_text(hf, tok):
    assert renderer(hf, QWEN).tool_format == toolformat.HERMES
    assert renderer(hf, LLAMA).tool_format == toolformat.LLAMA3
    assert renderer(hf, MISTRAL).tool_format == toolformat.MISTRAL
    assert tok.tool_format == toolformat.GENERIC  # SmolLM2's template has no tools section
    assert toolformat.detect(None) == toolformat.GENERIC


def test_mistral_is_handed_call_ids_of_9_characters(hf):
    """Keel's ids ("call_" + 24) are longer than Mistral's template takes: each is handed over as 9
    letters and digits made from it, the same in the call and in its tool turn; 9-character ids as sent."""
    keel_id = "call_" + "x" * 24
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call(keel_id, "get_weather", {"city": "Paris"})]},
                {"role": "tool", "tool_call_id": keel_id, "content": "sunny"}]
    short = toolformat.mistral_id(keel_id)
    assert toolformat.MISTRAL_ID.fullmatch(short) and short == toolformat.mistral_id(keel_id)
    assert toolformat.mistral_id("a1b2c3d4e") == "a1b2c3d4e" and toolformat.mistral_id("call_2") != short
    as_shown = [messages[0], {**messages[1], "tool_calls": [call(short, "get_weather", {"city": "Paris"})]},
                {**messages[2], "tool_call_id": short}]
    with pytest.raises(Exception, match="length 9"):
        hf.apply_chat_template(messages, tools=[WEATHER], tokenize=False, chat_template=MISTRAL)
    assert ours(renderer(hf, MISTRAL), messages, [WEATHER]) == hf.apply_chat_template(
        as_shown, tools=[WEATHER], add_generation_prompt=True, tokenize=False, chat_template=MISTRAL)
    assert f'"id": "{short}"' in ours(renderer(hf, MISTRAL), messages, [WEATHER])


def test_a_template_without_a_tools_section_refuses_tool_turns(tok):
    with pytest.raises(InvalidInput) as exc:
        tok.render_chat([("user", "hi"), ("tool", "x")])
    assert exc.value.reason == "UNKNOWN_ROLE"


class QwenTokenizer:
    """The stage's tokenizer with the Qwen2.5 template in place of SmolLM2's (same vocabulary)."""

    def __init__(self, tok, chat: ChatRenderer):
        self._tok, self._chat = tok, chat
        self.tool_format = chat.tool_format

    def render_chat(self, messages, add_generation_prompt=True, tools=(), extras=()):
        return self._chat.render(messages, add_generation_prompt, tools, extras)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest_asyncio.fixture
async def qwen_stub(tok, hf):
    registry = metrics.metrics_for("tokenizer", CollectorRegistry())
    servicer = TokenizerServicer(TokenizerConfig(max_length=4096), registry)
    servicer.tok = QwenTokenizer(tok, renderer(hf, QWEN))
    srv = grpc.aio.server()
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield tokenizer_pb2_grpc.TokenizerStub(ch)
    await ch.close()
    await srv.stop(None)


@pytest.mark.asyncio
async def test_encode_hands_tools_and_calls_to_the_template(qwen_stub, tok, hf):
    messages, tools = HERMES_CHATS[1]
    chat = tokenizer_pb2.ChatInput(add_generation_prompt=True, tools=[common_pb2.Tool(
        name=WEATHER["function"]["name"], description=WEATHER["function"]["description"],
        parameters=json.dumps(WEATHER["function"]["parameters"]))])
    for m in messages:
        chat.messages.append(common_pb2.ChatMessage(
            role=m["role"], content=m["content"], tool_call_id=m.get("tool_call_id", ""),
            tool_calls=[common_pb2.ToolCall(id=c["id"], name=c["function"]["name"],
                                            arguments=json.dumps(c["function"]["arguments"]))
                        for c in m.get("tool_calls", [])]))
    resp = await qwen_stub.Encode(tokenizer_pb2.EncodeRequest(chat=chat))
    expected = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                      chat_template=QWEN)
    assert tok.decode(list(resp.input_ids)) == expected
    assert resp.tool_format == toolformat.HERMES
