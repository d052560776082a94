"""Tool environments: the interface, the built-ins and the registry."""

from rollout_workers.environments.base import Environment, ToolError, validate_tool_schemas
from rollout_workers.environments.registry import (
    BUILTIN_ENVIRONMENTS,
    EnvironmentRegistration,
    environment_class,
    generate_tasks,
    make_env_factory,
    validate_registration,
)

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "Environment",
    "EnvironmentRegistration",
    "ToolError",
    "environment_class",
    "generate_tasks",
    "make_env_factory",
    "validate_registration",
    "validate_tool_schemas",
]
