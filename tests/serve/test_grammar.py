"""Grammars (strata/serve/grammar.py) on the demo tokenizer: random walks over the tokens each mask allows (a model
with random weights, in effect) always end, within a bound, in text that the tool-call parser reads as calls whose
arguments validate against the tool's schema, or in JSON that validates against the response schema; both tool-call
forms; a prompt that opened <think> may finish it first; bad schemas are refused with the reason."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from strata.builtin import builtin_dir
from strata.demo import demo_model_dir
from strata.serve.grammar import GrammarError, Grammars, NoToolCallForm
from strata.serve.tool_calls import Parsed, ToolCallParser
from strata.tokenizer import Tokenizer

VOCAB = 624
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                            "units": {"enum": ["C", "F"]}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]
REPORT = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 20},
                                           "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
                                           "ok": {"type": "boolean"}},
          "required": ["title", "scores", "ok"]}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(demo_model_dir())


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, VOCAB, tokenizer.eos_token_ids)


def walk(constraint, seed, limit=400, eos=(256, 258), vocab=VOCAB) -> tuple[list[int], bool]:
    """Tokens drawn uniformly from each mask until the grammar is complete or an end token is drawn -> (tokens,
    whether it ended within `limit`)."""
    rng = np.random.default_rng(seed)
    m, out = constraint.matcher(), []
    for _ in range(limit):
        allowed = np.flatnonzero(np.unpackbits(m.mask().view(np.uint8), bitorder="little")[:vocab])
        assert len(allowed), "a mask allowed nothing"
        tok = int(rng.choice(allowed))
        if tok in eos:
            return out, True
        assert m.accept(tok), m.error()
        out.append(tok)
        if m.done():
            return out, True
    return out, False


@pytest.mark.parametrize("form", ["json", "xml"])
def test_forced_tool_calls_parse_and_match_their_schema(tokenizer, form):
    grammars = Grammars(tokenizer, VOCAB, tokenizer.eos_token_ids, form=form)
    for most in (1, 3):
        c = grammars.tool_calls(TOOLS, max_calls=most)
        for seed in range(8):
            toks, ended = walk(c, seed)
            assert ended, "a forced call did not end within 400 tokens"
            p = ToolCallParser(TOOLS)
            out = Parsed()
            out.add(p.push(tokenizer.decode(toks)))
            out.add(p.finish())
            assert out.content == "" and len(out.calls) >= 1
            assert 1 <= len({d.index for d in out.calls}) <= most
            by_index: dict = {}
            for d in out.calls:
                by_index.setdefault(d.index, [d.name, ""])[1] += d.arguments
            for name, args in by_index.values():
                schema = WEATHER if name == "get_weather" else {"type": "object", "maxProperties": 0}
                jsonschema.validate(json.loads(args), schema)


def test_a_named_choice_calls_that_function(grammars, tokenizer):
    c = grammars.tool_calls(TOOLS[:1])
    toks, ended = walk(c, 3)
    text = tokenizer.decode(toks)
    assert ended and text.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": ')


def test_json_schema_output_validates(grammars, tokenizer):
    c = grammars.json(REPORT)
    for seed in range(8):
        toks, ended = walk(c, seed)
        assert ended
        jsonschema.validate(json.loads(tokenizer.decode(toks)), REPORT)
    any_object = grammars.json(None)               # unbounded: checked on given text, not on random walks
    m = any_object.matcher()
    assert all(m.accept(t) for t in tokenizer.encode('{"a": [1, {"b": null}], "c": "d"}')) and m.done()
    assert not any_object.matcher().accept(tokenizer.encode("[")[0])


def test_properties_not_named_are_not_allowed_unless_the_schema_says_so(grammars, tokenizer):
    c = grammars.json({"type": "object", "properties": {"a": {"type": "boolean"}}})
    for seed in range(6):
        toks, _ = walk(c, seed)
        assert set(json.loads(tokenizer.decode(toks))) <= {"a"}


def test_a_prompt_that_opened_think_may_finish_it_first(grammars, tokenizer):
    c = grammars.json(REPORT, reasoning=True)
    m = c.matcher()
    think_end = tokenizer.token_to_id("</think>")
    answer = tokenizer.encode('\n\n{"title": "t", "scores": [], "ok": true}')
    toks = tokenizer.encode("let me see") + [think_end] + answer
    assert all(m.accept(t) for t in toks) and m.done()


def test_bad_schemas_are_refused_with_the_reason(grammars):
    with pytest.raises(GrammarError, match="nonsense"):
        grammars.json({"type": "object", "properties": {"a": {"type": "nonsense"}}})
    with pytest.raises(GrammarError, match="tools\\[0\\] needs function.name"):
        grammars.tool_calls([{"type": "function", "function": {"parameters": {}}}])


def test_parallel_calls_stop_at_max_calls(grammars, tokenizer):
    """A model that always starts another call is ended after max_calls of them: the separator is refused then."""
    call = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    m = grammars.tool_calls(TOOLS, max_calls=2).matcher()
    assert all(m.accept(t) for t in tokenizer.encode(call + "\n" + call))
    newline = tokenizer.encode("\n")[0]
    allowed = np.unpackbits(m.mask().view(np.uint8), bitorder="little")
    assert not allowed[newline] and not m.accept(newline)
    with pytest.raises(GrammarError, match="at least one tool call"):
        grammars.tool_calls(TOOLS, max_calls=0)


@pytest.mark.parametrize("form", ["json", "xml"])
def test_a_tokenizer_whose_call_markers_are_added_tokens_writes_them_as_those_tokens(form):
    """tiny's (and Qwen3's) `<tool_call>` and `</tool_call>` are added tokens, which llguidance reads only as
    themselves: the grammar names them by id, so random walks end in calls the parser reads and the schema admits,
    and the model's own encoding of a call (the tokenizer makes <tool_call> one token) is accepted."""
    tok = Tokenizer.from_dir(builtin_dir("tiny"))
    grammars = Grammars(tok, tok.vocab_size, tok.eos_token_ids, form=form)
    opened, closed = tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>")
    c = grammars.tool_calls(TOOLS[:1])
    for seed in range(4):
        toks, ended = walk(c, seed, vocab=tok.vocab_size, eos=tuple(tok.eos_token_ids))
        assert ended and toks[0] == opened and toks[-1] == closed
        out = Parsed()
        p = ToolCallParser(TOOLS)
        out.add(p.push(tok.decode(toks)))
        out.add(p.finish())
        assert out.content == "" and {d.name for d in out.calls if d.id} == {"get_weather"}
        jsonschema.validate(json.loads("".join(d.arguments for d in out.calls)), WEATHER)
    if form == "json":
        m = c.matcher()
        call = tok.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>')
        assert call[0] == opened and all(m.accept(t) for t in call) and m.done()


def test_a_refused_token_says_why_in_one_line():
    tok = Tokenizer.from_dir(builtin_dir("tiny"))
    m = Grammars(tok, tok.vocab_size, tok.eos_token_ids).tool_calls(TOOLS[:1]).matcher()
    assert not m.accept(tok.encode("<")[0])
    assert m.error() and "\n" not in m.error()


def test_a_template_without_a_tool_call_form_cannot_force_one(tokenizer):
    """Forcing a call needs the template's call form; a template that writes none is refused by name."""
    grammars = Grammars(tokenizer, VOCAB, tokenizer.eos_token_ids)
    grammars.form = None
    with pytest.raises(NoToolCallForm, match="writes no tool call"):
        grammars.tool_calls(TOOLS)
