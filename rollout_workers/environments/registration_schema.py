"""The JSON Schema of an environment registration: one object per kind, told apart by `kind`, so that a
schema-valid registration is a well-formed one. Kind `python` needs `import_path` and has no `base_url` or
`tools` (its class declares its tools); kind `http` needs `base_url` and `tools` and has no `import_path`;
kind `mcp` needs `base_url` (its server lists the tools) and has no `import_path`.
An unused field may be left out or null. What no schema can say (that the class imports on this cluster,
that the tool names differ, that the URL's host may be reached) is still checked by the registry.
"""

from __future__ import annotations

from typing import Any

from rollout_workers.environments.base import _TOOL_NAME

# The keys of an MCP client's stdio server config: refused by name (a tenant's command never runs on the cluster)
STDIO_FIELDS = ("command", "args", "env", "cwd")

KIND_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # kind -> (required, absent)
    "python": (("import_path",), ("base_url", "tools")),
    "http": (("base_url", "tools"), ("import_path",)),
    "mcp": (("base_url",), ("import_path",)),
}

# http(s), a host, no query or fragment (what the registry's URL check accepts)
BASE_URL_PATTERN = r"^[Hh][Tt][Tt][Pp][Ss]?://[^/?#][^?#]*$"

TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": _TOOL_NAME.pattern},
        "description": {"type": "string"},
        "parameters": {"type": "object", "description": "A JSON Schema of the arguments object.",
                       "properties": {"type": {"const": "object"}}, "required": ["type"]},
    },
    "required": ["name", "parameters"],
    "additionalProperties": False,
}

_VALUE_SCHEMAS: dict[str, dict[str, Any]] = {
    "base_url": {"type": "string", "pattern": BASE_URL_PATTERN},
    "tools": {"type": "array", "items": TOOL_SCHEMA, "minItems": 1,
              "description": "Tool descriptions {name, description, parameters}, with distinct names."},
}


def kind_union_schema(schema: dict[str, Any]) -> None:
    """Rewrite the flat object schema of EnvironmentRegistration (pydantic's `json_schema_extra` hook)."""
    properties = schema.pop("properties")
    common_required = [f for f in schema.pop("required", []) if f != "kind"]
    for key in ("type", "additionalProperties"):
        schema.pop(key, None)
    variants = []
    for kind, (required, absent) in KIND_FIELDS.items():
        props: dict[str, Any] = {}
        for name, prop in properties.items():
            if name == "kind":
                props[name] = {"type": "string", "const": kind}
            elif name in absent:
                props[name] = {"type": "null", "description": f"Not used by kind '{kind}': left out or null."}
            elif name in required:
                value = _VALUE_SCHEMAS.get(name) or next(b for b in prop["anyOf"] if b.get("type") != "null")
                extra = {k: v for k, v in prop.items() if k not in ("anyOf", "default", "title")}
                props[name] = {**extra, **value, **({"minLength": 1} if value.get("type") == "string" else {})}
            else:
                props[name] = prop
        variants.append({"title": f"{kind.capitalize()}{schema.get('title', '')}", "type": "object",
                         "properties": props, "required": ["kind", *common_required, *required],
                         "additionalProperties": False})
    schema["oneOf"] = variants
