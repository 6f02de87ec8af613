"""Grammars for constrained decoding, through llguidance: a response_format's JSON schema, or the tool calls a
tool_choice of "required" or a named function forces, in the model's own tool-call form (Qwen3's JSON, Qwen3-Coder's
XML). JSON is written with fixed separators and no free whitespace, and an object schema that names its properties
allows no others unless it says so (as strict mode), so even a model with random weights cannot wander. A reply whose
prompt opened a reasoning block may finish it first. Each choice of a request gets its own matcher (a TokenMatcher).
"""
from __future__ import annotations

import copy
import json
import re

import llguidance
import llguidance.numpy
import numpy as np

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# schema keywords whose values are schemas, maps of schemas or lists of schemas (what _strict walks)
_SCHEMA, _SCHEMA_MAP, _SCHEMA_LIST = (("additionalProperties", "items", "not", "if", "then", "else", "contains",
                                       "unevaluatedProperties", "propertyNames"),
                                      ("properties", "patternProperties", "$defs", "definitions"),
                                      ("anyOf", "oneOf", "allOf", "prefixItems", "items"))


class GrammarError(ValueError):
    """A schema or tool list that cannot be compiled into a grammar: the message says why."""


class NoToolCallForm(GrammarError):
    """The model's chat template writes no tool call, so none can be forced."""


class Matcher:
    """One choice's grammar state (strata/sched/request.py TokenMatcher)."""

    def __init__(self, m: llguidance.LLMatcher, vocab: int):
        self.m = m
        self.buf = llguidance.numpy.allocate_token_bitmask(1, vocab)

    def mask(self) -> np.ndarray:
        llguidance.numpy.fill_next_token_bitmask(self.m, self.buf)
        return self.buf[0].copy()

    def accept(self, token: int) -> bool:
        return self.m.consume_token(int(token))

    def done(self) -> bool:
        return self.m.is_stopped()

    def error(self) -> str:
        """Why the last token was refused: llguidance's first line (the lines after it are its parser's state)."""
        return self.m.get_error().split("\n")[0]


class Constraint:
    """A compiled grammar (strata/sched/request.py TokenConstraint): matcher() is a fresh copy of its start state."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, lark: str, vocab: int):
        self.lark, self.vocab = lark, vocab
        try:
            self._start = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
        except (ValueError, TypeError, RuntimeError) as e:
            raise GrammarError(str(e).split("\n")[0]) from None
        if self._start.is_error():
            raise GrammarError(self._start.get_error().split("\n")[0])

    def matcher(self) -> Matcher:
        return Matcher(self._start.deep_copy(), self.vocab)


class Grammars:
    """The model's tokenizer as llguidance sees it (made once per server) and the grammars of requests."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, form: str | None = None):
        """form: the tool-call form, "json" or "xml" (default: the chat template's, Tokenizer.tool_call_form)."""
        self.vocab = vocab_size
        self.tok = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.think_end = tokenizer.token_to_id("</think>")
        self.form = form or tokenizer.tool_call_form()
        # llguidance reads every added token (Qwen3's <tool_call> too) as a special token, which no text literal
        # matches: a literal holding one must name its id
        self.specials = {text: i for text, i in tokenizer.added_tokens().items()
                         if i < vocab_size and self.tok.is_special_token(i)}
        self._split = (re.compile("|".join(map(re.escape, sorted(self.specials, key=len, reverse=True))))
                       if self.specials else None)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (a piece of a UTF-8 character possibly; a special token's text)."""
        return self.tok.decode_bytes([int(token)])

    def json(self, schema: dict | None, reasoning: bool = False) -> Constraint:
        """A reply that is one JSON value of `schema` (None: any JSON object)."""
        rules = [f"body: %json {_schema_json(schema if schema is not None else {'type': 'object'})}"]
        return self._compile("body", rules, reasoning)

    def tool_calls(self, tools: list[dict], max_calls: int = 1, reasoning: bool = False) -> Constraint:
        """A reply of one to max_calls tool calls, each to one of `tools` (OpenAI function tools)."""
        if max_calls < 1:
            raise GrammarError(f"a forced reply holds at least one tool call, not {max_calls}")
        if self.form is None:
            raise NoToolCallForm("the model's chat template writes no tool call (neither Qwen3's <tool_call> JSON "
                                 "nor Qwen3-Coder's <function=...> XML), so a call cannot be forced")
        rules, names = [], []
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            fn = fn if isinstance(fn, dict) else {}
            name, params = fn.get("name"), fn.get("parameters") or {"type": "object"}
            if not isinstance(name, str) or not isinstance(params, dict):
                raise GrammarError(f"tools[{i}] needs function.name (a string) and function.parameters (an object)")
            names.append(f"call_{i}")
            rules += (self._xml_call if self.form == "xml" else self._json_call)(i, name, params)
        rules.append("call: " + " | ".join(names))
        more = f' ("\\n" call){{0,{max_calls - 1}}}' if max_calls > 1 else ""
        return self._compile("call" + more, rules, reasoning)

    def _json_call(self, i: int, name: str, params: dict) -> list[str]:
        head = '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
        return [f"call_{i}: {self._text(head)} args_{i} {self._text('}' + chr(10) + '</tool_call>')}",
                f"args_{i}: %json {_schema_json(params)}"]

    def _xml_call(self, i: int, name: str, params: dict) -> list[str]:
        """`<function=NAME>` and its parameters in the schema's order (the required ones always): a string's text
        up to its closing tag (within its minLength and maxLength), any other type as JSON of its schema."""
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        required = set(params.get("required") or ())
        parts, rules = [], []
        for j, (key, spec) in enumerate(props.items()):
            spec = spec if isinstance(spec, dict) else {}
            value = f"value_{i}_{j}"
            if spec.get("type") == "string":
                low, high = spec.get("minLength", 0), spec.get("maxLength", "")
                rules.append(f"{value}[lazy]: /(?s:.{{{low},{high}}})\\n<\\/parameter>/")
                close = ""
            else:
                rules.append(f"{value}: %json {_schema_json(spec)}")
                close = self._text("\n</parameter>")
            rules.append(f"param_{i}_{j}: {self._text(f'<parameter={key}>' + chr(10))} {value} {close} "
                         f"{self._text(chr(10))}")
            parts.append(f"param_{i}_{j}" + ("" if key in required else "?"))
        head = f"<tool_call>\n<function={name}>\n"
        tail = self._text('</function>' + chr(10) + '</tool_call>')
        return [f"call_{i}: {self._text(head)} {' '.join(parts)} {tail}"] + rules

    def _text(self, text: str) -> str:
        """A Lark sequence that writes `text`: its special tokens by id, the rest as string literals."""
        if self._split is None:
            return _lit(text)
        out, at = [], 0
        for m in self._split.finditer(text):
            out += ([_lit(text[at:m.start()])] if m.start() > at else []) + [f"<[{self.specials[m.group()]}]>"]
            at = m.end()
        return " ".join(out + ([_lit(text[at:])] if at < len(text) else []))

    def _compile(self, body: str, rules: list[str], reasoning: bool) -> Constraint:
        prefix = ""
        if reasoning and self.think_end is not None:     # the prompt opened <think>: the reply may close it first
            prefix = f'/(?s:.*)/ <[{self.think_end}]> ("\\n\\n")? '
        return Constraint(self.tok, f"start: {prefix}{body}\n" + "\n".join(rules) + "\n", self.vocab)


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _schema_json(schema: dict) -> str:
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    return json.dumps({**_strict(schema), "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def _strict(schema):
    """A copy of schema in which every object schema that names properties, and says nothing of others, allows none."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if not isinstance(node, dict):
            return
        if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for key in _SCHEMA:
            walk(node.get(key))
        for key in _SCHEMA_MAP:
            if isinstance(node.get(key), dict):
                for sub in node[key].values():
                    walk(sub)
        for key in _SCHEMA_LIST:
            if isinstance(node.get(key), list):
                for sub in node[key]:
                    walk(sub)
    walk(schema)
    return schema
