"""Tool calls in a model's reply, parsed as the text streams in (pieces of any size, split anywhere).

Forms: Qwen3's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` and the Qwen3-Coder XML form
`<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>` (newlines between the tags; values
typed by the tool's JSON schema). push() returns the content text and the OpenAI tool-call deltas that text completes:
a call's id and name first, then its arguments in fragments whose concatenation is the arguments' JSON text.
Whitespace around calls is not content. A block that never names a function comes back as content, as written.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")
MAX_TAG_NAME = 256                 # a <function=...> or <parameter=...> name longer than this is not a tag


@dataclass
class CallDelta:
    index: int
    id: str | None = None          # with the name, in a call's first delta only
    name: str | None = None
    arguments: str = ""


@dataclass
class Parsed:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add(self, other: "Parsed") -> None:
        """Append another piece's result, joining argument fragments of the same call."""
        self.content += other.content
        for d in other.calls:
            last = self.calls[-1] if self.calls else None
            if last is not None and last.index == d.index and d.id is None:
                last.arguments += d.arguments
            else:
                self.calls.append(CallDelta(d.index, d.id, d.name, d.arguments))


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _partial(text: str, tag: str) -> bool:
    """text is a proper beginning of tag (more text may complete it)."""
    return len(text) < len(tag) and tag.startswith(text)


def _held(text: str, tag: str) -> int:
    """How many characters at the end of text could begin tag."""
    return max((k for k in range(1, min(len(tag), len(text) + 1)) if text.endswith(tag[:k])), default=0)


class ToolCallParser:
    def __init__(self, tools: list[dict] | None = None, new_id=new_call_id):
        self.schemas = {}                  # function name -> its parameters' JSON schema (types XML values)
        for t in tools or ():
            fn = t.get("function") if isinstance(t, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                self.schemas[fn["name"]] = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
        self.new_id = new_id
        self.calls = 0                     # calls begun
        self.pending = ""                  # text outside blocks not yet resolved (it may begin OPEN)
        self.ws = ""                       # whitespace at the end of the content so far, sent once text follows
        self.after_call = False            # the content so far ends with a call: leading whitespace is not content
        self.block: _Block | None = None

    def push(self, text: str) -> Parsed:
        out = Parsed()
        self.pending += text
        while self.pending:
            if self.block is None:
                i = self.pending.find(OPEN)
                if i < 0:
                    keep = _held(self.pending, OPEN)
                    self._content(out, self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    return out
                self._content(out, self.pending[:i])
                self.block, self.pending = _Block(self), self.pending[i + len(OPEN):]
            rest = self.block.feed(self.pending, out)
            self.pending = ""
            if rest is None:
                return out
            self._ended(out)
            self.pending = rest
        return out

    def finish(self) -> Parsed:
        """The end of the reply: an open block ends as it is; what was held back is content (trailing whitespace
        only when there was no call)."""
        out = Parsed()
        if self.block is not None:
            self.block.close(out)
            self._ended(out)
        self._content(out, self.pending)
        if not self.calls:
            out.content += self.ws
        self.pending = self.ws = ""
        return out

    def _ended(self, out: Parsed) -> None:
        b, self.block = self.block, None
        if b.index is None:                # not a call: its text is content, as written
            self._content(out, OPEN + b.consumed)
        else:
            self.after_call, self.ws = True, ""

    def _content(self, out: Parsed, text: str) -> None:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        text = self.ws + text
        body = text.rstrip()
        out.content += body
        self.ws = text[len(body):]

    def begin(self, name: str, out: Parsed) -> int:
        """A call starts: the whitespace before it is not content."""
        self.ws = ""
        index = self.calls
        self.calls += 1
        out.calls.append(CallDelta(index, self.new_id(), name, ""))
        return index


class _Block:
    """One `<tool_call>` block after its opening tag: its form is the first character that is not whitespace."""

    def __init__(self, parser: ToolCallParser):
        self.parser = parser
        self.fed = ""
        self.consumed = ""               # the block's text up to its end (its raw text when it is not a call)
        self.form: _Json | _Xml | None = None

    @property
    def index(self) -> int | None:
        return None if self.form is None else self.form.index

    def feed(self, text: str, out: Parsed) -> str | None:
        """-> the text after the block once it ended, else None."""
        self.fed += text
        if self.form is None:
            head = self.fed.lstrip()
            if not head:
                return None
            self.form = _Xml(self) if head.startswith("<") else _Json(self)
            text = self.fed
        rest = self.form.feed(text, out)
        if rest is not None:
            self.consumed = self.fed[:len(self.fed) - len(rest)]
        return rest

    def close(self, out: Parsed) -> None:
        if self.form is not None:
            self.form.close(out)
        self.consumed = self.fed


class _Json:
    """`{"name": ..., "arguments": ...}` scanned one character at a time: the name once its string is complete; the
    arguments' text as it comes (once the name is known); arguments sent as a JSON string are decoded at their end."""

    def __init__(self, block: _Block):
        self.block = block
        self.buf, self.i = "", 0
        self.phase = "object"              # object | after (its closing brace seen) | junk (not an object)
        self.stack: list[str] = []
        self.in_string = self.escape = False
        self.expect = "key"                # at depth 1: key | colon | value | in_value | comma
        self.key = None
        self.key_start = self.value_start = -1
        self.kind = None                   # the depth-1 value's first character class: "{", "[", '"', "scalar"
        self.name = self.index = None
        self.args_start = self.args_end = -1
        self.args_kind = None
        self.sent = 0                      # buf index up to which the arguments were sent
        self.closed = False

    def feed(self, text: str, out: Parsed) -> str | None:
        self.buf += text
        rest = self._scan()
        self._flush(out)
        if rest is not None:
            self.close(out)
        return rest

    def _scan(self) -> str | None:
        while self.i < len(self.buf):
            tail = self.buf[self.i:]
            if self.phase != "object" or (not self.in_string and tail[0] == "<"):
                if tail.startswith(CLOSE):
                    return tail[len(CLOSE):]
                if _partial(tail, CLOSE):
                    return None
                if self.phase == "after" and not tail[0].isspace():
                    return tail                      # no closing tag: the call ends with its object
            if self.phase == "object":
                self._step(tail[0])
            self.i += 1
        return None

    def _step(self, c: str) -> None:
        depth = len(self.stack)
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if depth == 1 and self.expect == "key":
                    self.key, self.expect = _loads(self.buf[self.key_start:self.i + 1]), "colon"
                elif depth == 1 and self.kind == '"':
                    self._value_end(self.i + 1)
            return
        if depth == 0:
            if c == "{":
                self.stack.append(c)
            elif not c.isspace():
                self.phase = "junk"
            return
        if depth == 1:
            if self.expect == "in_value":                  # a scalar: it ends at a delimiter
                if not (c.isspace() or c in ",}"):
                    return
                self._value_end(self.i)
            if c.isspace():
                return
            if self.expect == "key" and c == '"':
                self.in_string, self.key_start = True, self.i
            elif self.expect == "colon" and c == ":":
                self.expect = "value"
            elif self.expect == "value":
                self.value_start, self.kind, self.expect = self.i, (c if c in '{["' else "scalar"), "in_value"
                if self.key in ARGUMENT_KEYS:
                    self.args_start, self.args_kind = self.i, self.kind
                if c == '"':
                    self.in_string = True
                elif c in "{[":
                    self.stack.append(c)
            elif self.expect in ("key", "comma") and c == "}":
                self.stack.pop()
                self.phase = "after"
            elif self.expect == "comma" and c == ",":
                self.expect = "key"
            return
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.stack.append(c)
        elif c in "}]":
            self.stack.pop()
            if len(self.stack) == 1:
                self._value_end(self.i + 1)

    def _value_end(self, end: int) -> None:
        if self.key == "name":
            name = _loads(self.buf[self.value_start:end])
            self.name = name if isinstance(name, str) else None
        elif self.key in ARGUMENT_KEYS:
            self.args_end = end
        self.kind, self.expect = None, "comma"

    def _flush(self, out: Parsed) -> None:
        """Send what is known: the call once its name is complete, then its arguments' text as far as scanned."""
        if self.name is not None and self.index is None:
            self.index = self.block.parser.begin(self.name, out)
        if self.index is None or self.args_start < 0 or self.args_kind == '"':
            return
        end = self.args_end if self.args_end >= 0 else self.i
        if end > self.sent and end > self.args_start:
            out.calls.append(CallDelta(self.index, arguments=self.buf[max(self.sent, self.args_start):end]))
            self.sent = end

    def close(self, out: Parsed) -> None:
        """The block ends: a call's arguments given as a string are sent decoded; none at all are "{}"."""
        if self.closed:
            return
        self.closed = True
        self._flush(out)
        if self.index is None:
            return
        if self.args_start < 0:
            out.calls.append(CallDelta(self.index, arguments="{}"))
        elif self.args_kind == '"':
            text = _loads(self.buf[self.args_start:self.args_end]) if self.args_end >= 0 else None
            out.calls.append(CallDelta(self.index, arguments=text if isinstance(text, str) else "{}"))


class _Xml:
    """`<function=NAME>`, then `<parameter=KEY>VALUE</parameter>`s and `</function>`: the call at its name, each
    parameter as an arguments fragment once its closing tag arrives, the closing brace at `</function>`."""

    TAGS = ("<function=", "<parameter=", "</function>", CLOSE)

    def __init__(self, block: _Block):
        self.block = block
        self.buf, self.pos = "", 0
        self.name = self.index = self.key = None
        self.n_params = 0
        self.closed = False                # the arguments' closing brace was sent

    def feed(self, text: str, out: Parsed) -> str | None:
        self.buf += text
        while True:
            if self.key is not None:
                j = self.buf.find("</parameter>", self.pos)
                if j < 0:
                    return None
                self._parameter(self.buf[self.pos:j], out)
                self.pos, self.key = j + len("</parameter>"), None
                continue
            while self.pos < len(self.buf) and self.buf[self.pos].isspace():
                self.pos += 1
            rest = self.buf[self.pos:]
            if not rest:
                return None
            tag = next((t for t in self.TAGS if rest.startswith(t)), None)
            if tag is None:
                if any(_partial(rest, t) for t in self.TAGS):
                    return None
                self.close(out)
                return rest                          # something else: the call ends here
            if tag.endswith("="):
                gt = rest.find(">")
                if gt < 0:
                    if len(rest) > MAX_TAG_NAME or "\n" in rest:
                        self.close(out)
                        return rest
                    return None
                value = rest[len(tag):gt].strip()
                self.pos += gt + 1
                if tag == "<function=" and self.index is None:
                    self.name, self.index = value, self.block.parser.begin(value, out)
                elif tag == "<parameter=":
                    self.key = value
                continue
            self.pos += len(tag)
            if tag == CLOSE:
                self.close(out)
                return self.buf[self.pos:]
            self.close(out)                          # </function>

    def _parameter(self, raw: str, out: Parsed) -> None:
        if self.index is None or self.closed:
            return
        value = raw[1:] if raw.startswith("\n") else raw
        value = value[:-1] if value.endswith("\n") else value
        typed = _typed(value, self.block.parser.schemas.get(self.name, {}), self.key)
        frag = json.dumps(self.key, ensure_ascii=False) + ": " + json.dumps(typed, ensure_ascii=False)
        out.calls.append(CallDelta(self.index, arguments=("{" if self.n_params == 0 else ", ") + frag))
        self.n_params += 1

    def close(self, out: Parsed) -> None:
        if self.index is not None and not self.closed:
            self.closed = True
            out.calls.append(CallDelta(self.index, arguments="}" if self.n_params else "{}"))


def _typed(value: str, schema: dict, key: str):
    """A parameter's text as its schema types it: a string stays text; anything else is parsed as JSON when it
    parses to that type (or, untyped, to anything), else kept as text."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    spec = props.get(key) if isinstance(props, dict) else None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "string":
        return value
    parsed = _loads(value.strip())
    want = {"integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}.get(kind)
    if parsed is None and value.strip() != "null" or want is not None and (
            not isinstance(parsed, want) or isinstance(parsed, bool) and kind in ("integer", "number")):
        return value
    return parsed


def _loads(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return None
