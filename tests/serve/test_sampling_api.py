"""What is sampled, through the live server and the official openai client: forced tool calls (whole and streamed,
the deltas reassembling to the whole response's calls), tool history rendered by the template, response_format JSON
schemas, logprobs for chat and text completions (the log-softmax of the engine's logits), n choices, logit_bias and
penalties, seeds. The demo model has random weights: the grammar is what makes its output valid."""
from __future__ import annotations

import json

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from strata.engine.sampling import logprobs_reference

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
REPORT = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 16},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                    "maxItems": 3},
                                           "ok": {"type": "boolean"}},
          "required": ["title", "tags", "ok"]}


@pytest.fixture(scope="module")
def server(demo_engine, serve):
    with serve(demo_engine, parallel=3, prefill=64, max_context=1024) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def streamed_calls(chunks) -> tuple[dict, dict, dict]:
    """Reassemble streamed chunks -> ({choice: {call index: [id, name, arguments]}}, {choice: content},
    {choice: finish_reason})."""
    calls: dict = {}
    content: dict = {}
    finish: dict = {}
    for ch in chunks:
        for c in ch.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            for tc in c.delta.tool_calls or ():
                mine = calls.setdefault(c.index, {})
                if tc.id is not None:
                    assert tc.index not in mine and tc.function.name, "a call's first delta has its id and name"
                    mine[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
                else:
                    assert tc.function.name is None
                    mine[tc.index][2] += tc.function.arguments
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return calls, content, finish


def test_a_required_tool_call_is_valid_even_from_random_weights(client, server):
    """parallel_tool_calls left on (the default): greedy random weights keep calling, and the grammar ends the reply
    after max_tool_calls calls, well inside max_tokens; each call validates against its tool's schema."""
    kw = dict(model="demo", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=400, temperature=0)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    most = server.app.state.strata.config.serve.max_tool_calls
    assert choice.finish_reason == "tool_calls" and 1 <= len(choice.message.tool_calls) <= most
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        schema = TOOLS[0 if call.function.name == "get_weather" else 1]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    assert choice.message.content is None and r.usage.completion_tokens < 400
    calls, content, finish = streamed_calls(list(client.chat.completions.create(**kw, stream=True)))
    assert [(c[1], c[2]) for c in calls[0].values()] == [(c.function.name, c.function.arguments)
                                                          for c in choice.message.tool_calls]
    assert content[0] == "" and finish == {0: "tool_calls"}
    one = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1


def test_parallel_calls_end_when_the_model_ends_them(client):
    """Greedy random weights repeat their call rather than end the reply: each complete call is valid, the last
    one is cut by the length, streamed and whole alike."""
    kw = dict(model="demo", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=150, temperature=0)
    r = client.chat.completions.create(**kw)
    got = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "length" and len(got) >= 2
    for call in got[:-1]:
        schema = TOOLS[0 if call.function.name == "get_weather" else 1]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    calls, _, _ = streamed_calls(list(client.chat.completions.create(**kw, stream=True)))
    assert [(c[1], c[2]) for c in calls[0].values()] == [(c.function.name, c.function.arguments) for c in got]


def test_a_named_tool_choice_calls_that_function(client):
    r = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, max_tokens=400,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       parallel_tool_calls=False, temperature=0.8, seed=3)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    jsonschema.validate(json.loads(calls[0].function.arguments), TOOLS[1]["function"]["parameters"])


def test_tool_history_is_rendered_and_tool_choice_none_hides_the_tools(client, server):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    tok = server.app.state.strata.tokenizer
    want = tok.apply_chat_template(history, add_generation_prompt=True, tools=TOOLS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in want
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in want
    r = client.chat.completions.create(model="demo", messages=history, tools=TOOLS, max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == len(tok.encode(want))
    r = client.chat.completions.create(model="demo", messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=3, temperature=0)
    hidden = tok.apply_chat_template(history, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tok.encode(hidden)) and r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(client, stream):
    rf = {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT, "strict": True}}
    for seed in (1, 2):
        kw = dict(model="demo", messages=ASK, response_format=rf, max_tokens=400, temperature=1.0, seed=seed)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                           if c.choices)
        else:
            r = client.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "stop"
            text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), REPORT)


def _counter(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_a_json_schema_stream_beside_a_plain_one_gets_its_text_alone_and_its_masks_late(client, server):
    """A streamed json_schema reply beside a long plain stream: the same text as alone (greedy), valid, and the
    windows dispatched ahead while both ran gave the grammar row its masks after dispatch (strata_windows_late_masks),
    so it decoded in them rather than every other one."""
    from concurrent.futures import ThreadPoolExecutor
    rf = {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT, "strict": True}}
    kw = dict(model="demo", messages=ASK, response_format=rf, max_tokens=300, temperature=0)
    alone = client.chat.completions.create(**kw).choices[0].message.content
    before = _counter(server, "strata_windows_late_masks_total")

    def json_stream():
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                       if c.choices)

    def plain_stream():
        return sum(1 for c in client.chat.completions.create(model="demo", messages=ASK, max_tokens=300, stream=True,
                                                             temperature=0, extra_body={"ignore_eos": True})
                   if c.choices and c.choices[0].delta.content)
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(plain_stream)
        text = pool.submit(json_stream).result()
        assert plain.result() > 0
    assert text == alone
    jsonschema.validate(json.loads(text), REPORT)
    assert _counter(server, "strata_windows_late_masks_total") > before


def test_json_object_and_text_completions_with_a_schema(client):
    r = client.chat.completions.create(model="demo", messages=ASK, response_format={"type": "json_object"},
                                       max_tokens=400, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    t = client.completions.create(model="demo", prompt="Report:", max_tokens=400, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                      "name": "r", "schema": REPORT}}})
    jsonschema.validate(json.loads(t.choices[0].text), REPORT)


def test_chat_logprobs_are_the_log_softmax_of_the_engines_logits(client, server, demo_engine):
    r = client.chat.completions.create(model="demo", messages=ASK, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and r.choices[0].finish_reason == "length"
    state = server.app.state.strata
    tok = state.tokenizer
    prompt = tok.encode(tok.apply_chat_template(ASK, add_generation_prompt=True))
    ids = demo_engine.generate(prompt, 6, stop_token_ids=())            # the greedy tokens
    assert [bytes(e.bytes) for e in content] == [state.grammars().token_bytes(t) for t in ids]
    ref = logprobs_reference(demo_engine.logits(np.array(prompt + ids[:-1], np.int32)))[len(prompt) - 1:]
    for i, e in enumerate(content):
        assert e.logprob == pytest.approx(ref[i, ids[i]], abs=2e-5)
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token, "greedy: the top token is sampled"
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    chunks = list(client.chat.completions.create(model="demo", messages=ASK, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_text_completion_logprobs(client):
    t = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2)
    lp = t.choices[0].logprobs
    assert "".join(lp.tokens) == t.choices[0].text and len(lp.token_logprobs) == 5
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(5)]
    assert all(len(top) <= 2 and max(top.values()) >= lp_ - 1e-6 for top, lp_ in zip(lp.top_logprobs,
                                                                                     lp.token_logprobs))


def test_n_choices(client):
    r = client.chat.completions.create(model="demo", messages=ASK, max_tokens=8, temperature=0, n=3,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 1, "greedy: every choice is the same"
    assert r.usage.completion_tokens == 24
    hot = dict(model="demo", messages=ASK, max_tokens=8, temperature=1.5, n=2, seed=11)
    a, b = client.chat.completions.create(**hot), client.chat.completions.create(**hot)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices], "seeded"
    assert a.choices[0].message.content != a.choices[1].message.content
    chunks = list(client.chat.completions.create(**hot, stream=True))
    texts: dict = {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {i: c.message.content for i, c in enumerate(a.choices)}


def test_logit_bias_and_penalties(client, server):
    tok = server.app.state.strata.tokenizer
    forced = client.completions.create(model="demo", prompt="x", max_tokens=5, temperature=1.0,
                                       logit_bias={"77": 100})
    assert forced.choices[0].text == tok.decode([77] * 5)
    plain = client.completions.create(model="demo", prompt="x", max_tokens=5, temperature=0)
    first = tok.encode(plain.choices[0].text)[0]
    banned = client.completions.create(model="demo", prompt="x", max_tokens=5, temperature=0,
                                       logit_bias={str(first): -100})
    assert first not in tok.encode(banned.choices[0].text)
    biased = dict(model="demo", prompt="x", max_tokens=8, temperature=0, logit_bias={"77": 6})
    repeated = client.completions.create(**biased).choices[0].text
    assert repeated == tok.decode([77] * 8)
    penalized = client.completions.create(**biased, frequency_penalty=0.9, presence_penalty=0.6,
                                          extra_body={"repetition_penalty": 1.4}).choices[0].text
    assert penalized != repeated and penalized == client.completions.create(
        **biased, frequency_penalty=0.9, presence_penalty=0.6, extra_body={"repetition_penalty": 1.4}).choices[0].text


def test_seeds_make_sampled_requests_repeatable(client):
    kw = dict(model="demo", prompt="Seeds", max_tokens=10, temperature=1.2)
    a, b = (client.completions.create(**kw, seed=5).choices[0].text for _ in range(2))
    c = client.completions.create(**kw, seed=6).choices[0].text
    assert a == b and a != c


def test_raw_stream_chunks_are_openai_shaped(server):
    body = {"model": "demo", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 400,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=server.url, timeout=120) as http, http.stream("POST", "/v1/chat/completions",
                                                                             json=body) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    firsts = [tc for ch in chunks for c in ch["choices"] for tc in c["delta"].get("tool_calls", []) if "id" in tc]
    assert firsts and all(tc["type"] == "function" and tc["function"]["name"] for tc in firsts)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
