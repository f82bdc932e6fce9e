"""What the built-in server accepts and how it refuses: the OpenAI request bodies (with vLLM's
peer-client fields `ignore_eos` and `min_tokens`) and the OpenAI-shaped error answer, with the
checks on a raw JSON body that pydantic does not make (JSON constants, lone surrogates).

A field the server cannot honour is refused with a 400 naming it, never dropped in silence: a
benchmark client that asks for penalties or log-probabilities must not measure something else than
it asked for. Such a field passes only at the value that changes nothing (`NEUTRAL`); request
metadata that never changes the output (`METADATA`) is accepted as is.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError


# Fields OpenAI clients and vLLM's benchmark send that the engine does not implement, each with the
# values that leave the output unchanged (vllm bench serve sends repetition_penalty=1.0 and logprobs=null).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0), "logprobs": (None, False), "top_logprobs": (None, 0), "prompt_logprobs": (None,),
    "echo": (None, False), "best_of": (None, 1), "logit_bias": (None, {}), "suffix": (None, ""),
    "response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none"),
    "stop_token_ids": (None, []), "use_beam_search": (None, False), "skip_special_tokens": (None, True),
    "include_stop_str_in_output": (None, False), "spaces_between_special_tokens": (None, True),
}
METADATA = frozenset({"user", "metadata", "store"})  # never change what is generated


class Body(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="allow")  # checked by `unsupported`: refused by name, never ignored

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
    ignore_eos: bool = False  # vLLM extension: end-of-sequence does not end the request
    min_tokens: int = Field(0, ge=0)  # vLLM extension: no end-of-sequence or stop string before this many tokens

    def unsupported(self) -> "APIError | None":
        """A 400 naming the first field this server cannot honour (at the value given), or None."""
        for name, value in (self.model_extra or {}).items():
            if name in METADATA:
                continue
            if name in NEUTRAL:
                if any(type(value) is type(ok) and value == ok for ok in NEUTRAL[name] if ok is not None) \
                        or value is None:
                    continue
                allowed = ", ".join(json.dumps(v) for v in NEUTRAL[name])
                return APIError(400, f"{name}={json.dumps(value)[:80]} is not supported by this server (it does "
                                     f"not implement {name}; allowed: {allowed})", param=name, code="unsupported_field")
            return APIError(400, f"unknown field '{name}': this server does not implement it and refuses it "
                                 "rather than ignore it", param=name, code="unsupported_field")
        return None


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
