"""/v1/chat/completions: OpenAI's chat completions on any checkpoint the tenant may use. Thin: the translation
lives in api/chat_completions.py, the engines in rl_service.control.chat_engines."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from api.chat_completions import chunks, completion, engine_call
from api.chat_schemas import ChatCompletion, ChatCompletionRequest
from api.openai_schemas import openai_error_responses
from api.routers.dependencies import Who
from api.routers.openai_route import OpenAIRoute
from rl_service.control.chat_engines import ChatEngines

router = APIRouter(tags=["chat (OpenAI-compatible)"], route_class=OpenAIRoute)


async def get_engines(request: Request) -> ChatEngines:
    return request.app.state.chat_engines


Engines = Annotated[ChatEngines, Depends(get_engines)]
_ERRORS = openai_error_responses(400, 401, 404, 413, 422, 429, 503)
_STREAM = {"text/event-stream": {"schema": {"type": "string", "description": "`data: {chat.completion.chunk}` "
                                            "events, then `data: [DONE]` (with `stream: true`)"}}}


@router.post("/v1/chat/completions", response_model=ChatCompletion, summary="Chat with a checkpoint",
             responses={**_ERRORS, 200: {"content": _STREAM}})
async def create_chat_completion(body: ChatCompletionRequest, who: Who, engines: Engines) -> Any:
    stream = await engines.open(who, body.model, engine_call(body, engines.settings))
    if body.stream:
        return StreamingResponse(chunks(body, stream), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await completion(body, stream)
