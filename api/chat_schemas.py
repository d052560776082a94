"""Request and response models of `/v1/chat/completions`, shaped as OpenAI's (the fields Taper serves; any other
field is refused, naming it). The translation to the engine and back lives in api/chat_completions.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

MAX_TEXT = 131_072  # characters of one text (a longer message comes as several text parts; the body size limit binds too)
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT)


Content = Annotated[str, Field(max_length=MAX_TEXT)] | Annotated[list[TextPart], Field(min_length=1, max_length=256)]


class FunctionCall(_Strict):
    name: FunctionName
    arguments: str = Field(max_length=MAX_TEXT, description="The arguments as a JSON object in a string.")


class ToolCall(_Strict):
    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    """One message of the conversation (one model for every role, so that errors name `messages.N.FIELD`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = Field(None, description="Required except for an assistant message with tool_calls.")
    name: str | None = Field(None, max_length=64)
    tool_calls: list[ToolCall] | None = Field(None, max_length=64, description="assistant messages only")
    tool_call_id: str | None = Field(None, min_length=1, max_length=128, description="tool messages only (required)")
    refusal: str | None = Field(None, max_length=MAX_TEXT, description="assistant messages only")

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> Message:
        if self.role != "assistant":
            for name in ("tool_calls", "refusal"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: only an assistant message has it")
            if self.content is None:
                raise ValueError(f"content: a {self.role} message needs it")
        elif self.content is None and not self.tool_calls:
            raise ValueError("content: an assistant message needs content or tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool_call_id: a tool message needs it (and only a tool message has it)")
        return self


class FunctionDefinition(_Strict):
    name: FunctionName
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments object.")
    strict: bool | None = Field(None, description="Accepted; arguments are not constrained while sampling.")

    @field_validator("parameters")
    @classmethod
    def _a_json_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            import jsonschema

            try:
                jsonschema.validators.validator_for(v).check_schema(v)
            except jsonschema.exceptions.SchemaError as e:
                raise ValueError(f"not a valid JSON schema: {e.message}") from None
        return v


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class StreamOptions(_Strict):
    include_usage: bool | None = Field(None, description="Send a last chunk with `usage` (and `usage: null` before).")


class ChatCompletionRequest(_Strict):
    model: str = Field(min_length=1, max_length=96,
                       description="A checkpoint you may use: a job's `fine_tuned_model` (`JOB_ID`), `JOB_ID:STEP`, "
                                   "`base:NAME` or a preset (see /v1/models).")
    messages: list[Message] = Field(min_length=1, max_length=2048)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto"] | None = Field(
        None, description="auto (the default with tools): the model may call them; none: its text is the content.")
    parallel_tool_calls: bool | None = Field(None, description="false: at most the first tool call is returned.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=128, description="Choices (the operator's max_n binds).")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0: greedy. Default 1.")
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000,
                                              description="Per choice; the operator's bound binds.")
    max_tokens: int | None = Field(None, ge=1, le=1_000_000, description="Deprecated: max_completion_tokens.")
    stop: Annotated[str, Field(min_length=1, max_length=256)] | Annotated[
        list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=4)] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="Same seed, same request: same answer.")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[int, Field(ge=-100, le=100)]] | None = \
        Field(None, max_length=1024, description="Token id -> bias added to its logit.")
    user: str | None = Field(None, max_length=256, description="Accepted and ignored.")

    # field validators (not a model one): the error then names the field
    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return v

    @field_validator("stream_options")
    @classmethod
    def _with_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("only with stream: true")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _one_limit(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("max_completion_tokens") is not None:
            raise ValueError("give max_completion_tokens only (max_tokens is its deprecated name)")
        return v


# ---- responses ----
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class Choice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None
