"""The JSON schema that `tool_choice` "required" or a named function decodes under.

Decoding under this schema (the engine's structured output) means the calls always parse
and their arguments validate against the function's `parameters`, whatever the model:

- a named function: the output is its arguments object, nothing else;
- "required": a JSON array of `{"name": ..., "parameters": {...}}`, one item per call (at
  most one when parallel_tool_calls is false), each item's parameters checked against its
  own function's schema.
"""
from __future__ import annotations

from typing import Any

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or NO_PARAMETERS


def named_schema(function: dict[str, Any]) -> dict[str, Any]:
    return parameters_schema(function)


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    items = [{"type": "object",
              "properties": {"name": {"enum": [f["name"]]}, "parameters": parameters_schema(f)},
              "required": ["name", "parameters"]} for f in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
