"""The streaming tool-call parser (strata/serve/tool_calls.py): each reply parsed whole gives the content and calls a
client should see, and split at every byte (UTF-8 decoded incrementally, as the server's decoder emits text) or fed a
character at a time it gives exactly the same."""
from __future__ import annotations

import codecs
import itertools
import json

import pytest

from strata.serve.tool_calls import CallDelta, Parsed, ToolCallParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "opts": {"type": "object"}, "note": {"type": "string"}}}}}]

CASES = {
    "json": ('Let me look.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 🌧", "days": 3}}\n'
             '</tool_call>',
             "Let me look.", [("get_weather", '{"city": "Zürich 🌧", "days": 3}')]),
    "two calls": ('<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": "}]\\""}]}}\n</tool_call>\n<tool_call>\n'
                  '{"name": "b", "arguments": {}}\n</tool_call>',
                  "", [("a", '{"x": [1, {"y": "}]\\""}]}'), ("b", "{}")]),
    "arguments first": ('<tool_call>{"arguments": {"k": "<tool_call>"}, "name": "f"}</tool_call>',
                        "", [("f", '{"k": "<tool_call>"}')]),
    "arguments as a string": ('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
                              "", [("f", '{"a": 1}')]),
    "no arguments": ('<tool_call>\n{"name": "ping"}\n</tool_call>', "", [("ping", "{}")]),
    "scalar arguments": ('<tool_call>{"name": "f", "arguments": 12}</tool_call>', "", [("f", "12")]),
    "not a call": ("a <tool> b\n<tool_call>\nnot json\n</tool_call> after",
                   "a <tool> b\n<tool_call>\nnot json\n</tool_call> after", []),
    "text after a call": ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n\nDone.',
                          "Done.", [("f", '{"a": 1}')]),
    "cut off": ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2', "", [("f", '{"a": [1, 2')]),
    "no closing tag": ('<tool_call>{"name": "f", "arguments": {"a": 1}} trailing', "trailing", [("f", '{"a": 1}')]),
    "plain text": ("Just text, ending in spaces  \n", "Just text, ending in spaces  \n", []),
    "a tag's start at the end": ("ends with <tool_", "ends with <tool_", []),
    "xml": ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
            "<parameter=days>\n5\n</parameter>\n<parameter=opts>\n{\"unit\": \"C\"}\n</parameter>\n"
            "<parameter=note>\nline one\nline two\n</parameter>\n</function>\n</tool_call>",
            "Checking.", [("get_weather", '{"city": "São Paulo", "days": 5, "opts": {"unit": "C"}, '
                                          '"note": "line one\\nline two"}')]),
    "xml without parameters": ("<tool_call>\n<function=ping>\n</function>\n</tool_call>", "", [("ping", "{}")]),
    "xml untyped and wrong types": ("<tool_call><function=other><parameter=n>\n7\n</parameter><parameter=s>\nhi\n"
                                    "</parameter></function></tool_call>", "", [("other", '{"n": 7, "s": "hi"}')]),
}


def counter():
    c = itertools.count()
    return lambda: f"call_{next(c)}"


def parse(pieces) -> Parsed:
    p = ToolCallParser(TOOLS, new_id=counter())
    out = Parsed()
    for piece in pieces:
        out.add(p.push(piece))
    out.add(p.finish())
    return out


def calls(parsed: Parsed) -> list[tuple[str, str]]:
    """(name, arguments) per call, checking each call's first delta carries its id and name and the rest only
    arguments, in index order."""
    got: dict[int, list] = {}
    for d in parsed.calls:
        if d.index not in got:
            assert d.id == f"call_{d.index}" and d.name, d
            got[d.index] = [d.name, d.arguments]
        else:
            assert d.id is None and d.name is None, d
            got[d.index][1] += d.arguments
    assert list(got) == list(range(len(got)))
    return [tuple(v) for v in got.values()]


@pytest.mark.parametrize("name", CASES)
def test_whole_replies(name):
    text, content, want = CASES[name]
    out = parse([text])
    assert (out.content, calls(out)) == (content, want)
    for _, args in want:
        if name not in ("cut off",):
            json.loads(args)


@pytest.mark.parametrize("name", CASES)
def test_split_at_every_byte_and_character_by_character(name):
    text, content, want = CASES[name]
    data = text.encode()
    for k in range(len(data) + 1):
        dec = codecs.getincrementaldecoder("utf-8")()
        out = parse([dec.decode(data[:k]), dec.decode(data[k:], final=True)])
        assert (out.content, calls(out)) == (content, want), f"split at byte {k}"
    out = parse(list(text))
    assert (out.content, calls(out)) == (content, want), "a character at a time"


def test_deltas_stream_the_arguments_as_they_come():
    p = ToolCallParser(TOOLS, new_id=counter())
    first = p.push('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert first.calls == [CallDelta(0, "call_0", "get_weather", ""), CallDelta(0, None, None, '{"city": "Pa')]
    assert p.push('ris"').calls == [CallDelta(0, arguments='ris"')]
    assert p.push("}}\n</tool_call>").calls == [CallDelta(0, arguments="}")]
    assert p.finish().calls == []


def test_a_name_is_sent_only_once_complete():
    p = ToolCallParser(TOOLS, new_id=counter())
    assert p.push('<tool_call>{"name": "get_wea').calls == []
    assert p.push('ther", "arguments": {}}').calls == [CallDelta(0, "call_0", "get_weather", ""),
                                                       CallDelta(0, arguments="{}")]
