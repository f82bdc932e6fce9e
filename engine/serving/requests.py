"""What the built-in server accepts and how it refuses: the OpenAI request bodies (unknown OpenAI
fields are ignored, as OpenAI-compatible servers do) and the OpenAI-shaped error answer, with the
checks on a raw JSON body that pydantic does not make (JSON constants, lone surrogates).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class Body(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM extension; -1 or 0: no top-k filter
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what a torch generator accepts
    n: int = Field(1, ge=1, le=1)  # one choice per request
    stream: bool = False
    stream_options: dict[str, Any] | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(Body):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(Body):
    prompt: str | list[int] = Field(min_length=1)


class APIError(Exception):
    """An OpenAI-shaped error answer."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def not_unicode(x: Any, path: str = "") -> str | None:
    """The path of the first string that is not valid Unicode (a lone surrogate such as "\\udcff",
    which JSON escapes can carry), or None."""
    if isinstance(x, str):
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(x, dict):
        for k, v in x.items():
            name = k.encode("utf-8", "backslashreplace").decode()  # the path is echoed: keep it encodable
            sub = f"{path}.{name}" if path else name
            bad = not_unicode(k, sub) or not_unicode(v, sub)
            if bad:
                return bad
    elif isinstance(x, list):
        for i, v in enumerate(x):
            bad = not_unicode(v, f"{path}[{i}]")
            if bad:
                return bad
    return None


def validation_error(err: ValidationError) -> APIError:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    return APIError(400, f"{loc}: {e['msg']}" if loc else e["msg"], param=loc or None)
