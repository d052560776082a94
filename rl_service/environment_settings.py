"""The operator's limits on tenants' environments, read from the environment (``TAPER_`` variables): the service
validates registrations with them and a job driver hands them to its rollout workers, so both read them here.

``TaperSettings`` (rl_service.control.settings) extends this class with the service's own settings; `load` turns
a bad value into one message that names each variable."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from pydantic import AliasChoices, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

if TYPE_CHECKING:
    from rollout_workers.environments.policy import EnvironmentPolicy

# a list setting: comma-separated ("10.0.0.0/8,tools.internal") or a JSON list
ListSetting = Annotated[tuple[str, ...], NoDecode]


class EnvironmentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TAPER_", env_nested_delimiter="__", extra="ignore")

    data_dir: Path = Field(Path("taper_data"), description="Checkpoints, trajectories, logs and the private Redis.")

    # what tenants' environments may do (docs/design.md section 10); the defaults are the safe ones
    http_allow: ListSetting = Field(
        (), description="Internal targets http environments may reach: CIDRs or host names, comma-separated "
                        "(e.g. 127.0.0.1 for a local tool server). Default none: loopback, private, link-local, "
                        "multicast, reserved and numeric-encoded addresses are refused.")
    environment_modules: ListSetting = Field(
        (), description="Module prefixes whose Environment classes tenants may register as python environments, "
                        "beside the 'taper.environments' entry points of installed packages. Default none.")
    data_roots: ListSetting = Field(
        (), description="Directories that file options (retrieval corpus_path) may name files in, beside the "
                        "package's built-in data. Default: <data_dir>/files.")
    # the most a job may ask of the python environment's sandbox per call; unset: the built-in maxima
    # (rollout_workers.environments.policy.PythonSandboxMaxima)
    python_max_memory_mb: int | None = Field(None, description="Most address space (MB) per python tool call.")
    python_max_cpu_seconds: int | None = Field(None, description="Most CPU seconds per python tool call.")
    python_max_wall_seconds: float | None = Field(None, description="Most wall-clock seconds per python tool call.")
    python_max_output_bytes: int | None = Field(None, description="Most captured output per python tool call.")

    @field_validator("http_allow", "environment_modules", "data_roots", mode="before")
    @classmethod
    def _split_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            return tuple(json.loads(v)) if v.strip().startswith("[") else tuple(p.strip() for p in v.split(",") if p.strip())
        return v

    @field_validator("http_allow")
    @classmethod
    def _allow_entries(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        from rollout_workers.net_guard import AllowList

        AllowList.parse(v)
        return v

    @field_validator("environment_modules")
    @classmethod
    def _module_prefixes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for prefix in v:
            if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", prefix):
                raise ValueError(f"{prefix!r} is not a dotted module name")
        return v

    @model_validator(mode="after")
    def _python_maxima_valid(self) -> EnvironmentSettings:
        self._python_maxima()
        return self

    def _python_maxima(self) -> Any:
        from rollout_workers.environments.policy import PythonSandboxMaxima

        given = {name: getattr(self, f"python_max_{name}") for name in PythonSandboxMaxima.model_fields}
        try:
            return PythonSandboxMaxima(**{k: v for k, v in given.items() if v is not None})
        except ValidationError as e:
            err = e.errors()[0]
            raise ValueError(f"TAPER_PYTHON_MAX_{str(err['loc'][0]).upper()}: {err['msg']} "
                             f"(got {err.get('input')!r})") from None

    def environment_policy(self) -> EnvironmentPolicy:
        """The operator's limits in the form the environments take them."""
        from rollout_workers.environments.policy import BUILTIN_DATA_DIR, EnvironmentPolicy

        roots = [Path(r).resolve() for r in self.data_roots] or [(self.data_dir / "files").resolve()]
        return EnvironmentPolicy(
            http_allow=self.http_allow,
            environment_modules=self.environment_modules,
            data_roots=(BUILTIN_DATA_DIR, *roots),
            python_max=self._python_maxima(),
        )


class SettingsError(ValueError):
    """A setting from the environment has a bad value; the message names the variable."""


S = TypeVar("S", bound=BaseSettings)


def _variable_name(cls: type[BaseSettings], field: str) -> str:
    alias = cls.model_fields[field].validation_alias
    if isinstance(alias, AliasChoices):
        return str(alias.choices[0])
    return f"TAPER_{field.upper()}"


def load(cls: type[S]) -> S:
    """`cls()` from the environment; a bad value raises SettingsError naming each variable."""
    try:
        return cls()
    except ValidationError as e:
        problems = []
        for err in e.errors():
            if not err["loc"]:  # a rule across fields: its message names the variables
                problems.append(str(err["msg"]).removeprefix("Value error, "))
                continue
            field = str(err["loc"][0])
            name = _variable_name(cls, field) if field in cls.model_fields else field
            name += "".join(f"__{part}".upper() for part in err["loc"][1:])  # a nested one: TAPER_LIMITS__X
            problems.append(f"{name}: {err['msg']} (got {err.get('input')!r})")
        raise SettingsError("invalid setting: " + "; ".join(problems)) from None


def operator_environment_policy() -> EnvironmentPolicy:
    """The EnvironmentPolicy from this process's environment (the same TAPER_ variables the API reads)."""
    return load(EnvironmentSettings).environment_policy()
