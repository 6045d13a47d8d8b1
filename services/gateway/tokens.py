"""Tokenize and Detokenize: the tokenizer stage as a client may use it directly (to count a prompt
against the context, or to read token ids back), through the same hops, retries and spans as a
generation's (Pipeline.hop), held to the gateway's prompt limits. No validator, no inference."""
from __future__ import annotations

from services.gateway import tools
from services.gateway.contract import CHAT_ROLES, Ask, Limits, check_messages, check_prompt_bytes
from services.gateway.pipeline import Pipeline
from services.gateway.values import Call
from shared import errors

INT32_MAX = 2**31 - 1  # the tokenizer's ids are int32; any vocabulary is far smaller


class Tokens:
    def __init__(self, pipeline: Pipeline, limits: Limits):
        self.pipeline, self.limits = pipeline, limits

    async def tokenize(self, text: str | None, chat: Ask, add_generation_prompt: bool, call: Call) -> list[int]:
        """The ids of ``text`` as is, or (``text`` None) of ``chat``'s conversation rendered with the chat
        template, its tools and turn calls as Generate renders them (services/gateway/tools.py).
        CONTEXT_LENGTH_EXCEEDED when they are more than the context (the tokenizer encodes at most it)."""
        context = self.limits.max_context_tokens
        up, fmt = self.pipeline.up, self.pipeline.tool_format
        if text is None:
            check_messages(chat.messages, self.limits, CHAT_ROLES)
            tools.check(chat, self.limits, fmt)
            chat = tools.render(chat, fmt)
            enc = await self.pipeline.hop("tokenizer", "Encode", lambda t, md: up.encode_chat(
                chat.messages, context, t, md, add_generation_prompt=add_generation_prompt,
                tools=tools.shown(chat, fmt), turn_tools=chat.turn_tools), call)
        else:
            check_prompt_bytes(len(text.encode("utf-8", "surrogatepass")), self.limits)
            if not text:
                return []
            enc = await self.pipeline.hop("tokenizer", "Encode", lambda t, md: up.encode_text(text, context, t, md),
                                          call)
        if enc.original_length > len(enc.ids):
            raise errors.InvalidInput(
                f"the text is {enc.original_length} tokens, more than the model's context of {context}",
                reason="CONTEXT_LENGTH_EXCEEDED",
                metadata={"prompt_tokens": enc.original_length, "max_tokens": 0, "context_tokens": context})
        return enc.ids

    async def detokenize(self, ids: list[int], call: Call) -> str:
        """The text of ``ids``, special tokens kept (the tokenizer refuses an id beyond its vocabulary)."""
        if len(ids) > self.limits.max_context_tokens:
            raise errors.InvalidInput(f"at most {self.limits.max_context_tokens} token ids (the context), "
                                      f"got {len(ids)}", reason="TOO_MANY_TOKEN_IDS", metadata={"field": "token_ids"})
        if any(i > INT32_MAX for i in ids):
            raise errors.InvalidInput("a token id is beyond the vocabulary", reason="TOKEN_ID_OUT_OF_RANGE",
                                      metadata={"field": "token_ids"})
        up = self.pipeline.up
        return await self.pipeline.hop("tokenizer", "Decode", lambda t, md: up.decode(
            ids, t, md, skip_special_tokens=False), call)
