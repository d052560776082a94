"""The service's errors, each with its HTTP status and the field it names, and how pydantic and ValueError
messages become one of them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from reward_models.schedule import RewardSchedule
from rl_service.spec import JobSpec
from rollout_workers.environments.registration_schema import STDIO_FIELDS


class ServiceError(Exception):
    status: int = 400
    code: str = "bad_request"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class NotFound(ServiceError):
    status, code = 404, "not_found"


class Conflict(ServiceError):
    status, code = 409, "conflict"


class TooLarge(ServiceError):
    status, code = 413, "too_large"


class InvalidInput(ServiceError):
    status, code = 422, "invalid"


class Unauthorized(ServiceError):
    status, code = 401, "unauthorized"


class Forbidden(ServiceError):
    status, code = 403, "forbidden"


def job_not_found(job_id: str) -> NotFound:
    # the same answer for another tenant's job as for a missing one: ids do not leak across tenants
    return NotFound(f"job {job_id!r} not found", field="job_id")


class RateLimited(ServiceError):
    status, code = 429, "rate_limited"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QuotaExceeded(ServiceError):
    status, code = 429, "quota_exceeded"


def _model_field_names(model: type[BaseModel], out: set[str] | None = None) -> set[str]:
    out = set() if out is None else out
    for name, info in model.model_fields.items():
        out.add(name)
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel) and ann is not model:
            _model_field_names(ann, out)
    return out


# fields a model-level check names first in its message (a registration's refused stdio keys among them)
_KNOWN_FIELDS = _model_field_names(JobSpec) | _model_field_names(RewardSchedule) | set(STDIO_FIELDS)


def plain_message(error: dict[str, Any]) -> str:
    """A pydantic error's message without the prefix pydantic puts on errors raised in validators."""
    return str(error.get("msg", "")).removeprefix("Value error, ").removeprefix("Assertion failed, ")


def error_field(loc: tuple[Any, ...] | list[Any], message: str) -> str:
    """The dotted field of a pydantic error. A model-level check ("half_life is required ...") has no
    location of its own, so the field its message starts with is appended."""
    parts = [str(p) for p in loc if p != "__root__"]
    head = message.removeprefix("Value error, ").split(" ", 1)[0].split(":", 1)[0].strip("'\"`")
    if head in _KNOWN_FIELDS and (not parts or parts[-1] != head):
        parts.append(head)
    return ".".join(parts)


def invalid_from(exc: ValidationError | ValueError, prefix: str = "") -> InvalidInput:
    """An InvalidInput naming the first offending field of a pydantic error (or the message of a ValueError)."""
    if isinstance(exc, ValidationError) and exc.errors():
        err = exc.errors()[0]
        msg = plain_message(err) or str(exc)
        field = ".".join(p for p in (prefix, error_field(err.get("loc", ()), msg)) if p) or None
        return InvalidInput(f"{field or 'body'}: {msg}", field=field)
    return InvalidInput(str(exc), field=prefix or None)


def named_invalid(exc: ValueError) -> InvalidInput:
    """An InvalidInput for a ValueError whose message starts with the dotted field ("options.memory_mb: ...")."""
    message = str(exc)
    head = message.split(":", 1)[0]
    field = head if head.replace(".", "").replace("_", "").isalnum() else None
    return InvalidInput(message, field=field)
