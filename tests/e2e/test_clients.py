"""The client libraries teams point at Keel, used as their documentation shows, against the session
mesh: the openai SDK's structured outputs and `n`, instructor in JSON_SCHEMA mode, LangChain's
completions model on raw text, instructor in TOOLS mode and LangChain's bind_tools (the calls made under
the functions' schemas). (lm-evaluation-harness: tests/e2e/test_lm_eval.py.)"""
from __future__ import annotations

import json

import pytest
from openai import OpenAI
from pydantic import BaseModel

from keelctl.ask import DEV_API_KEY
from shared.modelfile import model_id

MODEL_ID = model_id()

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class City(BaseModel):
    name: str
    country: str


def client(mesh) -> OpenAI:
    return OpenAI(base_url=f"http://{mesh.http}/v1", api_key=DEV_API_KEY, max_retries=0, timeout=300)


def ask(city: str) -> list[dict]:
    return [{"role": "user", "content": f"Give the city {city} and its country as JSON."}]


def test_openai_parse_returns_the_pydantic_object(mesh):
    r = client(mesh).chat.completions.parse(model=MODEL_ID, messages=ask("Paris"), response_format=City,
                                            max_tokens=60, temperature=0)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and json.loads(r.choices[0].message.content) == parsed.model_dump()


def test_openai_n_choices_are_reproducible_and_count_the_prompt_once(mesh):
    args = dict(model=MODEL_ID, messages=ask("Rome"), max_tokens=8, temperature=1.0, seed=11, n=3)
    first, again = client(mesh).chat.completions.create(**args), client(mesh).chat.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    one = client(mesh).chat.completions.create(**{**args, "n": 1})
    assert first.usage.prompt_tokens == one.usage.prompt_tokens
    assert first.choices[0].message.content == one.choices[0].message.content  # choice 0 samples with the seed


def test_instructor_json_schema_mode_returns_a_validated_object(mesh):
    import instructor
    patched = instructor.from_openai(client(mesh), mode=instructor.Mode.JSON_SCHEMA)
    city = patched.chat.completions.create(model=MODEL_ID, messages=ask("Berlin"), response_model=City,
                                           max_tokens=60, temperature=0, max_retries=0)
    assert isinstance(city, City) and city.name


def test_langchain_completions_model_continues_raw_text(mesh):
    from langchain_openai import OpenAI as LangChainOpenAI
    prompt = "def fibonacci(n):"
    llm = LangChainOpenAI(base_url=f"http://{mesh.http}/v1", api_key=DEV_API_KEY, model=MODEL_ID, max_tokens=12,
                          temperature=0, max_retries=0)
    text = llm.invoke(prompt)
    raw = client(mesh).completions.create(model=MODEL_ID, prompt=prompt, max_tokens=12, temperature=0)
    assert text == raw.choices[0].text and text.strip()


def test_instructor_tools_mode_returns_a_validated_object(mesh):
    import instructor
    patched = instructor.from_openai(client(mesh), mode=instructor.Mode.TOOLS)  # instructor's default mode
    city = patched.chat.completions.create(model=MODEL_ID, messages=ask("Madrid"), response_model=City,
                                           max_tokens=80, temperature=0, max_retries=0)
    assert isinstance(city, City) and city.name


def test_langchain_bind_tools_returns_tool_calls(mesh):
    from langchain_openai import ChatOpenAI

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    llm = ChatOpenAI(base_url=f"http://{mesh.http}/v1", api_key=DEV_API_KEY, model=MODEL_ID, max_tokens=60,
                     temperature=0, max_retries=0)
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Lisbon?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    assert isinstance(msg.tool_calls[0]["args"].get("city"), str)
