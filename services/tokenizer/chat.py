"""Chat template rendering, set up the way transformers' ``apply_chat_template`` sets up jinja2.

Same sandboxed environment (trim_blocks, lstrip_blocks, loopcontrols), same ``tojson`` filter and
``raise_exception``/``strftime_now`` globals, same variables (messages as role/content dicts,
add_generation_prompt, the special token strings), so the rendered text is identical. jinja2 is
slow to import, so this module is imported by ``Tokenizer.warmup``, not at open.

Tools (OpenAI's function calling) reach the template as transformers passes them: ``tools`` a list
of ``{"type": "function", "function": {name, description, parameters}}``, an assistant turn's calls
as its ``tool_calls`` (``{"type": "function", "id": ..., "function": {"name": ..., "arguments":
<dict>}}``), a ``tool`` turn with its ``tool_call_id``. Only a template with a tools section
(``shared/toolformat.py``: not "generic") takes ``tool`` turns; others refuse them (UNKNOWN_ROLE).
Mistral's template refuses call ids that are not 9 characters long: for it each id is handed over
as ``toolformat.mistral_id`` makes it (a Keel id "call_" + 24 becomes 9 letters and digits).

A model without a chat template is rendered plainly (``PlainRenderer``): each message as
``"<role>: <content>\n"``, then ``"assistant:"`` when add_generation_prompt is set; the stage
reports its chat_template_sha256 as the SHA-256 of ``PLAIN_TEMPLATE_ID``.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared import toolformat
from shared.errors import InvalidInput

ROLES = ("system", "user", "assistant")
TOOL_ROLES = (*ROLES, "tool")  # a template with a tools section
PLAIN_TEMPLATE_ID = "keel.chat.plain.v1"  # names the plain rendering in chat_template_sha256


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class ChatRenderer:
    def __init__(self, template: str, special_strings: dict[str, str]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(template)
        self._special = dict(special_strings)  # bos_token, eos_token, ... as transformers passes them
        self.tool_format = toolformat.detect(template)

    def render(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True,
               tools: Sequence[dict] = (), extras: Sequence[dict] = ()) -> str:
        """``messages`` as (role, content) pairs; ``extras`` (empty, or one per message) the keys a
        turn adds in transformers' shape (``tool_calls``, ``tool_call_id``); ``tools`` as above."""
        roles = ROLES if self.tool_format == toolformat.GENERIC else TOOL_ROLES
        chat = [_message(i, m, roles) for i, m in enumerate(_message_list(messages))]
        for message, extra in zip(chat, extras):
            message.update(_mistral_ids(extra) if self.tool_format == toolformat.MISTRAL else extra)
        try:
            return self._template.render(messages=chat, add_generation_prompt=bool(add_generation_prompt),
                                         tools=list(tools) or None, documents=None, **self._special)
        except jinja2.TemplateError as exc:
            raise InvalidInput(f"chat template refused the messages: {exc}",
                               reason="CHAT_TEMPLATE_ERROR") from exc


class PlainRenderer:
    """For models without a chat template: "<role>: <content>\\n" per message, then "assistant:"
    (tools and a turn's calls are not shown: the gateway describes them in generic turns)."""

    tool_format = toolformat.GENERIC

    def render(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True,
               tools: Sequence[dict] = (), extras: Sequence[dict] = ()) -> str:
        chat = [_message(i, m) for i, m in enumerate(_message_list(messages))]
        text = "".join(f"{m['role']}: {m['content']}\n" for m in chat)
        return text + "assistant:" if add_generation_prompt else text


def _mistral_ids(extra: dict) -> dict:
    """A turn's call ids as Mistral's template takes them (an empty id stays empty: the template says)."""
    out = dict(extra)
    if out.get("tool_call_id"):
        out["tool_call_id"] = toolformat.mistral_id(out["tool_call_id"])
    if "tool_calls" in out:
        out["tool_calls"] = [{**c, "id": toolformat.mistral_id(c["id"])} if c.get("id") else c
                             for c in out["tool_calls"]]
    return out


def _message_list(messages) -> list:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidInput("messages must be a list of (role, content) pairs", reason="INVALID_MESSAGES")
    if not messages:
        raise InvalidInput("messages is empty", reason="EMPTY_MESSAGES")
    return list(messages)


def _message(index: int, message, roles: tuple[str, ...] = ROLES) -> dict:
    if isinstance(message, (str, bytes)) or not isinstance(message, Sequence) or len(message) != 2:
        raise InvalidInput(f"message {index} is not a (role, content) pair", reason="INVALID_MESSAGES",
                           metadata={"index": index})
    role, content = message
    if not isinstance(role, str) or role not in roles:
        raise InvalidInput(f"message {index} has role {role!r}; expected one of {', '.join(roles)}"[:300],
                           reason="UNKNOWN_ROLE", metadata={"index": index})
    if not isinstance(content, str):
        raise InvalidInput(f"message {index} content must be a string", reason="INVALID_MESSAGES",
                           metadata={"index": index})
    return {"role": role, "content": content}
