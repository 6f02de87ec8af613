"""The OpenAI wire format: request bodies validated into plain dataclasses, response and chunk builders, error JSON.

Validation is strict about types and ranges (a wrong type is a 400 naming the field, what was sent and what is
allowed) and lenient about presence: unknown fields are ignored, so clients that send extra fields keep working.
"""
from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

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
    return value


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


# --- field readers --------------------------------------------------------------------------------------------------

_MISSING = object()


def _get(body: dict, key: str):
    v = body.get(key, _MISSING)
    return _MISSING if v is None else v   # JSON null means "not given", as in the OpenAI API


def _int(body: dict, key: str, lo: int | None = None, hi: int | None = None, what: str = "") -> int | None:
    v = _get(body, key)
    if v is _MISSING:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise _wrong_type(key, v, "an integer" + (f" {what}" if what else ""))
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"at least {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(key, f"{key} must be {rng}{(' ' + what) if what else ''}, got {v}", code="out_of_range")
    return v


def _float(body: dict, key: str, lo: float, hi: float, lo_open: bool = False, what: str = "") -> float | None:
    v = _get(body, key)
    if v is _MISSING:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _wrong_type(key, v, "a number")
    v = float(v)
    ok = math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise bad(key, f"{key} must be in {rng}{(' ' + what) if what else ''}, got {_show(v)}",
                  code="out_of_range")
    return v


def _bool(body: dict, key: str) -> bool | None:
    v = _get(body, key)
    if v is _MISSING:
        return None
    if not isinstance(v, bool):
        raise _wrong_type(key, v, "a boolean (true or false)")
    return v


def _str(body: dict, key: str, choices: tuple[str, ...] | None = None) -> str | None:
    v = _get(body, key)
    if v is _MISSING:
        return None
    if not isinstance(v, str):
        raise _wrong_type(key, v, "a string" + (f", one of {', '.join(choices)}" if choices else ""))
    if choices is not None and v not in choices:
        raise bad(key, f"{key} must be one of {', '.join(choices)}, got {_show(v)}")
    return v


# --- requests -------------------------------------------------------------------------------------------------------

MAX_STOP = 16
ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
MAX_SEED = 2 ** 63
MAX_LOGIT_BIAS = 1024           # entries of one request's logit_bias
MAX_TOP_LOGPROBS = 20
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class CommonParams:
    model: str | None
    max_tokens: int | None           # None: what is left of the context
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    user: str | None
    ignore_eos: bool = False         # extension (as llama.cpp's server): generate through end-of-sequence tokens
    n: int = 1
    logprobs: int | None = None      # each token's logprob and this many alternatives; None: none
    json_schema: dict | None = None  # response_format json_schema's schema ({"type": "object"} for json_object)


@dataclass(frozen=True)
class ChatParams(CommonParams):
    messages: tuple[dict, ...] = ()
    reasoning_effort: str | None = None
    tools: tuple[dict, ...] | None = None
    template_kwargs: dict = field(default_factory=dict)
    tool_choice: str = "auto"        # none | auto | required | function (tool_function names it)
    tool_function: str | None = None
    parallel_tool_calls: bool = True


@dataclass(frozen=True)
class CompletionParams(CommonParams):
    prompt: str | tuple[int, ...] = ""
    echo: bool = False


def _common(body: dict, *, chat: bool) -> dict:
    model = _str(body, "model")
    n = _int(body, "n", 1, None, "(the number of choices)") or 1
    best_of = _int(body, "best_of")
    if best_of is not None and best_of != n:
        raise bad("best_of", f"best_of={best_of} is not supported: this server returns the n choices it samples; "
                             f"leave best_of out or send best_of equal to n", code="unsupported")

    limits = "(the number of tokens to generate)"
    max_tokens = _int(body, "max_tokens", 1, None, limits)
    if chat:
        mct = _int(body, "max_completion_tokens", 1, None, limits)
        if mct is not None:
            max_tokens = mct

    temperature = _float(body, "temperature", 0.0, 100.0, what="(0 = greedy)")
    top_p = _float(body, "top_p", 0.0, 1.0, lo_open=True, what="(1 = off)")
    top_k = _int(body, "top_k", -1, None, "(0 or -1 = off)")
    min_p = _float(body, "min_p", 0.0, 1.0, what="(0 = off)")
    seed = _int(body, "seed", 0, MAX_SEED - 1)
    presence = _float(body, "presence_penalty", -2.0, 2.0, what="(0 = off)")
    frequency = _float(body, "frequency_penalty", -2.0, 2.0, what="(0 = off)")
    repetition = _float(body, "repetition_penalty", 0.0, 10.0, lo_open=True, what="(1 = off)")
    sampling = Sampling(temperature=1.0 if temperature is None else temperature,
                        top_p=1.0 if top_p is None else top_p,
                        top_k=0 if top_k in (None, -1) else top_k,
                        min_p=0.0 if min_p is None else min_p, seed=seed,
                        presence_penalty=presence or 0.0, frequency_penalty=frequency or 0.0,
                        repetition_penalty=1.0 if repetition is None else repetition,
                        logit_bias=_logit_bias(body))

    stop = _get(body, "stop")
    if stop is _MISSING:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list):
        if len(stop) > MAX_STOP:
            raise bad("stop", f"stop may hold at most {MAX_STOP} strings, got {len(stop)}", code="out_of_range")
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                raise _wrong_type(f"stop[{i}]", s, "a string")
        stops = tuple(s for s in stop if s)
    else:
        raise _wrong_type("stop", stop, "a string or an array of strings")

    stream = bool(_bool(body, "stream"))
    include_usage = False
    so = _get(body, "stream_options")
    if so is not _MISSING:
        if not isinstance(so, dict):
            raise _wrong_type("stream_options", so, 'an object such as {"include_usage": true}')
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise _wrong_type("stream_options.include_usage", iu, "a boolean (true or false)")
        include_usage = bool(iu)

    user = _str(body, "user")
    ignore_eos = bool(_bool(body, "ignore_eos"))
    top = f"(alternatives per token, at most {MAX_TOP_LOGPROBS})"
    if chat:
        lp = _bool(body, "logprobs")
        tlp = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, top)
        if tlp and not lp:
            raise bad("top_logprobs", "top_logprobs needs logprobs: send \"logprobs\": true with it",
                      code="invalid_value")
        logprobs = (tlp or 0) if lp else None
    else:
        logprobs = None if _get(body, "logprobs") is False else _int(body, "logprobs", 0, MAX_TOP_LOGPROBS, top)
    json_schema = _response_format(body)
    if ignore_eos and json_schema is not None:
        raise bad("ignore_eos", "ignore_eos cannot be combined with response_format: the grammar ends the reply",
                  code="invalid_value")
    return dict(model=model, max_tokens=max_tokens, sampling=sampling, stop=stops, stream=stream,
                include_usage=include_usage, user=user, ignore_eos=ignore_eos, n=n, logprobs=logprobs,
                json_schema=json_schema)


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """logit_bias: {"token id": bias in [-100, 100]} -> ((id, bias), ...); the ids' range is the app's to check."""
    lb = _get(body, "logit_bias")
    if lb is _MISSING:
        return ()
    if not isinstance(lb, dict):
        raise _wrong_type("logit_bias", lb, 'an object mapping token ids to biases, e.g. {"1234": -100}')
    if len(lb) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(lb)}",
                  code="out_of_range")
    out = {}
    for key, value in lb.items():
        p = f"logit_bias[{_show(key)}]"
        if not (isinstance(key, str) and key.strip().lstrip("-").isdigit()):
            raise bad("logit_bias", f"logit_bias keys must be token ids (integers as strings), got {_show(key)}",
                      code="invalid_type")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _wrong_type(p, value, "a number in [-100, 100]")
        if not -100 <= value <= 100:
            raise bad("logit_bias", f"{p} must be in [-100, 100], got {_show(value)}", code="out_of_range")
        out[int(key)] = float(value)
    return tuple(out.items())


def _response_format(body: dict) -> dict | None:
    """response_format -> the JSON schema the reply must follow (None: text)."""
    rf = _get(body, "response_format")
    if rf is _MISSING:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise _wrong_type("response_format", rf, 'an object such as {"type": "json_object"}')
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise bad("response_format", f"response_format type {_show(kind)} is not known; send text, json_object or "
                                     f"json_schema", code="invalid_value")
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
        raise bad("response_format", 'response_format json_schema needs {"json_schema": {"name": ..., "schema": '
                                     '{...}}}: a JSON schema object under json_schema.schema', code="invalid_value")
    return js["schema"]


def _content_text(content: Any, param: str) -> str | None:
    """A message's content as text: a string, or an array of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            p = f"{param}[{j}]"
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, dict):
                raise _wrong_type(p, part, 'a content part object such as {"type": "text", "text": "..."}')
            kind = part.get("type")
            if kind not in ("text", "input_text"):
                raise bad(p, f"{p}.type {_show(kind)} is not supported: this model reads text only; send parts "
                             f'of type "text"', code="unsupported")
            if not isinstance(part.get("text"), str):
                raise _wrong_type(f"{p}.text", part.get("text"), "a string")
            texts.append(part["text"])
        return "".join(texts)
    raise _wrong_type(param, content, "a string or an array of text parts")


def _messages(body: dict) -> tuple[dict, ...]:
    msgs = body.get("messages", _MISSING)
    if msgs is _MISSING or msgs is None:
        raise bad("messages", 'messages is required: an array of {"role", "content"} objects, e.g. '
                              '[{"role": "user", "content": "Hello"}]', code="missing_field")
    if not isinstance(msgs, list):
        raise _wrong_type("messages", msgs, 'an array of {"role", "content"} objects')
    if not msgs:
        raise bad("messages", "messages is empty: send at least one message, e.g. "
                              '[{"role": "user", "content": "Hello"}]', code="empty_messages")
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _wrong_type(p, m, 'an object with "role" and "content"')
        role = m.get("role")
        if role is None:
            raise bad(f"{p}.role", f"{p} has no role: give one of {', '.join(ROLES)}", code="missing_field")
        if not isinstance(role, str):
            raise _wrong_type(f"{p}.role", role, f"a string, one of {', '.join(ROLES)}")
        if role not in ROLES:
            raise bad(f"{p}.role", f"{p}.role {_show(role)} is not a known role; allowed roles: {', '.join(ROLES)}",
                      code="invalid_role")
        msg = {k: v for k, v in m.items() if v is not None}
        if role == "developer":        # OpenAI's newer name for system instructions
            msg["role"] = "system"
        content = m.get("content")
        if content is None:
            if role == "assistant" and m.get("tool_calls"):
                msg.pop("content", None)
            else:
                raise bad(f"{p}.content", f"{p}.content is missing: a {role} message needs content (a string)",
                          code="missing_field")
        else:
            msg["content"] = _content_text(content, f"{p}.content")
        for key in ("name", "tool_call_id", "reasoning_content"):
            if key in msg and not isinstance(msg[key], str):
                raise _wrong_type(f"{p}.{key}", msg[key], "a string")
        if "tool_calls" in msg:
            tc = msg["tool_calls"]
            if not isinstance(tc, list) or not all(isinstance(t, dict) for t in tc):
                raise _wrong_type(f"{p}.tool_calls", tc, "an array of tool call objects")
            calls = []
            for t in tc:   # chat templates read arguments as an object; the API sends a JSON string
                fn = t.get("function")
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        args = json.loads(fn["arguments"])
                    except ValueError:
                        args = fn["arguments"]
                    t = {**t, "function": {**fn, "arguments": args}}
                calls.append(t)
            msg["tool_calls"] = calls
        out.append(msg)
    return tuple(out)


def parse_chat(body: dict) -> ChatParams:
    common = _common(body, chat=True)
    messages = _messages(body)
    effort = _str(body, "reasoning_effort", REASONING_EFFORTS)
    tools = _get(body, "tools")
    if tools is _MISSING:
        tools = None
    elif not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _wrong_type("tools", tools, "an array of tool objects")
    elif not tools:
        tools = None
    kwargs = {}
    ctk = _get(body, "chat_template_kwargs")
    if ctk is not _MISSING:
        if not isinstance(ctk, dict):
            raise _wrong_type("chat_template_kwargs", ctk, "an object")
        kwargs.update(ctk)
    if effort is not None:
        kwargs["reasoning_effort"] = effort
    choice, function = _tool_choice(body, tools)
    if choice in ("required", "function") and common["json_schema"] is not None:
        raise bad("tool_choice", f"tool_choice {choice!r} and response_format both constrain the reply; send one",
                  code="invalid_value")
    if choice in ("required", "function") and common["ignore_eos"]:
        raise bad("ignore_eos", "ignore_eos cannot be combined with a forced tool call: the grammar ends the reply",
                  code="invalid_value")
    parallel = _bool(body, "parallel_tool_calls")
    return ChatParams(**common, messages=messages, reasoning_effort=effort,
                      tools=None if tools is None else tuple(tools), template_kwargs=kwargs, tool_choice=choice,
                      tool_function=function, parallel_tool_calls=True if parallel is None else parallel)


def _tool_choice(body: dict, tools: list | None) -> tuple[str, str | None]:
    """tool_choice -> (none | auto | required | function, the function's name); "auto" by default."""
    tc = _get(body, "tool_choice")
    if tc is _MISSING:
        return "auto", None
    want = 'one of none, auto, required, or {"type": "function", "function": {"name": ...}}'
    if isinstance(tc, str):
        if tc not in TOOL_CHOICES:
            raise bad("tool_choice", f"tool_choice must be {want}, got {_show(tc)}")
        choice, name = tc, None
    elif isinstance(tc, dict) and isinstance(tc.get("function"), dict) and isinstance(tc["function"].get("name"),
                                                                                        str):
        choice, name = "function", tc["function"]["name"]
    else:
        raise _wrong_type("tool_choice", tc, want)
    if choice in ("required", "function"):
        names = [t.get("function", {}).get("name") for t in tools or () if isinstance(t.get("function"), dict)]
        if not names:
            raise bad("tool_choice", f"tool_choice {_show(tc)} needs tools: send the functions in tools",
                      code="invalid_value")
        if name is not None and name not in names:
            raise bad("tool_choice", f"tool_choice names function {name!r}, which is not in tools; tools: "
                                     f"{', '.join(map(str, names))}", code="invalid_value")
    return choice, name


def parse_completion(body: dict) -> CompletionParams:
    common = _common(body, chat=False)
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING or prompt is None:
        raise bad("prompt", 'prompt is required: a string, e.g. {"prompt": "Once upon a time"}',
                  code="missing_field")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]          # a batch of one
    if isinstance(prompt, list):
        if prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise bad("prompt", f"prompt holds {len(prompt)} prompts; this server takes one prompt per request",
                      code="unsupported")
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int):
                raise _wrong_type(f"prompt[{i}]", t, "a token id (integer); prompt must be a string or an array "
                                                     "of token ids")
        if not prompt:
            raise bad("prompt", "prompt is empty: send some text or token ids", code="empty_prompt")
        prompt = tuple(prompt)
    elif not isinstance(prompt, str):
        raise _wrong_type("prompt", prompt, "a string or an array of token ids")
    echo = bool(_bool(body, "echo"))
    if echo and common["logprobs"] is not None:
        raise bad("echo", "echo with logprobs (the prompt's logprobs) is not supported; send one of them",
                  code="unsupported")
    suffix = _get(body, "suffix")
    if suffix is not _MISSING and suffix != "":
        raise bad("suffix", "suffix (insertion) is not supported by this server; leave suffix out",
                  code="unsupported")
    return CompletionParams(**common, prompt=prompt, echo=echo)


# --- responses -------------------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


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
                  completion_tokens: int, timings: dict | None = None) -> dict:
    """choices: {"index", "message", "logprobs", "finish_reason"} each."""
    out = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
           "usage": usage(prompt_tokens, completion_tokens)}
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
                        completion_tokens: int, timings: dict | None = None) -> dict:
    """choices: {"index", "text", "logprobs", "finish_reason"} each."""
    out = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
           "usage": usage(prompt_tokens, completion_tokens)}
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


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def models_list(model: str, created: int, max_context: int) -> dict:
    return {"object": "list", "data": [model_card(model, created, max_context)]}


def model_card(model: str, created: int, max_context: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "strata", "max_context": max_context}


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def now() -> int:
    return int(time.time())
