"""The json_schema output plugin: the answer against the schema its request was constrained to."""
from __future__ import annotations

import json

from services.validator.builtins import JsonSchemaOutput
from services.validator.plugins import OutputContext

SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}}, "required": ["n"]})


def test_passes_valid_json_and_requests_without_a_schema():
    plugin = JsonSchemaOutput()
    assert plugin.validate('{"n": 2}', OutputContext(json_schema=SCHEMA)) is None
    assert plugin.validate("free text", OutputContext()) is None


def test_format_error_for_text_that_does_not_parse_or_validate():
    plugin = JsonSchemaOutput()
    for text in ('{"n": 2', '{"n": 7}', '{"m": 1}', "yes"):
        verdict = plugin.validate(text, OutputContext(json_schema=SCHEMA))
        assert verdict is not None and verdict.message.startswith("format_error"), text
