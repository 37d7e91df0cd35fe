"""Typing a tool argument written as text (Qwen XML parameters, Gemma 4 bare values) by the
tool's JSON schema."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .streaming import loads
from .types import ToolSpec

JSON_TYPES = frozenset({"string", "integer", "number", "boolean", "null", "object", "array"})


def param_types(tool: ToolSpec | None, key: str) -> frozenset[str]:
    """The JSON types the schema of `tool`'s parameter `key` allows; empty when it does not say
    (unknown tool or parameter, no "type")."""
    if tool is None:
        return frozenset()
    properties = tool.parameters.get("properties")
    if not isinstance(properties, Mapping):
        return frozenset()
    schema = properties.get(key)
    return schema_types(schema) if isinstance(schema, Mapping) else frozenset()


def schema_types(schema: Mapping[str, Any]) -> frozenset[str]:
    """ "type" (a name or a list), the types of "anyOf"/"oneOf" members, else the types of
    "enum"'s values; "object"/"array" for a schema with only "properties"/"items"."""
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    for key in ("anyOf", "oneOf"):
        members = schema.get(key)
        if isinstance(members, list):
            for member in members:
                if isinstance(member, Mapping):
                    types |= schema_types(member)
    enum = schema.get("enum")
    if not types and isinstance(enum, list):
        types.update(_type_of(value) for value in enum)
    if not types and "properties" in schema:
        types.add("object")
    if not types and "items" in schema:
        types.add("array")
    return frozenset(types & JSON_TYPES)


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _fit(value: Any, types: frozenset[str]) -> tuple[bool, Any]:
    """Whether a parsed value is of one of `types` (an integral float counts as an integer, and
    becomes one)."""
    kind = _type_of(value)
    if kind in types or (kind == "integer" and "number" in types):
        return True, value
    if kind == "number" and "integer" in types and float(value).is_integer():
        return True, int(value)
    return False, value


def typed_text(text: str, types: frozenset[str]) -> Any:
    """A parameter written as plain text (Qwen XML): a string unless the schema allows only
    non-string types or the text parses as JSON of an allowed non-string type (tried first when
    the schema also allows a string, as llama.cpp does); "True"/"False" count as booleans. A
    text that fits no allowed type stays a string; so does any text when the schema says
    nothing."""
    others = types - {"string"}
    if not others:
        return text
    stripped = text.strip()
    try:
        ok, value = _fit(loads(stripped), others)
    except ValueError:
        ok, value = False, None
    if ok:
        return value
    if "boolean" in others and stripped in ("True", "False"):
        return stripped == "True"
    return text


def typed_bare(text: str, types: frozenset[str]) -> Any:
    """A value written without string delimiters (Gemma 4's numbers, booleans, null): JSON
    when it parses, unless the schema allows only a string; else the text, as a string."""
    stripped = text.strip()
    if types == {"string"}:
        return stripped
    try:
        return loads(stripped)
    except ValueError:
        pass
    if stripped in ("True", "False"):
        return stripped == "True"
    return stripped
