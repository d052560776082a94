"""The published schema of an environment registration: a union by kind that matches the model's rules."""

from __future__ import annotations

import jsonschema
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rollout_workers.environments import EnvironmentRegistration

_TOOL = {"name": "lookup", "description": "d", "parameters": {"type": "object"}}
_REGISTRATION_VALUES: dict[str, list] = {
    "kind": ["python", "http", "ftp"],
    "name": ["my-env", "My Env"],
    "import_path": [None, "pkg.mod:Env"],
    "base_url": [None, "http://tools.example:8080/v1"],
    "tools": [None, [_TOOL]],
    "timeout_s": [5.0, 0.0],
    "nope": [1],
}


@settings(max_examples=150, deadline=None)
@given(data=st.fixed_dictionaries(
    {"kind": st.sampled_from(_REGISTRATION_VALUES["kind"]), "name": st.sampled_from(_REGISTRATION_VALUES["name"])},
    optional={f: st.sampled_from(v) for f, v in _REGISTRATION_VALUES.items() if f not in ("kind", "name")}))
def test_the_json_schema_of_a_registration_is_a_union_by_kind(data: dict) -> None:
    """Each kind's own fields required, the other kind's absent or null: the schema accepts exactly the
    registrations the model does (for values that are otherwise well-formed)."""
    validator = jsonschema.Draft202012Validator(EnvironmentRegistration.model_json_schema())
    try:
        EnvironmentRegistration.model_validate(data)
        valid = True
    except ValidationError:
        valid = False
    assert validator.is_valid(data) == valid, data
