"""The OpenAPI document, refined so that it describes what the server does: HTTP parameters are never null
(an absent parameter is how a client leaves one out), and the responses of the routes that create a resource
link to the operations on it (for generated clients and stateful API testing). `SchemaCheckedRoute` holds
JSON bodies to the published schema."""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any

import jsonschema
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError

# (method, collection path) of the routes that create a resource -> (path parameter of the resource's
# own paths, field of the created resource that fills it)
CREATED_RESOURCES: dict[tuple[str, str], tuple[str, str]] = {
    ("post", "/v1/jobs"): ("job_id", "id"),
    ("post", "/v1/environments"): ("name", "name"),
    ("post", "/v1/fine_tuning/jobs"): ("fine_tuning_job_id", "id"),
}


def install_openapi(app: FastAPI) -> None:
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()  # caches itself in app.openapi_schema
            _never_null_parameters(schema)
            _link_created_resources(schema)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _operations(schema: dict[str, Any]):
    for path, item in schema.get("paths", {}).items():
        for method, operation in item.items():
            if method in ("get", "put", "post", "delete", "patch", "head", "options", "trace"):
                yield path, method, operation


def _never_null_parameters(schema: dict[str, Any]) -> None:
    """`x: str | None = None` parameters are documented as `anyOf: [string, null]`: a client generator or
    a fuzzer would then send the text `null`. Keep the non-null branch."""
    for _, _, operation in _operations(schema):
        for parameter in operation.get("parameters", []):
            param_schema = parameter.get("schema", {})
            branches = param_schema.get("anyOf")
            if not branches:
                continue
            kept = [b for b in branches if b.get("type") != "null"]
            if len(kept) == 1 and len(kept) < len(branches):
                del param_schema["anyOf"]
                param_schema.update(kept[0])


def _link_created_resources(schema: dict[str, Any]) -> None:
    operations = list(_operations(schema))
    for (method, collection), (parameter, field) in CREATED_RESOURCES.items():
        creator = schema["paths"].get(collection, {}).get(method)
        if creator is None:
            continue
        prefix = f"{collection}/{{{parameter}}}"
        links = {
            operation["operationId"]: {
                "operationId": operation["operationId"],
                "parameters": {parameter: f"$response.body#/{field}"},
            }
            for path, _, operation in operations
            if path == prefix or path.startswith(prefix + "/")
        }
        for status, response in creator["responses"].items():
            if status.startswith("2") and links:
                response["links"] = links


class SchemaCheckedRoute(APIRoute):
    """A route whose JSON body must also match the operation's published schema. Pydantic's lax mode takes
    `true` or `"1"` for an integer, which the schema (and every client generated from it) calls invalid; such a
    body gets the 422 of a schema mismatch. A body pydantic rejects keeps pydantic's errors."""

    _validator: jsonschema.protocols.Validator | None = None

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None or not self.include_in_schema:
            return handler

        async def checked(request: Request) -> Response:
            await self._check_body(request)
            return await handler(request)

        return checked

    async def _check_body(self, request: Request) -> None:
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if not (content_type == "application/json" or content_type.endswith("+json")):
            return
        try:
            body = await request.json()
        except (ValueError, RecursionError):  # not JSON (or not UTF-8): the route's own validation answers
            return
        if self._validator is None:  # a route belongs to one app (include_router copies routes)
            self._validator = _body_validator(request.app.openapi(), self.path_format, next(iter(self.methods)))
        error = jsonschema.exceptions.best_match(self._validator.iter_errors(body))
        if error is None:
            return
        assert self.body_field is not None
        try:
            _adapter(self.body_field.field_info.annotation).validate_python(body)
        except ValidationError as exc:
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
        raise RequestValidationError([{"type": "schema_mismatch", "loc": ("body", *error.absolute_path),
                                       "msg": error.message}])


@functools.cache
def _adapter(annotation: Any) -> TypeAdapter:
    return TypeAdapter(annotation)


def _body_validator(document: dict[str, Any], path: str, method: str) -> jsonschema.protocols.Validator:
    """A validator of the JSON body of an operation of the OpenAPI ``document`` (an empty schema if none)."""
    operation = document["paths"].get(path, {}).get(method.lower(), {})
    schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    # the operation's schema refers to "#/components/schemas/...": give it the document's components
    return jsonschema.Draft202012Validator({**schema, "components": document.get("components", {})})
