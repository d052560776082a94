"""The FastAPI application factory: routers, auth, errors as JSON naming the field, request size and JSON
depth limits,
Prometheus metrics and (in `lifespan`) the store, Ray and the scheduler loop."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from pydantic_core import PydanticSerializationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.openapi import install_openapi
from api.request_id import RequestId
from api.routers import (
    admin,
    chat,
    checkpoints,
    environments,
    files,
    fine_tuning,
    graders,
    jobs,
    models,
    system,
    uploads,
    webhooks,
)
from api.schemas import error_responses
from api.training_metrics import TrainingMetrics
from api.ui import router as ui_router
from rl_service.control.chat_engines import ChatEngines
from rl_service.control.openai_compat import openai_error
from rl_service.control.service import RateLimited, ServiceError, TaperService, error_field, plain_message
from rl_service.control.settings import TaperSettings, get_settings
from rl_service.json_limits import nesting_exceeds

log = logging.getLogger(__name__)

STORE_RETRY_AFTER_S = 5  # Retry-After of a 503 while Redis is unreachable
# Paths of OpenAI's API: their errors come in OpenAI's shape (`param`, `type`)
OPENAI_PATHS = ("/v1/files", "/v1/uploads", "/v1/fine_tuning", "/v1/models", "/v1/chat")


def error_response(status: int, code: str, message: str, field: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, "field": field}}, status_code=status,
                        headers=headers)


class BodySizeLimit:
    """Rejects request bodies over ``max_bytes`` (or the larger limit of a path in ``path_limits``, e.g. file
    uploads; a key ending in `/` covers the paths under it) with 413, by Content-Length or while streaming."""

    def __init__(self, app: ASGIApp, max_bytes: int, path_limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.default_max_bytes = max_bytes
        self.path_limits = path_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        max_bytes = self.path_limits.get(path) or next(
            (limit for prefix, limit in self.path_limits.items() if prefix.endswith("/") and path.startswith(prefix)),
            self.default_max_bytes)

        def too_big() -> JSONResponse:
            message = f"request body over {max_bytes} bytes"
            if path.startswith(OPENAI_PATHS):
                status, body = openai_error(413, message, "too_large", "body")
                return JSONResponse(body, status_code=status)
            return error_response(413, "too_large", message, "body")

        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = max_bytes + 1
                if declared > max_bytes:
                    return await too_big()(scope, receive, send)
        received = 0
        exceeded = False
        started = False

        async def limited_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    exceeded = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if exceeded:
                return  # the app's own answer to the aborted body (e.g. 400) is replaced by the 413
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyTooLarge:
            pass
        if exceeded and not started:
            await too_big()(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


class JsonDepthLimit:
    """Refuses JSON bodies that nest deeper than ``max_depth`` with 422, before anything parses them (the parser
    recurses per level: a deep enough body is a RecursionError). Runs inside BodySizeLimit, so the body it
    reads is bounded; bodies that are not JSON (file uploads) pass untouched."""

    def __init__(self, app: ASGIApp, max_depth: int) -> None:
        self.app = app
        self.max_depth = max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _may_be_json(scope):
            return await self.app(scope, receive, send)
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if nesting_exceeds(body, self.max_depth):
            response = error_response(422, "invalid", f"body: JSON nested deeper than {self.max_depth} levels "
                                                      "(arrays and objects)", "body")
            return await response(scope, receive, send)
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)


def _may_be_json(scope: Scope) -> bool:
    """A body FastAPI would parse as JSON: a JSON content type, or none at all."""
    for name, value in scope.get("headers", []):
        if name == b"content-type":
            media = value.split(b";")[0].strip().lower()
            return media == b"application/json" or media.endswith(b"+json")
    return scope.get("method") not in ("GET", "HEAD", "OPTIONS", "DELETE")


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed


class _JobsByState:
    def __init__(self, service: TaperService) -> None:
        self.service = service

    def collect(self):
        gauge = GaugeMetricFamily("taper_jobs", "Jobs by state", labels=["state"])
        try:
            for state, n in self.service.jobs.count_by_state().items():
                gauge.add_metric([state], n)
        except Exception:  # a scrape must not fail because Redis blinked
            pass
        yield gauge


def _field_of(loc: tuple[Any, ...], message: str = "") -> str:
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        return error_field(parts[1:], message) or parts[0]  # a check on the whole body may name its field
    return error_field(parts, message)


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, RateLimited) else None
        if exc.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return error_response(exc.status, exc.code, exc.message, exc.field, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request"}
        field = _field_of(tuple(first.get("loc", ())), str(first.get("msg", "")))
        if first.get("type") == "json_invalid":
            field = "body"  # its location is a character offset, not a field
        details = [{"field": _field_of(tuple(e.get("loc", ())), str(e.get("msg", ""))), "message": plain_message(e)}
                   for e in errors[:20]]
        message = plain_message(first)
        return JSONResponse(
            {"error": {"code": "invalid", "field": field, "details": details,
                       "message": message if message.startswith(f"{field}:") else f"{field}: {message}"}},
            status_code=422,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
        return error_response(exc.status_code, code, str(exc.detail), None, headers)

    @app.exception_handler(UnicodeError)
    async def _unicode_error(request: Request, exc: UnicodeError) -> JSONResponse:
        return error_response(422, "invalid", "strings must be valid Unicode (no lone surrogates)", "body")

    @app.exception_handler(PydanticSerializationError)
    async def _serialization_error(request: Request, exc: PydanticSerializationError) -> JSONResponse:
        return error_response(422, "invalid", f"value cannot be stored: {exc}", "body")

    @app.exception_handler(redis.ConnectionError)
    @app.exception_handler(redis.TimeoutError)
    async def _store_unavailable(request: Request, exc: redis.RedisError) -> JSONResponse:
        log.warning("job store unreachable on %s %s: %s", request.method, request.url.path, exc)
        return error_response(503, "unavailable", "the job store (Redis) is unreachable; retry shortly", None,
                              {"Retry-After": str(STORE_RETRY_AFTER_S)})

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal", "internal error", None)


def _allowed_methods(request: Request) -> list[str]:
    """The methods of the request's path over all the app's routes: a route serves one path and some methods,
    and several routes can share a path (Starlette's own 405 names only the first one's)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if isinstance(route, Route) and route.methods and route.matches(request.scope)[0] != Match.NONE:
            methods |= route.methods
    return sorted(methods)


class RequestMetrics:
    """Counts and times requests per route template (pure ASGI: no extra task per request)."""

    def __init__(self, app: ASGIApp, registry: CollectorRegistry) -> None:
        self.app = app
        self.requests = Counter("taper_http_requests", "HTTP requests", ["method", "route", "status"],
                                registry=registry)
        self.latency = Histogram("taper_http_request_seconds", "HTTP request latency", ["method", "route"],
                                 registry=registry, buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.requests.labels(scope["method"], route, str(status)).inc()
            self.latency.labels(scope["method"], route).observe(time.perf_counter() - start)


def create_app(
    service: TaperService | None = None,
    settings: TaperSettings | None = None,
    *,
    run_scheduler: bool = True,
    runner: str | type | None = None,
) -> FastAPI:
    """The API. With ``service`` given (tests) nothing is started; otherwise the lifespan connects to Redis
    (or starts a private one), joins or starts Ray, and runs the scheduler loop in this process."""
    settings = settings or get_settings()
    registry = CollectorRegistry()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime = None
        if app.state.service is None:
            from rl_service.control.service.runtime import start_runtime

            runtime = start_runtime(settings, run_scheduler=run_scheduler, runner=runner,
                                    detached_scheduler=settings.embedded_scheduler)
            app.state.service = runtime.service
            app.state.chat_engines = ChatEngines(runtime.service, settings.chat, ray_address=settings.ray_address)
            registry.register(_JobsByState(runtime.service))
            registry.register(TrainingMetrics(runtime.service, job_labels=settings.metrics_job_labels))
        try:
            yield
        finally:
            if app.state.chat_engines is not None:
                app.state.chat_engines.close()
            if runtime is not None:
                runtime.stop()

    app = FastAPI(
        title="Taper",
        version="0.1.0",
        description="Agentic RL post-training service: submit RL jobs, register tool environments and steer the "
        "dense-to-sparse process-reward schedule while a job runs.",
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.chat_engines = ChatEngines(service, settings.chat, ray_address=settings.ray_address) if service else None
    app.state.prometheus = registry
    app.state.metrics_public = settings.metrics_public
    if service is not None:
        registry.register(_JobsByState(service))
        registry.register(TrainingMetrics(service, job_labels=settings.metrics_job_labels))
    upload_bytes = settings.task_files.max_bytes + 1024 * 1024  # the file and its multipart framing
    app.add_middleware(JsonDepthLimit, max_depth=settings.max_json_depth)  # inside the size limit
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes,
                       path_limits={"/v1/files": max(upload_bytes, settings.max_request_bytes),
                                    "/v1/uploads/": max(upload_bytes, settings.max_request_bytes)})
    app.add_middleware(RequestMetrics, registry=registry)
    app.add_middleware(RequestId)  # outermost: every answer carries x-request-id
    _install_errors(app)
    for r in (jobs.router, checkpoints.router, environments.router, admin.router, webhooks.router, system.router):
        app.include_router(r, responses=error_responses(401) if r is not system.router else None)
    for r in (fine_tuning.router, graders.router, files.router, uploads.router, models.router, chat.router):
        app.include_router(r)  # OpenAI's routes document their own (OpenAI-shaped) errors
    app.include_router(ui_router)
    install_openapi(app)
    return app
