"""What the operator allows environments to do: the one object that carries it from the settings (read by
the control plane) down to registration checks, job submission and the rollout workers.

- `http_allow`: CIDRs / host names an http environment may reach although they are internal (see net_guard).
- `environment_modules`: module prefixes whose classes tenants may register as python environments (beside
  the `taper.environments` entry points of installed packages).
- `data_roots`: the only directories file options (a retrieval corpus) may name files in.
- `python_max`: the most a job may ask of the python environment's sandbox.
"""

from __future__ import annotations

import functools
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo

from rollout_workers.net_guard import AllowList

BUILTIN_DATA_DIR = Path(__file__).with_name("data")
ENTRY_POINT_GROUP = "taper.environments"


class PythonSandboxMaxima(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_mb: int = Field(1024, ge=16, description="Largest memory a python tool call may ask for (the whole call).")
    cpu_seconds: int = Field(30, ge=1, description="Largest CPU time per call (the whole call).")
    wall_seconds: float = Field(60.0, gt=0.0, description="Largest wall-clock time per call.")
    output_bytes: int = Field(1024 * 1024, ge=1024, description="Largest captured output per call.")


class EnvironmentPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    http_allow: tuple[str, ...] = ()
    environment_modules: tuple[str, ...] = ()
    data_roots: tuple[Path, ...] = (BUILTIN_DATA_DIR,)
    python_max: PythonSandboxMaxima = PythonSandboxMaxima()

    @functools.cached_property
    def allow_list(self) -> AllowList:
        return AllowList.parse(self.http_allow)

    def data_file(self, value: str) -> Path:
        """The regular file `value` names inside a data root (relative: to the first root that has it),
        with symlinks resolved; raises ValueError when it is elsewhere or missing."""
        if not value or "\x00" in value:
            raise ValueError("must name a file")
        roots = [root.resolve() for root in self.data_roots]
        path = Path(value)
        for candidate in [path] if path.is_absolute() else [root / path for root in roots]:
            try:
                resolved = candidate.resolve(strict=True)
            except (OSError, RuntimeError):
                continue
            if resolved.is_file() and any(resolved.is_relative_to(root) for root in roots):
                return resolved
        raise ValueError(f"{value!r} is not a file inside the operator's data roots")

    def module_allowed(self, import_path: str) -> bool:
        """Whether `module:Class` is one the operator made available, decided on the string alone (nothing
        is imported): an entry point of the `taper.environments` group, or a module under a configured prefix."""
        module = import_path.partition(":")[0]
        if import_path in _entry_point_targets():
            return True
        _entry_point_targets.cache_clear()  # a package installed since the last look (no restart needed)
        if import_path in _entry_point_targets():
            return True
        return any(module == prefix or module.startswith(prefix + ".") for prefix in self.environment_modules)


@functools.lru_cache(maxsize=1)
def _entry_point_targets() -> frozenset[str]:
    return frozenset(f"{ep.module}:{ep.attr}" for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.attr)


def context_policy(info: ValidationInfo) -> EnvironmentPolicy | None:
    """The policy an options model is validated under (None when an environment checks its own options:
    its static bounds apply, the operator's were checked by whoever passed the options on)."""
    context = info.context or {}
    return context.get("policy")


def check_options(options_model: type[BaseModel], options: dict[str, Any], policy: EnvironmentPolicy,
                  field: str) -> BaseModel:
    """Validate tenant options against an environment's options model and the operator's limits; raises
    ValueError whose message starts with the dotted field (`environment.options.memory_mb: ...`)."""
    if not isinstance(options, dict):
        raise ValueError(f"{field}: must be an object")
    try:
        return options_model.model_validate(options, context={"policy": policy})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join([field, *(str(p) for p in err.get("loc", ()))])
        raise ValueError(f"{where}: {str(err.get('msg', exc)).removeprefix('Value error, ')}") from None
