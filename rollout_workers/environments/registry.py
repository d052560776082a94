"""Environment registrations: built-ins, `python` (an installed class), `http` (a remote tool server) and `mcp`
(the tools of an MCP server over streamable HTTP), each optionally with a declared outcome grader and process
reward components (data, checked against reward_models.graders by the control plane).

A registration is data only (JSON-serialisable, stored by the control plane): an import path of code
already installed on the cluster, or a URL. No code is ever accepted inside a request. What a tenant may
name is bounded by the operator's EnvironmentPolicy: python classes only from the `taper.environments`
entry points or configured module prefixes (checked on the string before anything is imported), http
targets only where net_guard allows, options only as each environment declares them within the
operator's maxima.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollout_workers.environments.base import Environment, validate_tool_schemas
from rollout_workers.environments.calculator import CalculatorEnv
from rollout_workers.environments.http_env import HttpEnvironment, probe
from rollout_workers.environments.long_horizon import LongHorizonEnv
from rollout_workers.environments.mcp_env import (
    MAX_TOOLS,
    NOT_AN_MCP_ENDPOINT,
    McpEnvironment,
    list_mcp_tools,
)
from rollout_workers.environments.policy import EnvironmentPolicy, check_options
from rollout_workers.environments.python_env import PythonEnv
from rollout_workers.environments.registration_schema import STDIO_FIELDS, kind_union_schema
from rollout_workers.environments.retrieval import RetrievalEnv
from rollout_workers.environments.tool_chain import ToolChainEnv
from rollout_workers.net_guard import AllowList, TargetRefused, check_base_url, resolve_target

BUILTIN_ENVIRONMENTS: dict[str, type[Environment]] = {
    cls.name: cls for cls in (CalculatorEnv, PythonEnv, RetrievalEnv, LongHorizonEnv, ToolChainEnv)
}

MAX_DECLARED_BYTES = 128 * 1024
_NAME = re.compile(r"^[a-z][a-z0-9_\-]{0,63}$")
_IMPORT_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


class EnvironmentRegistration(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=kind_union_schema)

    kind: Literal["python", "http", "mcp"]
    name: str = Field(description="Unique environment name, lowercase: [a-z][a-z0-9_-]*.",
                      json_schema_extra={"pattern": _NAME.pattern})
    description: str = Field("", max_length=2000)
    import_path: str | None = Field(None, description="python kind: 'package.module:ClassName', installed on the cluster.",
                                    json_schema_extra={"pattern": _IMPORT_PATH.pattern})
    base_url: str | None = Field(None, description="http kind: the tool server's base URL (http or https); mcp kind: "
                                                   "the MCP server's streamable HTTP endpoint (e.g. http://host:8000/mcp).")
    tools: list[dict[str, Any]] | None = Field(
        None, max_length=MAX_TOOLS,
        description="http kind: tool descriptions with JSON Schemas. mcp kind: optional; the names among the server's "
                    "tools to expose (default all); the stored schemas are what the server lists at registration.")
    timeout_s: float = Field(10.0, gt=0.0, le=3600.0, description="http/mcp kind: per-request timeout.")
    retries: int = Field(2, ge=0, le=10, description="http/mcp kind: retries on connection errors (http: also 429 and 5xx).")
    backoff_s: float = Field(0.2, ge=0.0, le=60.0, description="http/mcp kind: first retry delay; doubles each retry.")
    concurrency: int = Field(16, ge=1, le=4096, description="http/mcp kind: max requests in flight per process.")
    options: dict[str, Any] = Field(default_factory=dict, description="Constructor / task generator options.")
    grader: dict[str, Any] | None = Field(
        None, description="A declared outcome grader (string_check, text_similarity, numeric, regex, json_match, "
                          "python, http, multi) scoring the final answer instead of the environment's verifier.")
    process_rewards: list[dict[str, Any]] = Field(
        default_factory=list, max_length=16,
        description="Declared per-step process components ({kind: tool_called | tool_args_match, name, ...}).")

    @model_validator(mode="before")
    @classmethod
    def _no_stdio(cls, data: Any) -> Any:
        """An MCP client config's stdio server ({command, args, env}) is refused with what to do instead."""
        if isinstance(data, dict):
            stdio = [k for k in STDIO_FIELDS if k in data]
            if stdio:
                raise ValueError(
                    f"{stdio[0]}: a stdio MCP server ({'/'.join(stdio)}) is never run on the cluster (it would run "
                    "the tenant's command on it); serve it over streamable HTTP (e.g. server.run('streamable-http') "
                    "in the Python SDK) and register its URL as base_url with kind 'mcp'")
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"must match {_NAME.pattern}")
        return v

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                check_base_url(v)
            except TargetRefused as e:
                raise ValueError(str(e)) from None
        return v

    @field_validator("grader", "process_rewards")
    @classmethod
    def _declared_size(cls, v: Any) -> Any:
        if v is not None and len(json.dumps(v, default=str)) > MAX_DECLARED_BYTES:
            raise ValueError(f"at most {MAX_DECLARED_BYTES} bytes (as JSON)")
        return v

    @model_validator(mode="after")
    def _kind_fields(self) -> EnvironmentRegistration:
        if self.kind == "mcp":
            if not self.base_url:
                raise ValueError("base_url: required for kind 'mcp'")
            if self.import_path is not None:
                raise ValueError("import_path: only for kind 'python'")
        elif self.kind == "python":
            if not self.import_path:
                raise ValueError("import_path: required for kind 'python'")
            if self.base_url is not None or self.tools is not None:
                raise ValueError("base_url/tools: only for kind 'http' (a python environment declares its own tools)")
        else:
            if not self.base_url:
                raise ValueError("base_url: required for kind 'http'")
            if self.import_path is not None:
                raise ValueError("import_path: only for kind 'python'")
            if self.tools is None:
                raise ValueError("tools: required for kind 'http'")
        return self


def validate_registration(
    reg: EnvironmentRegistration | dict[str, Any], policy: EnvironmentPolicy | None = None
) -> EnvironmentRegistration:
    """Full check of a registration under the operator's policy; raises ValueError whose message starts with
    the offending field."""
    policy = policy or EnvironmentPolicy()
    if isinstance(reg, dict):
        try:
            reg = EnvironmentRegistration.model_validate(reg)
        except ValueError as e:
            raise ValueError(_pydantic_message(e)) from None
    if reg.name in BUILTIN_ENVIRONMENTS:
        raise ValueError(f"name: {reg.name!r} is a built-in environment")
    if reg.kind == "python":
        cls = allowed_class(reg.import_path or "", policy)
        options = check_options(cls.Options, reg.options, policy, "options")
        try:
            env = cls(**options.model_dump(exclude_unset=True))
        except Exception as e:
            raise ValueError(f"options: {reg.import_path} could not be constructed with them: {e!r}") from None
        try:
            tools = env.tools()
        except Exception as e:
            raise ValueError(f"import_path: {reg.import_path}.tools() raised {e!r}") from None
        validate_tool_schemas(tools, field=f"import_path: {reg.import_path}.tools()")
    elif reg.kind == "mcp":
        check_options(McpEnvironment.Options, reg.options, policy, "options")
        check_target(reg.base_url or "", policy.allow_list)
        reg = reg.model_copy(update={"tools": _mcp_tools(reg, policy)})
    else:
        validate_tool_schemas(reg.tools)
        check_options(HttpEnvironment.Options, reg.options, policy, "options")
        check_target(reg.base_url or "", policy.allow_list)
    return reg


def _mcp_tools(reg: EnvironmentRegistration, policy: EnvironmentPolicy) -> list[dict[str, Any]]:
    """The server's tool schemas (those named in `tools`, when given), checked like any tool list."""
    try:
        listed = list_mcp_tools(str(reg.base_url), policy.allow_list, reg.timeout_s)
    except Exception as e:
        if NOT_AN_MCP_ENDPOINT in str(e):
            raise ValueError(f"base_url: {reg.base_url} is {NOT_AN_MCP_ENDPOINT}") from None
        raise ValueError(f"base_url: the MCP server did not answer: {str(e)[:500]}") from None
    if not listed:
        raise ValueError("base_url: the MCP server lists no tools")
    if reg.tools is not None:
        wanted = [t.get("name") for t in reg.tools]
        by_name = {t["name"]: t for t in listed}
        missing = [w for w in wanted if w not in by_name]
        if missing:
            shown = sorted(by_name)
            listing = ", ".join(shown[:20]) + (f", ... ({len(shown)} in all)" if len(shown) > 20 else "")
            raise ValueError(f"tools: the MCP server has no tool {missing[0]!r} (it lists {listing})")
        listed = [by_name[w] for w in wanted]
    if len(listed) > MAX_TOOLS:  # what the environment exposes, after the filter
        raise ValueError(f"base_url: the MCP server lists {len(listed)} tools, more than the {MAX_TOOLS} an "
                         "environment may expose; name the ones to use in tools ([{name: ...}, ...])")
    return validate_tool_schemas(listed, field="base_url: the MCP server's tools")


def find_environment_class(target: str) -> type[Environment]:
    """A built-in name, an entry-point name or package of the `taper.environments` group, or an import path."""
    from importlib.metadata import entry_points

    from rollout_workers.environments.policy import ENTRY_POINT_GROUP

    if ":" in target:
        return import_environment_class(target)
    if target in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[target]
    points = [ep for ep in entry_points(group=ENTRY_POINT_GROUP)
              if ep.name == target or ep.module == target or ep.module.startswith(target + ".")]
    if len(points) != 1:
        found = ", ".join(f"{ep.name} ({ep.value})" for ep in points) or "none"
        raise ValueError(f"{target!r} names {len(points)} environments of the installed {ENTRY_POINT_GROUP!r} "
                         f"entry points ({found}); give 'package.module:Class'")
    return import_environment_class(points[0].value)


def importable_here(import_path: str) -> str | None:
    """None when this process can import the environment class at `import_path`, else why not (run as a task on
    the cluster's workers at registration)."""
    try:
        import_environment_class(import_path)
    except ValueError as e:
        return str(e).removeprefix("import_path: ")
    return None


def check_reachable(reg: EnvironmentRegistration, policy: EnvironmentPolicy | None = None) -> None:
    """Registration-time check that an http environment's server answers (ValueError naming base_url)."""
    if reg.kind != "http":
        return
    try:
        probe(reg, (policy or EnvironmentPolicy()).allow_list)
    except RuntimeError as e:
        raise ValueError(f"base_url: {e}") from None


def check_target(base_url: str, allow: AllowList) -> None:
    """The base URL's host resolves only to addresses the operator allows (checked again on every
    connection: DNS may change)."""
    try:
        parts = check_base_url(base_url)
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        resolve_target(parts.hostname or "", port, allow)
    except TargetRefused as e:
        raise ValueError(f"base_url: {e}") from None


def allowed_class(import_path: str, policy: EnvironmentPolicy) -> type[Environment]:
    """The class behind `import_path` if the operator made it available; nothing is imported otherwise."""
    if not _IMPORT_PATH.match(import_path):
        raise ValueError(f"import_path: must look like 'package.module:ClassName', got {import_path!r}")
    if not policy.module_allowed(import_path):
        raise ValueError(
            f"import_path: {import_path!r} is not available to tenants; the operator makes classes available "
            "through the 'taper.environments' entry points or the allowed module prefixes"
        )
    return import_environment_class(import_path)


def import_environment_class(import_path: str) -> type[Environment]:
    """Import `package.module:Class` and check that it is a concrete Environment (ValueError naming
    import_path otherwise). No allow-list: for code the caller chose (`taper env check`, the registry after
    `allowed_class`)."""
    if not _IMPORT_PATH.match(import_path):
        raise ValueError(f"import_path: must look like 'package.module:ClassName', got {import_path!r}")
    module_name, class_name = import_path.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(f"import_path: cannot import module {module_name!r}: {e!r}") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"import_path: module {module_name!r} has no attribute {class_name!r}")
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        raise ValueError(f"import_path: {import_path} is not a subclass of rollout_workers Environment")
    if inspect.isabstract(cls):
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        raise ValueError(f"import_path: {import_path} is abstract (missing {', '.join(missing)})")
    return cls


def _pydantic_message(e: ValueError) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):
        first = errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        msg = first.get("msg", str(e)).removeprefix("Value error, ")
        return f"{loc}: {msg}" if loc else msg
    return str(e)


@functools.lru_cache(maxsize=256)
def _http_class(reg_json: str, allow: AllowList) -> type[HttpEnvironment]:
    reg = EnvironmentRegistration.model_validate_json(reg_json)
    return type(f"Http_{reg.name}", (HttpEnvironment,), {"config": reg, "name": reg.name, "allow": allow})


@functools.lru_cache(maxsize=256)
def _mcp_class(reg_json: str, allow: AllowList) -> type[McpEnvironment]:
    reg = EnvironmentRegistration.model_validate_json(reg_json)
    return type(f"Mcp_{reg.name}", (McpEnvironment,), {"config": reg, "name": reg.name, "allow": allow})


def environment_class(env: EnvironmentRegistration | str, policy: EnvironmentPolicy | None = None) -> type[Environment]:
    """The Environment class behind a built-in name or a registration (an http one bound to the policy's
    allow-list)."""
    if isinstance(env, str):
        if env not in BUILTIN_ENVIRONMENTS:
            raise ValueError(f"environment: unknown built-in {env!r} (built-ins: {sorted(BUILTIN_ENVIRONMENTS)})")
        return BUILTIN_ENVIRONMENTS[env]
    if env.kind == "python":
        return import_environment_class(env.import_path or "")
    if env.kind == "mcp":
        return _mcp_class(env.model_dump_json(), (policy or EnvironmentPolicy()).allow_list)
    return _http_class(env.model_dump_json(), (policy or EnvironmentPolicy()).allow_list)


def _registered_options(env: EnvironmentRegistration | str) -> dict[str, Any]:
    return dict(env.options) if isinstance(env, EnvironmentRegistration) else {}


@dataclass(frozen=True)
class EnvFactory:
    """Makes one fresh Environment per episode, carrying the registration's declared rewards and the
    operator's policy (which the reward code reads: graders reach targets and run code under it)."""

    cls: type[Environment]
    options: dict[str, Any]
    grader: dict[str, Any] | None = None
    process_rewards: tuple[dict[str, Any], ...] = ()
    policy: EnvironmentPolicy | None = None

    def __call__(self) -> Environment:
        env = self.cls(**self.options)
        env.grader_spec, env.process_specs, env.policy = self.grader, self.process_rewards, self.policy
        return env


def make_env_factory(
    env: EnvironmentRegistration | str,
    options: dict[str, Any] | None = None,
    policy: EnvironmentPolicy | None = None,
) -> Callable[[], Environment]:
    """A zero-argument constructor making one fresh Environment per episode, its options checked against the
    environment's declaration and the operator's policy (default: the safe defaults)."""
    policy = policy or EnvironmentPolicy()
    cls = environment_class(env, policy)
    checked = check_options(cls.Options, {**_registered_options(env), **(options or {})}, policy, "environment.options")
    if not isinstance(env, EnvironmentRegistration):
        return EnvFactory(cls, checked.model_dump(exclude_unset=True), policy=policy)
    return EnvFactory(cls, checked.model_dump(exclude_unset=True), env.grader, tuple(env.process_rewards), policy)


def generate_tasks(
    env: EnvironmentRegistration | str,
    n: int,
    seed: int,
    options: dict[str, Any] | None = None,
    policy: EnvironmentPolicy | None = None,
) -> list[dict[str, Any]]:
    policy = policy or EnvironmentPolicy()
    cls = environment_class(env, policy)
    checked = check_options(cls.Options, {**_registered_options(env), **(options or {})}, policy, "tasks.options")
    return cls.generate_tasks(n, seed, **checked.model_dump(exclude_unset=True))


def check_job_environment(
    env: EnvironmentRegistration | str,
    env_options: dict[str, Any],
    task_options: dict[str, Any],
    policy: EnvironmentPolicy,
) -> None:
    """Submit-time checks of a job's environment: a python class is still one the operator allows, and the
    environment and task options are declared and within bounds. Raises ValueError naming the field."""
    if isinstance(env, EnvironmentRegistration) and env.kind == "python":
        if not policy.module_allowed(env.import_path or ""):
            raise ValueError(f"environment.name: {env.name!r} uses {env.import_path!r}, which the operator no "
                             "longer makes available")
    cls = environment_class(env, policy)
    registered = _registered_options(env)
    check_options(cls.Options, {**registered, **env_options}, policy, "environment.options")
    check_options(cls.Options, {**registered, **task_options}, policy, "tasks.options")
