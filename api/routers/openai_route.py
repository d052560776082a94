"""The route class of the OpenAI-compatible routes (/v1/fine_tuning, /v1/files, /v1/uploads, /v1/models):
every error (auth, validation, service rules) answers in OpenAI's shape, `error.param` naming the field."""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.openapi import SchemaCheckedRoute
from rl_service.control.openai_compat import openai_error, openai_error_of
from rl_service.control.service import RateLimited, ServiceError, error_field, plain_message

# Parts of a pydantic error location that name a branch of a union, not a field ("literal['auto']", "int")
_UNION_BRANCH = re.compile(r"^(int|float|str|bool|none|dict\[.*|list\[.*|literal\[.*|constrained-.*|function-.*)$")


def _param(loc: tuple[Any, ...], message: str) -> str:
    parts = [p for p in loc if not (isinstance(p, str) and _UNION_BRANCH.match(p))]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:] or parts
    return error_field(parts, message) or "body"


class OpenAIRoute(SchemaCheckedRoute):
    """A route whose errors (auth, validation, service rules) answer in OpenAI's error shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def openai_errors(request: Request) -> Response:
            try:
                return await handler(request)
            except ServiceError as exc:
                status, body = openai_error_of(exc)
                headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, RateLimited) else None
                if exc.status == 401:
                    headers = {"WWW-Authenticate": "Bearer"}
                return JSONResponse(body, status_code=status, headers=headers)
            except RequestValidationError as exc:
                first = (exc.errors() or [{"loc": ("body",), "msg": "invalid request"}])[0]
                msg = plain_message(first) or "invalid request"
                param = "body" if first.get("type") == "json_invalid" else _param(tuple(first.get("loc", ())), msg)
                # a request that does not match the schema: OpenAI's 400; one that matches it but breaks a rule the
                # schema cannot state (a validator's ValueError: fields that must agree, a formula that must parse)
                # gets the 422 the service gives any schema-valid request it refuses
                rule = first.get("type") in ("value_error", "assertion_error")
                status, body = openai_error(422 if rule else 400, f"{param}: {msg}", "invalid", param)
                return JSONResponse(body, status_code=status)
            except StarletteHTTPException as exc:
                status, body = openai_error(exc.status_code, str(exc.detail), None, None)
                return JSONResponse(body, status_code=status, headers=getattr(exc, "headers", None))

        return openai_errors
