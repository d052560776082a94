"""Service settings: the one place that reads the environment (prefix ``TAPER_``; ``RAY_ADDRESS`` as Ray names it).

The python sandbox's ``TAPER_SANDBOX_*`` are read in ``rollout_workers.environments.sandbox`` instead: the
Ray workers that run it do not import the service."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AliasChoices, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from rl_service.quota import JobLimits, TenantQuota
from rl_service.task_files import TaskFileLimits

if TYPE_CHECKING:
    from rollout_workers.environments.policy import EnvironmentPolicy

# a list setting: comma-separated ("10.0.0.0/8,tools.internal") or a JSON list
ListSetting = Annotated[tuple[str, ...], NoDecode]


class TaperSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TAPER_", env_nested_delimiter="__", extra="ignore")

    redis_url: str | None = Field(
        None, description="Redis to use. Unset: the service starts a private redis-server under data_dir."
    )
    data_dir: Path = Field(Path("taper_data"), description="Checkpoints, trajectories, logs and the private Redis.")
    ray_address: str | None = Field(
        None,
        validation_alias=AliasChoices("RAY_ADDRESS", "TAPER_RAY_ADDRESS"),
        description="Ray cluster to join. Unset: a local Ray is started.",
    )
    api_host: str = "127.0.0.1"
    api_port: int = Field(8000, ge=1, le=65535)
    api_url: str = Field("http://127.0.0.1:8000", description="Where the CLI finds the API.")
    api_key: str | None = Field(None, description="Bearer key the CLI sends.")
    max_request_bytes: int = Field(1_000_000, ge=1024, description="Largest accepted request body.")
    submit_rate_per_minute: int = Field(60, ge=1, description="Job submissions per tenant per minute.")
    local_cpus: int | None = Field(None, ge=1, description="CPUs a locally started Ray may use (default: all).")
    redis_server_bin: str = Field("redis-server", description="The binary the private Redis is started from.")
    job_runner: str = Field(
        "rl_service.job:JobRunner", pattern=r"^[\w.]+:\w+$", description="Import path of the job runner class."
    )
    driver_heartbeat_every_s: float = Field(
        10.0, gt=0.0, description="A job driver writes its heartbeat to Redis at most this often while it progresses."
    )
    driver_heartbeat_timeout_s: float = Field(
        900.0, gt=0.0,
        description="A running job whose driver has not beaten for this long is hung: killed and resumed from its "
                    "last checkpoint. Must exceed driver_heartbeat_every_s and the longest single call a job makes "
                    "without progress (engine start, one weight push, one checkpoint write).",
    )
    limits: JobLimits = Field(
        default_factory=JobLimits,
        description="The operator's maxima for every job (TAPER_LIMITS__LEARNER_CPUS=8, ..., or TAPER_LIMITS as JSON).")
    default_quota: TenantQuota = Field(
        default_factory=TenantQuota,
        description="The quota of a tenant an admin gave none (TAPER_DEFAULT_QUOTA__MAX_RUNNING_JOBS=2, ...).")
    base_models: dict[str, Path] = Field(
        default_factory=dict,
        description="Model directories tenants may start from as `model.checkpoint: base:NAME` "
                    '(JSON: {"NAME": "/models/dir"}).')
    task_files: TaskFileLimits = Field(
        default_factory=TaskFileLimits,
        description="Limits on uploaded task files (TAPER_TASK_FILES__MAX_BYTES=..., __MAX_LINES, __MAX_LINE_BYTES, "
                    "__MAX_FILES per tenant).")
    events_maxlen: int = Field(10_000, ge=100, description="Events kept per job (older ones are trimmed).")
    metrics_maxlen: int = Field(100_000, ge=100, description="Metric rows kept per job (older ones are trimmed).")
    schedule_max_versions: int = Field(
        1_000, ge=1, description="Reward-schedule versions per job; a patch beyond is refused.")

    @field_validator("base_models")
    @classmethod
    def _base_model_names(cls, v: dict[str, Path]) -> dict[str, Path]:
        import re

        from rl_service.spec import BASE_MODEL_NAME

        for name in v:
            if not re.fullmatch(BASE_MODEL_NAME, name):
                raise ValueError(f"base model name {name!r}: use 1-64 of A-Z, a-z, 0-9, '_', '.', '-'")
        return v

    # ---- what tenants' environments may do (DESIGN.md section 10); the defaults are the safe ones
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
    def _python_maxima_valid(self) -> TaperSettings:
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

    @model_validator(mode="after")
    def _heartbeat_timeout_exceeds_interval(self) -> TaperSettings:
        if self.driver_heartbeat_timeout_s <= self.driver_heartbeat_every_s:
            raise ValueError("TAPER_DRIVER_HEARTBEAT_TIMEOUT_S must exceed TAPER_DRIVER_HEARTBEAT_EVERY_S")
        return self

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return v


class SettingsError(ValueError):
    """A setting from the environment has a bad value; the message names the variable."""


def _variable_name(field: str) -> str:
    alias = TaperSettings.model_fields[field].validation_alias
    if isinstance(alias, AliasChoices):
        return str(alias.choices[0])
    return f"TAPER_{field.upper()}"


def load_settings() -> TaperSettings:
    try:
        return TaperSettings()
    except ValidationError as e:
        problems = []
        for err in e.errors():
            if not err["loc"]:  # a rule across fields: its message names the variables
                problems.append(str(err["msg"]).removeprefix("Value error, "))
                continue
            field = str(err["loc"][0])
            name = _variable_name(field) if field in TaperSettings.model_fields else field
            name += "".join(f"__{part}".upper() for part in err["loc"][1:])  # a nested one: TAPER_LIMITS__X
            problems.append(f"{name}: {err['msg']} (got {err.get('input')!r})")
        raise SettingsError("invalid setting: " + "; ".join(problems)) from None


@lru_cache
def get_settings() -> TaperSettings:
    return load_settings()
