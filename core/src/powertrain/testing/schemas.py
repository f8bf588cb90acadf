"""JSON schemas for structured-output tests: nested objects, arrays, enums,
required/optional properties, bounded numbers and strings, booleans, null, anyOf.

Every value is bounded (lengths, item counts, number ranges), so a small model
sampling freely cannot ramble past max_tokens inside a string or a number.
"""

from __future__ import annotations


def _short(maximum: int = 12) -> dict:
    return {"type": "string", "minLength": 1, "maxLength": maximum}


def _digit() -> dict:
    return {"type": "integer", "minimum": 0, "maximum": 9}


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


JSON_SCHEMAS: dict[str, dict] = {
    "flat person": _object({"name": _short(), "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "string enum": _object({"color": {"enum": ["red", "green", "blue"]}}),
    "boolean and null": _object({"active": {"type": "boolean"}, "note": {"type": "null"}}),
    "nested object with pattern": _object(
        {"city": _short(), "address": _object({"street": _short(), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}
    ),
    "integer array with bounds": _object(
        {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 1, "maximum": 9},
                "minItems": 2,
                "maxItems": 4,
            }
        }
    ),
    "array of objects": _object(
        {
            "items": {
                "type": "array",
                "items": _object({"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}}),
                "minItems": 1,
                "maxItems": 2,
            }
        }
    ),
    # multipleOf bounds the digits after the point too.
    "bounded number": _object({"celsius": {"type": "number", "minimum": -50, "maximum": 50, "multipleOf": 0.5}}),
    "string lengths": _object({"code": {"type": "string", "minLength": 3, "maxLength": 6}}),
    "optional properties": _object(
        {"title": _short(), "subtitle": _short(), "pages": {"type": "integer", "minimum": 1, "maximum": 999}},
        required=["title"],
    ),
    "anyOf": _object({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, _short(8)]}}),
    "date pattern": _object({"date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}}),
    "top-level array of enums": {
        "type": "array",
        "items": {"enum": ["apple", "pear", "plum"]},
        "minItems": 1,
        "maxItems": 3,
    },
    "const": _object(
        {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": _digit()}
    ),
    "exclusive bounds": _object({"level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    "nested arrays": _object(
        {
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": _digit(), "minItems": 2, "maxItems": 2},
                "minItems": 2,
                "maxItems": 2,
            }
        }
    ),
    "$defs and $ref": {
        "$defs": {"point": _object({"x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": _digit()})},
        **_object({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
    },
    "type union with null": _object({"nickname": {"type": ["string", "null"], "maxLength": 10}}),
    "mixed enum": _object({"answer": {"enum": [1, "two", None, True]}}),
    "three levels deep": _object({"a": _object({"b": _object({"c": _digit()})})}),
    "integer multipleOf": _object({"count": {"type": "integer", "minimum": 5, "maximum": 1000, "multipleOf": 5}}),
    "oneOf and allOf": _object(
        {
            "id": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]},
            "tag": {"allOf": [_short(), {"maxLength": 5}]},
        }
    ),
    "date format": _object({"due": {"type": "string", "format": "date"}}),
    "additionalProperties schema": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["id"],
        "additionalProperties": {"type": "boolean"},
        "maxProperties": 3,
    },
    "array of enums with required object": _object(
        {
            "user": _object({"name": _short(), "role": {"enum": ["admin", "guest"]}}),
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        }
    ),
}
