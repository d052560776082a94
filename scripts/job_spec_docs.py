"""Write docs/job-spec.md from the job spec's JSON Schema (what POST /v1/jobs validates), so the reference
cannot drift from the code: `python scripts/job_spec_docs.py` rewrites it, `--check` fails when it is stale."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rl_service.spec import JobSpec

OUT = Path(__file__).resolve().parents[1] / "docs" / "job-spec.md"

HEADER = """# The job spec

What `POST /v1/jobs` (and `taper submit FILE.yaml`) accepts. Every field is optional; unknown fields are
refused with a 422 that names them, and so is a value outside its bounds. This page is generated from the
code (`python scripts/job_spec_docs.py`); a test fails when it is stale.

Steps are counted from 0 everywhere: the first training step is step 0 in metrics rows, events,
trajectories and a schedule patch's `effective_from`; `total_steps: 20` trains steps 0 to 19.

| field | type | default | bounds | meaning |
|---|---|---|---|---|
"""


def _resolve(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = {**defs[schema["$ref"].split("/")[-1]], **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def _merge_kinds(schema: dict[str, Any]) -> dict[str, Any]:
    """A union of one object per kind (the reward schedule) as one object: each field as its own kind
    declares it, `kind` as the list of kinds."""
    props: dict[str, Any] = {}
    kinds = []
    for branch in schema["oneOf"]:
        for name, prop in branch["properties"].items():
            if name == "kind":
                kinds.append(prop["const"])
            elif prop.get("type") != "null" and not str(prop.get("description", "")).startswith("Not used"):
                props.setdefault(name, prop)
    return {"properties": {"kind": {"enum": kinds}, **props},
            "description": schema.get("description", "")}


def _type(schema: dict[str, Any]) -> str:
    if "enum" in schema:
        return " or ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "anyOf" in schema:
        return " or ".join(_type(s) for s in schema["anyOf"])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list of {_type(schema.get('items', {}))}"
    if kind == "object":
        return "object"
    return str(kind)


def _bounds(schema: dict[str, Any]) -> str:
    parts = []
    for s in [schema, *schema.get("anyOf", [])]:
        for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<"),
                          ("minLength", "length >="), ("maxLength", "length <="), ("maxItems", "items <=")):
            if key in s and s.get("type") != "null":
                parts.append(f"{sign} {s[key]}")
    return ", ".join(dict.fromkeys(parts))


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def rows(schema: dict[str, Any], defs: dict[str, Any], defaults: dict[str, Any], prefix: str = "") -> list[str]:
    """One table row per field; `defaults` is the default spec's value at the same place."""
    out = []
    for name, prop in schema.get("properties", {}).items():
        prop = _resolve(prop, defs)
        if "oneOf" in prop:
            prop = _merge_kinds(prop)
        path = f"{prefix}{name}"
        nested = prop.get("properties")
        if nested:
            out.append(f"| **`{path}`** | object | | | {_cell(prop.get('description', ''))} |")
            out += rows(prop, defs, defaults.get(name) or {}, prefix=f"{path}.")
            continue
        if prop.get("type") == "null":  # set by the service, never by a submission
            continue
        default = json.dumps(defaults[name]) if name in defaults else ""
        out.append(f"| `{path}` | {_cell(_type(prop))} | {_cell(default and f'`{default}`')} | "
                   f"{_cell(_bounds(prop))} | {_cell(prop.get('description', ''))} |")
    return out


def render() -> str:
    schema = JobSpec.model_json_schema()
    defaults = JobSpec().model_dump(mode="json")
    return HEADER + "\n".join(rows(schema, schema.get("$defs", {}), defaults)) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/job-spec.md is not current")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.name} is stale: run python scripts/job_spec_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
