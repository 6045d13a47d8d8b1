"""JSON Schemas the constrained-decoding tests hold answers to: nested objects, arrays, enums,
bounded numbers and patterned strings, each small enough for a short answer."""
from __future__ import annotations

_NAME = {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}
_SHORT = {"type": "string", "maxLength": 8}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["score"], "additionalProperties": False},
    {"enum": ["alpha", "beta", "gamma"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": _NAME, "role": {
        "enum": ["admin", "guest"]}}, "required": ["name", "role"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                                          "maximum": 9}},
                                "required": ["id"], "additionalProperties": False}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"temp": {"type": "number", "minimum": -40, "maximum": 50},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["temp", "unit"],
     "additionalProperties": False},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "city": _SHORT},
     "required": ["zip", "city"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0,
                                                                            "maximum": 1000}},
     "required": ["status", "count"], "additionalProperties": False},
    {"type": "string", "pattern": "^(yes|no)$"},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["c"], "additionalProperties": False}},
        "required": ["b"], "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.(com|org)$"}},
     "required": ["email"], "additionalProperties": False},
    {"type": "object", "properties": {"priority": {"type": "integer", "enum": [1, 2, 3]},
                                      "label": _SHORT}, "required": ["priority"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"version": {"type": "string", "pattern": "^[0-9]\\.[0-9]\\.[0-9]$"},
                                      "stable": {"type": "boolean"}, "ratio": {"type": "number", "minimum": 0.5,
                                                                              "maximum": 2.5}},
     "required": ["version", "stable", "ratio"], "additionalProperties": False},
]
