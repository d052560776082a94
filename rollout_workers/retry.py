"""Retries of requests to tenant-run servers (http and mcp tool servers, http graders), with tenacity:
exponential backoff with jitter from the registration's `backoff_s`, the number of retries it sets, and a
server's `Retry-After` honoured (capped) where it sends one. Only failures marked `Retryable` are retried;
anything else (a refused target, a timeout, a 4xx) ends the attempts at once."""

from __future__ import annotations

import email.utils
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt
from tenacity.wait import wait_base, wait_exponential_jitter

T = TypeVar("T")
MAX_RETRY_AFTER_S = 60.0  # the most a server's Retry-After makes a worker wait
MAX_BACKOFF_S = 60.0


class Retryable(Exception):
    """A failure worth another attempt (a connection error, a 429 or 5xx); `retry_after_s` is the server's
    Retry-After when it sent one."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def retry_after(value: str | None) -> float | None:
    """A Retry-After header's wait in seconds (delta-seconds or an HTTP date), capped; None when absent or
    unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return min(float(value), MAX_RETRY_AFTER_S)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return min(max(0.0, when.timestamp() - time.time()), MAX_RETRY_AFTER_S)


class _WaitRetryAfter(wait_base):
    """The server's Retry-After when the last failure carried one, else the backoff."""

    def __init__(self, backoff: wait_base) -> None:
        self.backoff = backoff

    def __call__(self, retry_state: RetryCallState) -> float:
        outcome = retry_state.outcome
        exc = outcome.exception() if outcome is not None else None
        if isinstance(exc, Retryable) and exc.retry_after_s is not None:
            return exc.retry_after_s
        return self.backoff(retry_state)


def _policy(retries: int, backoff_s: float) -> dict:
    backoff = wait_exponential_jitter(multiplier=backoff_s, max=MAX_BACKOFF_S, jitter=backoff_s)
    return {"stop": stop_after_attempt(retries + 1), "wait": _WaitRetryAfter(backoff),
            "retry": retry_if_exception_type(Retryable), "reraise": True}


def call_with_retries(attempt: Callable[[], T], retries: int, backoff_s: float) -> T:
    """`attempt()`, again after each `Retryable` failure, `retries` times at most; the last failure propagates."""
    return Retrying(**_policy(retries, backoff_s))(attempt)


async def acall_with_retries(attempt: Callable[[], Awaitable[T]], retries: int, backoff_s: float) -> T:
    return await AsyncRetrying(**_policy(retries, backoff_s))(attempt)
