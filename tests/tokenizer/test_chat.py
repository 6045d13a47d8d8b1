"""Chat template rendering: identical to transformers' apply_chat_template, strict about messages."""
from __future__ import annotations

import pytest

from services.tokenizer.core import Tokenizer
from shared.errors import InvalidInput, NotReady
from tests.tokenizer.conftest import HF_TOKENIZER_DIR

CONVERSATIONS = [
    [("user", "hi")],
    [("system", "Be brief."), ("user", "What is 2+2?")],
    [("user", "Hello"), ("assistant", "Hi! How can I help?"), ("user", "Tell me a joke.")],
    [("system", ""), ("user", "")],
    [("user", "多行\n文本 😀 and <|im_end|> inside, {{ not_a_variable }} {% if x %}raw{% endif %}")],
    [("assistant", "starts with the assistant")],
    [("user", "a"), ("system", "a system message in the middle"), ("user", "b")],
]


@pytest.fixture(scope="module")
def hf_chat():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(HF_TOKENIZER_DIR))


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(tok, hf_chat, messages, add_generation_prompt):
    expected = hf_chat.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
    assert tok.render_chat(messages, add_generation_prompt=add_generation_prompt) == expected


def test_default_system_prompt_comes_from_the_gguf(tok):
    rendered = tok.render_chat([("user", "hi")])
    assert rendered == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                        "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_rendered_chat_encodes_special_tokens_as_single_ids(tok, ref_ids):
    rendered = tok.render_chat([("user", "hi")])
    ids = tok.encode(rendered).input_ids
    assert ids == ref_ids(rendered) and ids.count(1) == 3 and ids.count(2) == 2


@pytest.mark.parametrize("messages, reason", [
    ([("tool", "x")], "UNKNOWN_ROLE"),
    ([("User", "x")], "UNKNOWN_ROLE"),
    ([("user", "ok"), ("", "x")], "UNKNOWN_ROLE"),
    ([(None, "x")], "UNKNOWN_ROLE"),
    ([], "EMPTY_MESSAGES"),
    ((), "EMPTY_MESSAGES"),
    ("user: hi", "INVALID_MESSAGES"),
    (None, "INVALID_MESSAGES"),
    ([("user",)], "INVALID_MESSAGES"),
    ([("user", "x", "extra")], "INVALID_MESSAGES"),
    ([("user", 5)], "INVALID_MESSAGES"),
    (["user"], "INVALID_MESSAGES"),
])
def test_bad_messages(tok, messages, reason):
    with pytest.raises(InvalidInput) as err:
        tok.render_chat(messages)
    assert err.value.reason == reason


def test_render_before_warmup_is_not_ready(compiled_file):
    cold = Tokenizer.open(compiled_file)
    with pytest.raises(NotReady):
        cold.render_chat([("user", "hi")])
    cold.warmup()
    assert cold.render_chat([("user", "hi")]).endswith("<|im_start|>assistant\n")
