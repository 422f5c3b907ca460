"""OpenAI request bodies (pydantic: a bad field is named in the HTTP 400) and the response
objects of /v1/completions and /v1/chat/completions, whole and as stream chunks."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOPS = 4  # stop strings per request, as OpenAI allows
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for completions
# what the server passes the chat template itself (and the tokenizer method's own name)
TEMPLATE_ARGUMENTS = {"messages", "add_generation_prompt", "self"}
SEED_BOUND = 2**63  # seeds are 64-bit signed integers, what a random key is made from


class Sampling(BaseModel):
    """The options both endpoints share. Unknown fields (user, logit_bias, ...) are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # -1 or 0: off
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-SEED_BOUND, lt=SEED_BOUND)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    return_token_ids: bool = False  # an extension: the generated ids beside the text

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @property
    def stops(self) -> list[str]:
        return self.stop or []


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str]
    max_tokens: int = Field(COMPLETION_MAX_TOKENS, ge=1)

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _default_limit(cls, v):
        return COMPLETION_MAX_TOKENS if v is None else v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("one prompt per request")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v):
        """A list of content parts (what OpenAI clients send for multi-part messages) -> their
        texts joined by newlines; parts other than text are refused by type."""
        return "\n".join(map(_part_text, v)) if isinstance(v, list) else v


def _part_text(part) -> str:
    if not isinstance(part, dict):
        raise ValueError("each content part must be an object with a 'type'")
    if part.get("type") != "text":
        raise ValueError(f"content parts of type {part.get('type')!r} are not supported; "
                         "only 'text'")
    if not isinstance(part.get("text"), str):
        raise ValueError("a text part needs 'text', a string")
    return part["text"]


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # variables of the chat template, e.g. {"enable_thinking": false} for Qwen3's
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _template_variables(cls, v):
        if isinstance(v, dict) and (taken := TEMPLATE_ARGUMENTS & set(v)):
            raise ValueError(f"{sorted(taken)} are set by the server, not by a request")
        return {} if v is None else v


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int, rounds: int = 0, accepted: int = 0) -> dict:
    """OpenAI's token counts; with speculative rounds, an extension `speculative`: the
    request's rounds and the tokens they committed per round."""
    out = dict(prompt_tokens=prompt, completion_tokens=completion,
               total_tokens=prompt + completion)
    if rounds:
        out["speculative"] = dict(rounds=rounds, tokens_per_round=round(accepted / rounds, 4))
    return out


def completion(rid: str, model: str, chat: bool, text: str, finish: str | None, used: dict,
               token_ids: list[int] | None = None) -> dict:
    """A whole response of either endpoint."""
    choice = dict(index=0, finish_reason=finish, logprobs=None)
    if chat:
        choice["message"] = dict(role="assistant", content=text)
    else:
        choice["text"] = text
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return dict(id=rid, object="chat.completion" if chat else "text_completion",
                created=int(time.time()), model=model, choices=[choice], usage=used)


def chunk(rid: str, model: str, chat: bool, text: str | None, finish: str | None,
          used: dict | None = None, role: bool = False, token_ids: list[int] | None = None) -> dict:
    """One server-sent event of a stream: a text delta, the finish reason, or (choices empty)
    the usage."""
    choices = []
    if text is not None or finish is not None:
        choice = dict(index=0, finish_reason=finish, logprobs=None)
        if chat:
            choice["delta"] = ({"role": "assistant"} if role else {}) | (
                {"content": text} if text is not None else {})
        else:
            choice["text"] = text or ""
        if token_ids is not None:
            choice["token_ids"] = token_ids
        choices.append(choice)
    out = dict(id=rid, object="chat.completion.chunk" if chat else "text_completion",
               created=int(time.time()), model=model, choices=choices)
    if used is not None:
        out["usage"] = used
    return out


def error(message: str, param: str | None = None, kind: str = "invalid_request_error",
          code: str | None = None) -> dict:
    return {"error": dict(message=message, type=kind, param=param, code=code)}
