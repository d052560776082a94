"""Service settings, read from the environment (prefix ``TAPER_``; ``RAY_ADDRESS`` as Ray names it). The limits on
tenants' environments are declared in ``rl_service.environment_settings`` (a job driver reads them too).

The python sandbox's ``TAPER_SANDBOX_*`` are read in ``rollout_workers.environments.sandbox`` instead: the
Ray workers that run it do not import the service."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from pydantic import AliasChoices, Field, field_validator, model_validator

from rl_service.control.quota import ChatSettings, JobLimits, TenantQuota
from rl_service.environment_settings import EnvironmentSettings, SettingsError, load
from rl_service.task_files import TaskFileLimits

__all__ = ["SettingsError", "TaperSettings", "get_settings", "load_settings"]


class TaperSettings(EnvironmentSettings):
    """Every setting of the service; the environments' limits and data_dir come from EnvironmentSettings."""

    redis_url: str | None = Field(
        None, description="Redis to use. Unset: the service starts a private redis-server under data_dir."
    )
    ray_address: str | None = Field(
        None,
        validation_alias=AliasChoices("RAY_ADDRESS", "TAPER_RAY_ADDRESS"),
        description="Ray cluster to join. Unset: a local Ray is started.",
    )
    api_host: str = "127.0.0.1"
    api_port: int = Field(8000, ge=1, le=65535)
    api_url: str = Field("http://127.0.0.1:8000", description="Where the CLI finds the API.")
    embedded_scheduler: bool = Field(
        True, description="On the embedded setup (no TAPER_REDIS_URL, no RAY_ADDRESS) `taper serve` keeps a "
                          "scheduler process running beside the API, so jobs are placed and recovered while no "
                          "API runs; `taper down` stops it.")
    api_key: str | None = Field(None, description="Bearer key the CLI sends.")
    max_request_bytes: int = Field(1_000_000, ge=1024, description="Largest accepted request body.")
    max_json_depth: int = Field(
        64, ge=8, le=1000, description="Deepest nesting of arrays and objects in a JSON body or task-file line; "
                                       "deeper is refused (422) before it is parsed.")
    metrics_public: bool = Field(
        False, description="Serve /metrics without a key. Off: a scrape needs an admin key (Authorization: Bearer), "
                           "since the series name tenants and jobs. Turn it on only where the API's port is not "
                           "reachable by tenants (a separate, operator-only network path to the scraper).")
    metrics_job_labels: bool = Field(
        True, description="Label the job series of /metrics with tenant and job. Off: each series is the mean over "
                          "an environment's running jobs (labelled by environment only), and the queue depth one "
                          "total.")
    submit_rate_per_minute: int = Field(60, ge=1, description="Job submissions per tenant per minute.")
    local_cpus: int | None = Field(None, ge=1, description="CPUs a locally started Ray may use (default: all).")
    redis_server_bin: str = Field("redis-server", description="The binary the private Redis is started from.")
    job_runner: str = Field(
        "rl_service.training.runner:JobRunner", pattern=r"^[\w.]+:\w+$", description="Import path of the job runner class."
    )
    driver_heartbeat_every_s: float = Field(
        10.0, gt=0.0, description="A job driver writes its heartbeat to Redis at most this often while it progresses."
    )
    driver_heartbeat_timeout_s: float = Field(
        900.0, gt=0.0,
        description="A running job whose driver has made no progress for this long, on top of its current phase's "
                    "own deadline (rollouts: the chunk deadline; training: the learner-rank deadline), is hung: "
                    "killed and resumed from its last checkpoint. Must exceed driver_heartbeat_every_s and the "
                    "longest single call a job makes without progress (engine start, one weight push, one "
                    "checkpoint write).",
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
    model_aliases: dict[str, str] = Field(
        default_factory=dict,
        description="Other names of models for the OpenAI-compatible routes, e.g. an OpenAI model id an RFT script "
                    'sends -> a preset or base:NAME (JSON: {"o4-mini-2025-04-16": "small"}).')
    task_files: TaskFileLimits = Field(
        default_factory=TaskFileLimits,
        description="Limits on uploaded task files (TAPER_TASK_FILES__MAX_BYTES=..., __MAX_LINES, __MAX_LINE_BYTES, "
                    "__MAX_FILES per tenant).")
    chat: ChatSettings = Field(
        default_factory=ChatSettings,
        description="Engines behind /v1/chat/completions: idle timeout, per-request token bound, engine sizes "
                    "(TAPER_CHAT__IDLE_TIMEOUT_S=300, TAPER_CHAT__MAX_COMPLETION_TOKENS=2048, ...).")
    events_maxlen: int = Field(10_000, ge=100, description="Events kept per job (older ones are trimmed).")
    metrics_maxlen: int = Field(100_000, ge=100, description="Metric rows kept per job (older ones are trimmed).")
    schedule_max_versions: int = Field(
        1_000, ge=1, description="Reward-schedule versions per job; a patch beyond is refused.")

    @field_validator("base_models")
    @classmethod
    def _base_model_names(cls, v: dict[str, Path]) -> dict[str, Path]:
        from rl_service.spec import BASE_MODEL_NAME

        for name in v:
            if not re.fullmatch(BASE_MODEL_NAME, name):
                raise ValueError(f"base model name {name!r}: use 1-64 of A-Z, a-z, 0-9, '_', '.', '-'")
        return v

    @field_validator("model_aliases")
    @classmethod
    def _aliases_name_models(cls, v: dict[str, str]) -> dict[str, str]:
        from rl_service.spec import BASE_MODEL_NAME

        for alias, target in v.items():
            if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,96}", alias):
                raise ValueError(f"model alias {alias!r}: use 1-96 of A-Z, a-z, 0-9, '_', '.', ':', '-'")
            if not re.fullmatch(rf"tiny|small|large|base:{BASE_MODEL_NAME}", target):
                raise ValueError(f"model alias {alias!r}: names a preset (tiny, small, large) or base:NAME, "
                                 f"not {target!r}")
        return v

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


def load_settings() -> TaperSettings:
    return load(TaperSettings)


@lru_cache
def get_settings() -> TaperSettings:
    return load_settings()
