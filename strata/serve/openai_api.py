"""The OpenAI wire format: request bodies validated into plain dataclasses, response and chunk builders, error JSON.

Validation is strict about types and ranges (a wrong type is a 400 naming the field, what was sent and what is
allowed) and lenient about presence: unknown fields are ignored, so clients that send extra fields keep working.
"""
from __future__ import annotations

import json
import math
import re
import secrets
import time
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal, NamedTuple, Optional, Union

import annotated_types as at
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

# --- errors -----------------------------------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
                503: "server_busy_error"}


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


# --- body decoding ----------------------------------------------------------------------------------------------------

def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def parse_json_body(raw: bytes) -> dict:
    """bytes -> the JSON object of a request body, or ApiError(400) saying exactly what is wrong with it."""
    if not raw.strip():
        raise bad(None, "the request body is empty: send a JSON object, e.g. "
                        '{"messages": [{"role": "user", "content": "Hello"}]}', code="empty_body")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(None, f"the request body is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}): "
                        f"send JSON encoded as UTF-8", code="invalid_encoding") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise bad(None, f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} "
                        f"(char {e.pos})", code="invalid_json") from None
    except ValueError as e:
        raise bad(None, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad(None, "the request body is nested too deeply to parse", code="invalid_json") from None
    if not isinstance(value, dict):
        raise bad(None, f"the request body must be a JSON object, got a JSON {_json_type(value)}",
                  code="invalid_json")
    _check_depth(value)
    if _SURROGATE_ESCAPE.search(text):      # only a \u escape can make one: the bytes were valid UTF-8
        value = _without_lone_surrogates(value)
    return value


MAX_DEPTH = 64
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abAB]|\\u[dD][c-fC-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_depth(value: Any) -> None:
    """Refuse a body nested deeper than MAX_DEPTH (what is read further recurses: templates, tool schemas)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad(None, f"the request body is nested too deeply: at most {MAX_DEPTH} levels of arrays and objects",
                      code="invalid_json")
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values() if isinstance(x, (dict, list)))
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v if isinstance(x, (dict, list)))


def _without_lone_surrogates(v: Any) -> Any:
    """JSON may escape a lone UTF-16 surrogate (\\ud800), which no text encoding can carry: each becomes U+FFFD."""
    if isinstance(v, str):
        return _LONE_SURROGATE.sub("\ufffd", v)
    if isinstance(v, dict):
        return {_without_lone_surrogates(k): _without_lone_surrogates(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_without_lone_surrogates(x) for x in v]
    return v


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _show(v: Any) -> str:
    s = json.dumps(v, ensure_ascii=False) if not isinstance(v, float) or math.isfinite(v) else repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _wrong_type(param: str, v: Any, want: str) -> ApiError:
    return bad(param, f"{param} must be {want}, got {_json_type(v)} {_show(v)}", code="invalid_type")


# --- the bodies, declared once --------------------------------------------------------------------------------------
#
# Each body is a pydantic model; each field is one declaration: `name: Int(lo, hi, what) = Field(None, description=...)`.
# The field's type (Int, Num, Bool, Str, Choice, or any pydantic type) checks what was sent and says what is wrong in
# the words of today's API errors ("top_k must be in [-1, 151936] (0 or -1 = off), got 2147483648"); the same
# declaration gives the OpenAPI schema (GET /openapi.json). A check that depends on the model (the vocabulary, the
# context) reads it from the validation context: `ChatRequest.parse(body, limits)`. JSON null means "not given", as
# in the OpenAI API; unknown fields are ignored, so clients that send extra fields keep working.

def _refuse(say: Callable[[str], str], code: str = "invalid_value", sub: str = "") -> PydanticCustomError:
    """A validation error whose message is say(param); param is the field's path (plus `sub`, a path below it)."""
    return PydanticCustomError(code, "refused", {"say": say, "code": code, "sub": sub})


def _wrong_type_say(v: Any, want: str) -> Callable[[str], str]:
    return lambda p: f"{p} must be {want}, got {_json_type(v)} {_show(v)}"


def _wrong(v: Any, want: str, sub: str = "") -> PydanticCustomError:
    return _refuse(_wrong_type_say(v, want), "invalid_type", sub)


@dataclass(frozen=True)
class Limits:
    """What a body is checked against besides its own rules: the served model's vocabulary and context, and the
    server's slots (one per choice)."""
    vocab_size: int = 1 << 31
    max_context: int = 1 << 31
    slots: int = 1 << 31
    control_vector: bool = True          # a control vector is loaded (a request may scale it)


def _limits(info: ValidationInfo) -> Limits:
    return (info.context or {}).get("limits") or Limits()


def _bound(b, info):
    return b(_limits(info)) if callable(b) else b


def Int(lo: int | None = None, hi=None, what: str = "") -> Any:
    """An integer (an integral float such as 2.0 is taken) in [lo, hi]; hi may be a function of Limits."""
    def check(v, info: ValidationInfo):
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            else:
                raise _wrong(v, "an integer" + (f" {what}" if what else ""))
        top = _bound(hi, info)
        if (lo is not None and v < lo) or (top is not None and v > top):
            rng = f"at least {lo}" if top is None else f"in [{lo}, {top}]"
            raise _refuse(lambda p: f"{p} must be {rng}{(' ' + what) if what else ''}, got {v}", "out_of_range")
        return v
    inner = Annotated[int, at.Ge(lo)] if lo is not None else int
    if hi is not None and not callable(hi):
        inner = Annotated[inner, at.Le(hi)]
    return Annotated[Optional[inner], BeforeValidator(check)]


def Num(lo: float, hi: float, lo_open: bool = False, what: str = "") -> Any:
    """A finite number in [lo, hi] ((lo, hi] with lo_open)."""
    def check(v, info: ValidationInfo):
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _wrong(v, "a number")
        try:
            v = float(v)
        except OverflowError:                     # an integer beyond any float
            v = math.inf if v > 0 else -math.inf
        if not (math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi):
            rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise _refuse(lambda p: f"{p} must be in {rng}{(' ' + what) if what else ''}, got {_show(v)}",
                          "out_of_range")
        return v
    return Annotated[Optional[Annotated[float, at.Gt(lo) if lo_open else at.Ge(lo), at.Le(hi)]], BeforeValidator(check)]


def _check_bool(v):
    if v is not None and not isinstance(v, bool):
        raise _wrong(v, "a boolean (true or false)")
    return v


Bool = Annotated[Optional[bool], BeforeValidator(_check_bool)]


def Str(max_chars: int | None = None) -> Any:
    def check(v):
        if v is None:
            return None
        if not isinstance(v, str):
            raise _wrong(v, "a string")
        if max_chars is not None and len(v) > max_chars:
            raise _refuse(lambda p: f"{p} must be at most {max_chars} characters, got {len(v)}", "out_of_range")
        return v
    return Annotated[Optional[Annotated[str, at.MaxLen(max_chars)] if max_chars else str], BeforeValidator(check)]


def Choice(*choices: str) -> Any:
    def check(v):
        if v is None:
            return None
        if not isinstance(v, str):
            raise _wrong(v, "a string, one of " + ", ".join(choices))
        if v not in choices:
            raise _refuse(lambda p: f"{p} must be one of {', '.join(choices)}, got {_show(v)}")
        return v
    return Annotated[Optional[Literal[choices]], BeforeValidator(check)]


def Refused(why: Callable[[Any], str | None], code: str = "unsupported") -> Callable[[Any], Any]:
    """A before-validator for a field this server does not support (yet) beyond some values: why(v) -> the refusal
    (with {param} for the field's name), or None for a value it takes."""
    def check(v):
        if v is None:
            return None
        reason = why(v)
        if reason is not None:
            raise _refuse(lambda p: reason.replace("{param}", p, 1), code)
        return v
    return BeforeValidator(check)


MAX_STOP = 16
MAX_STOP_CHARS = 256
ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
MAX_SEED = 2 ** 63
TOKENS_WHAT = "(the number of tokens to generate)"


def _check_stop(v):
    if v is None:
        return ()
    one = isinstance(v, str)
    if one:
        v = [v]
    elif not isinstance(v, list):
        raise _wrong(v, "a string or an array of strings")
    elif len(v) > MAX_STOP:
        raise _refuse(lambda p: f"{p} may hold at most {MAX_STOP} strings, got {len(v)}", "out_of_range")
    for i, s in enumerate(v):
        sub = "" if one else f"[{i}]"
        if not isinstance(s, str):
            raise _wrong(s, "a string", sub=f"[{i}]")
        if len(s) > MAX_STOP_CHARS:
            raise _refuse(lambda p: f"{p} is {len(s)} characters; a stop string may be at most {MAX_STOP_CHARS}",
                          "out_of_range", sub=sub)
    return tuple(s for s in v if s)


def _check_stream_options(v):
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _wrong(v, 'an object such as {"include_usage": true}')
    iu = v.get("include_usage")
    if iu is not None and not isinstance(iu, bool):
        raise _wrong(iu, "a boolean (true or false)", sub=".include_usage")
    return {"include_usage": bool(iu)}


def _check_response_format(v):
    """text, json_object, or json_schema with its schema under json_schema.schema."""
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise _wrong(v, 'an object such as {"type": "json_object"}')
    kind = v["type"]
    if kind not in ("text", "json_object", "json_schema"):
        raise _refuse(lambda p: f"{p} type {_show(kind)} is not known; send text, json_object or json_schema")
    js = v.get("json_schema")
    if kind == "json_schema" and not (isinstance(js, dict) and isinstance(js.get("schema"), dict)):
        raise _refuse(lambda p: f'{p} json_schema needs {{"json_schema": {{"name": ..., "schema": {{...}}}}}}: a JSON '
                                f"schema object under json_schema.schema")
    return v


MAX_LOGIT_BIAS = 1024           # entries of one request's logit_bias
MAX_TOP_LOGPROBS = 20
MAX_CONTROL_SCALE = 100.0      # |control_vector_scale| (llama.cpp sets no bound; past this a vector drowns the residual)
TOOL_CHOICES = ("none", "auto", "required")


def _check_logit_bias(v, info: ValidationInfo):
    """{"token id": bias in [-100, 100]} -> ((id, bias), ...), each id a token of the model."""
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise _wrong(v, 'an object mapping token ids to biases, e.g. {"1234": -100}')
    if len(v) > MAX_LOGIT_BIAS:
        raise _refuse(lambda p: f"{p} may hold at most {MAX_LOGIT_BIAS} tokens, got {len(v)}", "out_of_range")
    vocab = _limits(info).vocab_size
    out = {}
    for key, bias in v.items():
        sub = f"[{_show(key)}]"
        if not (isinstance(key, str) and key.strip().lstrip("-").isdigit()):
            raise _refuse(lambda p: f"{p} keys must be token ids (integers as strings), got {_show(key)}",
                          "invalid_type")
        if not 0 <= int(key) < vocab:
            raise _refuse(lambda p: f"{p} names token {int(key)}, which is not a token id of this model: ids are "
                                    f"0..{vocab - 1}", "out_of_range")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise _wrong(bias, "a number in [-100, 100]", sub=sub)
        if not -100 <= bias <= 100:
            raise _refuse(lambda p: f"{p} must be in [-100, 100], got {_show(bias)}", "out_of_range", sub=sub)
        out[int(key)] = float(bias)
    return tuple(out.items())


def _best_of_refused(v):
    if isinstance(v, bool) or not isinstance(v, int):
        raise _wrong(v, "an integer")
    return None if v == 1 else f"best_of={v} is not supported; send best_of=1 or leave it out"


# the fields a model's generation_config.json may set defaults for (as vLLM reads it): a request's own value wins
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty")


class Sampling(NamedTuple):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple = ()


class Body(BaseModel):
    """A request body: unknown fields are ignored; parse() is the one way in."""
    model_config = ConfigDict(extra="ignore", frozen=True)

    @classmethod
    def parse(cls, body: dict, limits: Limits | None = None):
        """The body checked into this model, or ApiError(400) naming the first wrong field and what it allows."""
        try:
            return cls.model_validate(body, context={"limits": limits or Limits()})
        except ValidationError as e:
            raise _api_error(e) from None


def _check_control_scale(v, info: ValidationInfo):
    if v is not None and not _limits(info).control_vector:
        raise _refuse(lambda p: f"{p} scales the server's control vector, and this server loaded none: start it with "
                                f"--control-vector FILE[:SCALE], or leave {p} out", "unsupported")
    return v


class _Body(Body):
    """The fields every generation body shares."""

    model: Str(256) = Field(None, description="A name this server serves (GET /v1/models); unset: the default.")
    max_tokens: Int(1, None, TOKENS_WHAT) = Field(
        None, description="Tokens to generate at most; unset: what is left of the context.")
    temperature: Num(0.0, 100.0, what="(0 = greedy)") = Field(
        None, description="0 = greedy; default: the model's generation_config.json, else 1.")
    top_p: Num(0.0, 1.0, lo_open=True, what="(1 = off)") = Field(None, description="Nucleus sampling; 1 = off.")
    top_k: Int(-1, lambda lim: lim.vocab_size, "(0 or -1 = off)") = Field(
        None, description="Keep the K likeliest tokens; 0 or -1 = off; at most the vocabulary's size.")
    min_p: Num(0.0, 1.0, what="(0 = off)") = Field(
        None, description="Drop tokens below min_p times the likeliest one's probability; 0 = off.")
    seed: Int(0, MAX_SEED - 1) = Field(None, description="A seeded request is reproducible.")
    presence_penalty: Num(-2.0, 2.0, what="(0 = off)") = Field(
        None, description="Subtracted from a token's logit once it was generated; 0 = off.")
    frequency_penalty: Num(-2.0, 2.0, what="(0 = off)") = Field(
        None, description="Times the number of times a token was generated, subtracted from its logit; 0 = off.")
    repetition_penalty: Num(0.0, 10.0, lo_open=True, what="(1 = off)") = Field(
        None, description="A prompt or generated token's logit divided by it (a negative one multiplied); 1 = off.")
    logit_bias: Annotated[tuple[tuple[int, float], ...], BeforeValidator(_check_logit_bias)] = Field(
        (), description=f'{{"token id": bias in [-100, 100]}} added to the logits; at most {MAX_LOGIT_BIAS} tokens.')
    stop: Annotated[tuple[str, ...], BeforeValidator(_check_stop)] = Field(
        (), description=f"Up to {MAX_STOP} strings (of at most {MAX_STOP_CHARS} characters) that end generation.")
    stream: Bool = Field(None, description="Server-sent events instead of one JSON response.")
    stream_options: Annotated[Optional[dict], BeforeValidator(_check_stream_options)] = Field(
        None, description='{"include_usage": true} adds a final chunk with the usage.')
    user: Str() = Field(None, description="Accepted; not used.")
    ignore_eos: Bool = Field(None, description="Generate through end-of-sequence tokens (as llama.cpp's server).")
    cache_prompt: Bool = Field(
        None, description="Reuse the prefix this prompt shares with a stored conversation (prompt cache, as "
                          "llama.cpp's server); default true. false: read the whole prompt.")
    strata_checkpoint: Bool = Field(
        None, description="Store this request's conversation with checkpoints for later prompts to reuse; default "
                          "true. false: none are taken (a prompt that will not come back).")
    control_vector_scale: Annotated[Num(-MAX_CONTROL_SCALE, MAX_CONTROL_SCALE, what="(1 = as loaded, 0 = off)"),
                                    BeforeValidator(_check_control_scale)] = Field(
        None, description="The server's control vector (--control-vector) times this for this request: 1 (default) "
                          "as loaded, 0 off, negative steers the other way.")
    n: Int(1, lambda lim: lim.slots, "(choices: one slot each)") = Field(
        None, description="Choices to sample (the prompt is read once); at most the server's slots.")
    response_format: Annotated[Optional[dict], BeforeValidator(_check_response_format)] = Field(
        None, description='{"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}: the '
                          'reply follows it (constrained decoding); "text": free.')

    @model_validator(mode="after")
    def _grammar_ends_the_reply(self):
        if self.ignore_eos and self.json_schema is not None:
            raise _refuse(lambda p: "ignore_eos cannot be combined with response_format: the grammar ends the reply",
                          sub="ignore_eos")
        return self

    def sampling(self, defaults: dict | None = None) -> Sampling:
        """The sampling settings: each field the body left out from `defaults` (the model's, generation_defaults),
        else the API's own default."""
        given = {k: getattr(self, k) for k in SAMPLING_DEFAULTS if getattr(self, k) is not None}
        values = {**Sampling()._asdict(), **(defaults or {}), **given}
        if values["top_k"] == -1:
            values["top_k"] = 0
        return Sampling(**{**values, "seed": self.seed, "logit_bias": self.logit_bias})

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def json_schema(self) -> dict | None:
        """The JSON schema the reply follows (json_object: any object), or None."""
        rf = self.response_format
        if rf is None or rf["type"] == "text":
            return None
        return rf["json_schema"]["schema"] if rf["type"] == "json_schema" else {"type": "object"}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options["include_usage"])

    @property
    def streaming(self) -> bool:
        return bool(self.stream)


# --- chat messages


def _content_text(content: Any, role: str) -> str | list[dict]:
    """A message's content as chat templates read it: a string, or an array of text parts (joined); a user message
    with image parts keeps its parts, {"type": "text", "text"} and {"type": "image_url", "image_url": {"url"}}
    (whether the model takes images, and each image, are checked once the message is rendered)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _wrong(content, "a string or an array of content parts", sub=".content")
    parts = []
    for j, part in enumerate(content):
        sub = f".content[{j}]"
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
            continue
        if not isinstance(part, dict):
            raise _wrong(part, 'a content part object such as {"type": "text", "text": "..."}', sub=sub)
        kind = part.get("type")
        if kind == "image_url" and role == "user":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str):
                raise _wrong(image, 'an object {"url": "data:image/png;base64,..."}', sub=sub + ".image_url")
            parts.append({"type": "image_url", "image_url": {"url": url}})
            continue
        if kind not in ("text", "input_text"):
            allowed = '"text" and, in a user message, "image_url"'
            raise _refuse(lambda p: f"{p}.type {_show(kind)} is not supported: send parts of type {allowed}",
                          "unsupported", sub=sub)
        if not isinstance(part.get("text"), str):
            raise _wrong(part.get("text"), "a string", sub=sub + ".text")
        parts.append({"type": "text", "text": part["text"]})
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _check_message(m: Any) -> dict:
    """One message, as chat templates read it: developer -> system, content parts joined into text, tool calls'
    JSON arguments parsed into objects, null fields dropped."""
    if not isinstance(m, dict):
        raise _wrong(m, 'an object with "role" and "content"')
    role = m.get("role")
    if role is None:
        raise _refuse(lambda p: f"{p.removesuffix('.role')} has no role: give one of {', '.join(ROLES)}",
                      "missing_field", sub=".role")
    if not isinstance(role, str):
        raise _wrong(role, f"a string, one of {', '.join(ROLES)}", sub=".role")
    if role not in ROLES:
        raise _refuse(lambda p: f"{p} {_show(role)} is not a known role; allowed roles: {', '.join(ROLES)}",
                      "invalid_role", sub=".role")
    msg = {k: v for k, v in m.items() if v is not None}
    if role == "developer":        # OpenAI's newer name for system instructions
        msg["role"] = "system"
    content = m.get("content")
    if content is None:
        if role == "assistant" and m.get("tool_calls"):
            msg.pop("content", None)
        else:
            raise _refuse(lambda p: f"{p} is missing: a {role} message needs content (a string)", "missing_field",
                          sub=".content")
    else:
        msg["content"] = _content_text(content, role)
    for key in ("name", "tool_call_id", "reasoning_content"):
        if key in msg and not isinstance(msg[key], str):
            raise _wrong(msg[key], "a string", sub=f".{key}")
    if "tool_calls" in msg:
        tc = msg["tool_calls"]
        if not isinstance(tc, list) or not all(isinstance(t, dict) for t in tc):
            raise _wrong(tc, "an array of tool call objects", sub=".tool_calls")
        calls = []
        for t in tc:   # chat templates read arguments as an object; the API sends a JSON string
            fn = t.get("function")
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    args = json.loads(fn["arguments"])
                except (ValueError, RecursionError):
                    args = fn["arguments"]
                t = {**t, "function": {**fn, "arguments": args}}
            calls.append(t)
        msg["tool_calls"] = calls
    return msg


class Message(BaseModel):
    """A chat message; fields beyond these are passed to the chat template as they are."""
    model_config = ConfigDict(extra="allow", frozen=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, tuple[dict, ...], None] = Field(
        None, description="A string, or an array of text parts (joined); a user message's image_url parts with data: "
                          "URLs are kept as parts for a model that takes images.")
    name: Optional[str] = None
    tool_calls: Optional[list[dict]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _check(cls, m):
        return _check_message(m)


def _check_messages(v):
    if v is None:
        raise _refuse(lambda p: f'{p} is required: an array of {{"role", "content"}} objects, e.g. '
                                f'[{{"role": "user", "content": "Hello"}}]', "missing_field")
    if not isinstance(v, list):
        raise _wrong(v, 'an array of {"role", "content"} objects')
    if not v:
        raise _refuse(lambda p: f'{p} is empty: send at least one message, e.g. [{{"role": "user", "content": '
                                f'"Hello"}}]', "empty_messages")
    return v


def _check_tools(v):
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(t, dict) for t in v):
        raise _wrong(v, "an array of tool objects")
    return tuple(v) or None


def _check_object(v):
    if v is not None and not isinstance(v, dict):
        raise _wrong(v, "an object")
    return v


def _check_tool_choice(v):
    """none | auto | required | {"type": "function", "function": {"name": ...}} -> the string, or the name's dict."""
    if v is None or isinstance(v, str) and v in TOOL_CHOICES:
        return v
    want = 'one of none, auto, required, or {"type": "function", "function": {"name": ...}}'
    if isinstance(v, str):
        raise _refuse(lambda p: f"{p} must be {want}, got {_show(v)}")
    if not (isinstance(v, dict) and isinstance(v.get("function"), dict) and isinstance(v["function"].get("name"),
                                                                                      str)):
        raise _wrong(v, want)
    return v


class ChatRequest(_Body):
    """POST /v1/chat/completions."""
    messages: Annotated[tuple[Message, ...], BeforeValidator(_check_messages)] = Field(
        None, validate_default=True, description="The conversation, rendered with the model's chat template.")
    max_completion_tokens: Int(1, None, TOKENS_WHAT) = Field(None, description="The newer name of max_tokens; wins.")
    reasoning_effort: Choice(*REASONING_EFFORTS) = Field(None, description="Passed to the chat template.")
    tools: Annotated[Optional[tuple[dict, ...]], BeforeValidator(_check_tools)] = Field(
        None, description="Tool definitions, rendered by the chat template.")
    tool_choice: Annotated[Any, BeforeValidator(_check_tool_choice)] = Field(
        None, description='none (the tools are not shown), auto (default), required (a call, forced by constrained '
                          'decoding) or {"type": "function", "function": {"name": ...}} (that one).')
    parallel_tool_calls: Bool = Field(None, description="With a forced call: one or more calls (default) or one.")
    chat_template_kwargs: Annotated[Optional[dict], BeforeValidator(_check_object)] = Field(
        None, description="Extra variables for the chat template (e.g. enable_thinking).")
    logprobs: Bool = Field(None, description="Each generated token's logprob (of the model's distribution).")
    top_logprobs: Int(0, MAX_TOP_LOGPROBS, "(alternatives per token)") = Field(
        None, description=f"Alternatives per token, at most {MAX_TOP_LOGPROBS}; needs logprobs.")

    def model_post_init(self, _):
        if self.max_completion_tokens is not None:
            object.__setattr__(self, "max_tokens", self.max_completion_tokens)

    @model_validator(mode="after")
    def _check_choices(self):
        if self.top_logprobs and not self.logprobs:
            raise _refuse(lambda p: 'top_logprobs needs logprobs: send "logprobs": true with it', sub="top_logprobs")
        choice = self.tool_choice_kind
        if choice in ("required", "function"):
            names = [t["function"].get("name") for t in self.tools or () if isinstance(t.get("function"), dict)]
            if not names:
                raise _refuse(lambda p: f"tool_choice {_show(self.tool_choice)} needs tools: send the functions in "
                                        f"tools", sub="tool_choice")
            if choice == "function" and self.tool_function not in names:
                raise _refuse(lambda p: f"tool_choice names function {self.tool_function!r}, which is not in tools; "
                                        f"tools: {', '.join(map(str, names))}", sub="tool_choice")
            if self.json_schema is not None:
                raise _refuse(lambda p: f"tool_choice {choice!r} and response_format both constrain the reply; send "
                                        f"one", sub="tool_choice")
            if self.ignore_eos:
                raise _refuse(lambda p: "ignore_eos cannot be combined with a forced tool call: the grammar ends the "
                                        "reply", sub="ignore_eos")
        return self

    @property
    def logprob_count(self) -> int | None:
        """Alternatives per token when logprobs were asked for, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_choice_kind(self) -> str:
        """none | auto | required | function (tool_function names it)."""
        tc = self.tool_choice
        return "auto" if tc is None else tc if isinstance(tc, str) else "function"

    @property
    def tool_function(self) -> str | None:
        return self.tool_choice["function"]["name"] if self.tool_choice_kind == "function" else None

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def message_dicts(self) -> list[dict]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    @property
    def template_kwargs(self) -> dict:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs


# --- text completions


def _check_prompt(v, info: ValidationInfo):
    if v is None:
        raise _refuse(lambda p: f'{p} is required: a string, e.g. {{"prompt": "Once upon a time"}}', "missing_field")
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]          # a batch of one
    if isinstance(v, str):
        if v == "":
            raise _refuse(lambda p: f"{p} is empty: send some text", "empty_prompt")
        return v
    if not isinstance(v, list):
        raise _wrong(v, "a string or an array of token ids")
    if v and all(isinstance(p, (str, list)) for p in v):
        raise _refuse(lambda p: f"{p} holds {len(v)} prompts; this server takes one prompt per request", "unsupported")
    if not v:
        raise _refuse(lambda p: f"{p} is empty: send some text or token ids", "empty_prompt")
    lim = _limits(info)
    if len(v) >= lim.max_context:
        raise _refuse(lambda p: f"the prompt is {len(v)} tokens but max_context is {lim.max_context}: a prompt must be "
                                f"at most {lim.max_context - 1} tokens so that at least one token can be generated",
                      "context_length_exceeded")
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int):
            raise _wrong(t, "a token id (integer); prompt must be a string or an array of token ids", sub=f"[{i}]")
        if not 0 <= t < lim.vocab_size:
            raise _refuse(lambda p: f"{p} = {t} is not a token id of this model: ids are 0..{lim.vocab_size - 1}",
                          "out_of_range", sub=f"[{i}]")
    return tuple(v)


def _check_text_logprobs(v):
    """An integer in [0, MAX_TOP_LOGPROBS]; false is "not given"."""
    return None if v is False else v


class CompletionRequest(_Body):
    """POST /v1/completions."""
    prompt: Annotated[Union[str, tuple[int, ...]], BeforeValidator(_check_prompt)] = Field(
        None, validate_default=True, description="A string (read as the client wrote it, special tokens included) "
                                                 "or an array of token ids.")
    echo: Bool = Field(None, description="Put the prompt before the generated text.")
    suffix: Annotated[Optional[str], Refused(lambda v: None if v == "" else
                                             "suffix (insertion) is not supported by this server; leave suffix out")
                      ] = Field(None, description="Not supported.")
    best_of: Annotated[Optional[int], Refused(_best_of_refused)] = Field(None, description="Only 1 is supported.")
    logprobs: Annotated[Int(0, MAX_TOP_LOGPROBS, "(alternatives per token)"), BeforeValidator(_check_text_logprobs)
                        ] = Field(None, description=f"Each token's logprob and this many alternatives (at most "
                                                    f"{MAX_TOP_LOGPROBS}).")

    @model_validator(mode="after")
    def _no_prompt_logprobs(self):
        if self.echo and self.logprobs is not None:
            raise _refuse(lambda p: "echo with logprobs (the prompt's logprobs) is not supported; send one of them",
                          "unsupported", sub="echo")
        return self

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs


# --- llama.cpp's /tokenize and /detokenize


class TokenizeRequest(Body):
    """POST /tokenize: text -> token ids, as llama.cpp's server."""
    content: Annotated[str, BeforeValidator(lambda v: _required_str(v))] = Field(
        None, validate_default=True, description="The text to tokenize.")
    add_special: Bool = Field(None, description="Add the tokenizer's BOS/EOS as its post-processor does.")
    parse_special: Bool = Field(None, description="Special-token text becomes control tokens (default true).")
    with_pieces: Bool = Field(None, description='Answer [{"id", "piece"}] instead of ids.')


def _required_str(v):
    if v is None:
        raise _refuse(lambda p: f'{p} is required: a string, e.g. {{"{p}": "Hello"}}', "missing_field")
    if not isinstance(v, str):
        raise _wrong(v, "a string")
    return v


def _check_token_ids(v, info: ValidationInfo):
    if v is None:
        raise _refuse(lambda p: f'{p} is required: an array of token ids, e.g. {{"{p}": [1, 2]}}', "missing_field")
    if not isinstance(v, list):
        raise _wrong(v, "an array of token ids")
    lim = _limits(info)
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int):
            raise _wrong(t, "a token id (integer)", sub=f"[{i}]")
        if not 0 <= t < lim.vocab_size:
            raise _refuse(lambda p: f"{p} = {t} is not a token id of this model: ids are 0..{lim.vocab_size - 1}",
                          "out_of_range", sub=f"[{i}]")
    return tuple(v)


class DetokenizeRequest(Body):
    """POST /detokenize: token ids -> text, as llama.cpp's server."""
    tokens: Annotated[tuple[int, ...], BeforeValidator(_check_token_ids)] = Field(
        None, validate_default=True, description="The token ids to decode.")


BODIES = {"ChatRequest": ChatRequest, "CompletionRequest": CompletionRequest, "TokenizeRequest": TokenizeRequest,
          "DetokenizeRequest": DetokenizeRequest}


def _param(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def _api_error(e: ValidationError) -> ApiError:
    """pydantic's first error as today's API error: the field's path, what was sent and what is allowed."""
    err = e.errors(include_url=False)[0]
    ctx = err.get("ctx") or {}
    param = _param(err["loc"])
    if "say" in ctx:
        param += ctx.get("sub", "")
        return bad(param or None, ctx["say"](param), code=ctx.get("code", "invalid_value"))
    # a field declared with a plain pydantic type (no check of its own): pydantic's words, with what was sent
    if err["type"] == "missing":
        return bad(param, f"{param} is required", code="missing_field")
    v = err.get("input")
    return bad(param or None, f"{param or 'the body'}: {err['msg'].lower()}, got {_json_type(v)} {_show(v)}",
               code="invalid_value")


def openapi(title: str, version: str, routes: list[tuple[str, str, str, str | None]]) -> dict:
    """The OpenAPI 3.1 document of the routes [(method, path, summary, body model name or None)], its schemas
    generated from the body models above."""
    from pydantic.json_schema import models_json_schema
    _, defs = models_json_schema([(m, "validation") for m in BODIES.values()],
                                 ref_template="#/components/schemas/{model}")
    paths: dict = {}
    error = {"description": "An error", "content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/Error"}}}}
    for method, path, summary, body in routes:
        op: dict = {"summary": summary, "responses": {"200": {"description": "OK"}, "4XX": error, "5XX": error}}
        if body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": {
                "$ref": f"#/components/schemas/{body}"}}}}
        paths.setdefault(path, {})[method.lower()] = op
    schemas = dict(defs.get("$defs", {}))
    schemas["Error"] = {"type": "object", "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "null"]}}}}}
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": schemas}}


def generation_defaults(config: dict, limits: Limits) -> tuple[dict, list[str]]:
    """A model's generation_config.json (as a dict) -> (the sampling defaults it sets, each checked as a request's
    field is, the reasons for the ones left out)."""
    out, refused = {}, []
    for key in SAMPLING_DEFAULTS:
        if key in config:
            try:
                out[key] = getattr(_Body.parse({key: config[key]}, limits), key)
            except ApiError as e:
                refused.append(e.message)
    return out, refused


# --- responses -------------------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """cached_tokens: the prompt's tokens the prompt cache reused (OpenAI's and vLLM's prompt_tokens_details)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_message(content: str, reasoning: str, tool_calls: list[dict] | None = None) -> dict:
    """The assistant message of a whole response: content null when the reply is tool calls only."""
    message = {"role": "assistant", "content": None if tool_calls and not content else content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_call_delta(index: int, call_id: str | None, name: str | None, arguments: str) -> dict:
    """A streamed tool call's piece: the first carries its id and name, the rest argument fragments."""
    if call_id is None:
        return {"index": index, "function": {"arguments": arguments}}
    return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_response(rid: str, model: str, created: int, choices: list[dict], prompt_tokens: int,
                  completion_tokens: int, timings: dict | None = None, cached_tokens: int = 0) -> dict:
    """choices: {"index", "message", "logprobs", "finish_reason"} each."""
    out = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
           "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
    if timings:
        out["timings"] = timings
    return out


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None = None,
               include_usage: bool = False, index: int = 0, logprobs: dict | None = None) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if include_usage:
        out["usage"] = None
    return out


def completion_response(rid: str, model: str, created: int, choices: list[dict], prompt_tokens: int,
                        completion_tokens: int, timings: dict | None = None, cached_tokens: int = 0) -> dict:
    """choices: {"index", "text", "logprobs", "finish_reason"} each."""
    out = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
           "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
    if timings:
        out["timings"] = timings
    return out


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None = None,
                     include_usage: bool = False, index: int = 0, logprobs: dict | None = None) -> dict:
    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if include_usage:
        out["usage"] = None
    return out


LOGPROB_FLOOR = -9999.0          # a logprob JSON can carry (an impossible token's is -inf)


def _token(token_bytes, token: int) -> tuple[str, list[int]]:
    b = token_bytes(token)
    return b.decode("utf-8", errors="replace"), list(b)


def chat_logprobs(entries, token_bytes) -> dict:
    """TokenLogprobs -> a chat choice's logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def one(token, lp):
        text, b = _token(token_bytes, token)
        return {"token": text, "logprob": max(lp, LOGPROB_FLOOR), "bytes": b}
    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(entries, token_bytes, offset: int) -> dict:
    """TokenLogprobs -> a text choice's logprobs (tokens, token_logprobs, top_logprobs, text_offset), the text
    offsets counted from `offset` characters."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(_token(token_bytes, e.token)[0])
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [max(e.logprob, LOGPROB_FLOOR) for e in entries],
            "top_logprobs": [{_token(token_bytes, t)[0]: max(lp, LOGPROB_FLOOR) for t, lp in e.top}
                             for e in entries],
            "text_offset": offsets}


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int = 0) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def models_list(names: list[str], created: int, max_context: int, vision: bool = False) -> dict:
    return {"object": "list", "data": [model_card(name, created, max_context, vision) for name in names]}


def model_card(model: str, created: int, max_context: int, vision: bool = False) -> dict:
    """A model object; `modalities`: what its messages may hold (image parts: a model with a vision tower)."""
    return {"id": model, "object": "model", "created": created, "owned_by": "strata", "max_context": max_context,
            "modalities": ["text", "image"] if vision else ["text"]}


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def now() -> int:
    return int(time.time())
