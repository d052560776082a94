"""`x-request-id` on every response: the client's own (OpenAI's clients and proxies send one) when it is a
short printable token, else a fresh one. Kept in the request's scope state (`request_id`) for logs."""

from __future__ import annotations

import re
import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
# What is echoed: printable ASCII without spaces, quotes or separators a log line could be confused by.
_ACCEPTED = re.compile(rb"^[A-Za-z0-9._:/+=@-]{1,128}$")


def new_request_id() -> str:
    return "req_" + secrets.token_hex(16)


class RequestId:
    """Pure ASGI, outermost: answers written by other middleware (a 413, a 503) carry the id too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers", []) if k == HEADER), None)
        request_id = given.decode() if given is not None and _ACCEPTED.match(given) else new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)
