"""The built-in `tiny` model (trained weights, Qwen3's chat template, `<tool_call>` an added token) through a live
server and the official openai client: forced tool calls (required and named) come back as calls whose arguments
validate against the tool's schema, and a model whose template writes no tool call refuses to force one by name."""
from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import openai
import pytest

from strata.builtin import builtin_dir
from tests.serve.test_sampling_api import ASK, TOOLS


@pytest.fixture(scope="module")
def tiny_engine():
    from strata.engine import Engine
    return Engine.load("tiny", max_context=2048)


@pytest.fixture(scope="module")
def server(tiny_engine, serve):
    with serve(tiny_engine, model="tiny", parallel=2, prefill=64, max_context=1024) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _check_calls(calls, names):
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_on_tiny_is_a_valid_call(client, stream):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0.7,
              seed=5, parallel_tool_calls=False)
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
        return
    calls: dict = {}
    finish = None
    for ch in client.chat.completions.create(**kw, stream=True):
        for c in ch.choices:
            assert not c.delta.content
            for tc in c.delta.tool_calls or ():
                if tc.id is not None:
                    calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
                else:
                    calls[tc.index][2] += tc.function.arguments
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    (cid, name, args), = calls.values()
    assert cid.startswith("call_") and name in {"get_weather", "get_time"}
    jsonschema.validate(json.loads(args), next(t["function"]["parameters"] for t in TOOLS
                                               if t["function"]["name"] == name))


def test_a_named_tool_choice_on_tiny_calls_that_function(client):
    for name in ("get_weather", "get_time"):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200,
                                           tool_choice={"type": "function", "function": {"name": name}},
                                           parallel_tool_calls=False, temperature=0)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == [name]
        _check_calls(calls, {name})


def test_a_forced_call_no_reply_can_follow_is_a_400_that_says_why(client):
    """A tool whose parameters no value satisfies: the grammar cannot be followed, so the request is refused before
    it runs, in one line naming the field, never a 500 with the grammar library's state."""
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 3}}, "required": ["n"]}}}]
    for choice in ("required", {"type": "function", "function": {"name": "pick"}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=ASK, tools=tools, tool_choice=choice, max_tokens=50)
        err = e.value.body
        assert e.value.status_code == 400 and err["param"] == "tools" and err["code"] == "invalid_schema"
        assert "cannot be turned into a grammar" in err["message"] and "Unsatisfiable" in err["message"]
        assert "property 'n' is unsatisfiable" in err["message"]
        assert "\n" not in err["message"] and "<state>" not in err["message"]


@pytest.fixture(scope="module")
def no_tools_dir(tmp_path_factory):
    """tiny with a chat template that knows no tools: it renders them nowhere and writes no call."""
    d = tmp_path_factory.mktemp("tiny-no-tools") / "tiny-no-tools"
    shutil.copytree(builtin_dir("tiny"), d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                            "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_a_model_whose_template_writes_no_tool_call_refuses_to_force_one(no_tools_dir, serve):
    """No 500 and no grammar state: a 400 naming tool_choice and what to use instead; auto still answers."""
    from strata.engine import Engine
    engine = Engine.load(str(no_tools_dir), max_context=1024)
    with serve(engine, model=str(no_tools_dir), parallel=1, prefill=64, max_context=512) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model="tiny-no-tools", messages=ASK, tools=TOOLS, tool_choice=choice,
                                          max_tokens=50)
            err = e.value.body
            assert e.value.status_code == 400 and err["param"] == "tool_choice"
            assert err["code"] == "unsupported_tool_choice"
            assert "writes no tool call" in err["message"] and "use tool_choice 'auto' or 'none'" in err["message"]
            assert "\n" not in err["message"]
        r = c.chat.completions.create(model="tiny-no-tools", messages=ASK, tools=TOOLS, max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_an_empty_think_block_leaves_no_reasoning_and_no_leading_blank_lines(client, stream):
    """tiny opens its replies with `<think>\\n\\n</think>\\n\\n` (its logprobs show the tokens): that is layout, so
    neither reasoning_content nor the content's first characters carry it."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "What is a list?"}], max_tokens=24,
              temperature=0, logprobs=True)
    if stream:
        chunks = [ch for ch in client.chat.completions.create(**kw, stream=True) if ch.choices]
        deltas = [ch.choices[0].delta for ch in chunks]
        reasoning = [(d.model_extra or {}).get("reasoning_content") for d in deltas]
        content = "".join(d.content or "" for d in deltas)
        tokens = [t.token for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    else:
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        reasoning = [(msg.model_extra or {}).get("reasoning_content")]
        content = msg.content
        tokens = [t.token for t in r.choices[0].logprobs.content]
    assert tokens[0] == "<think>" and "</think>" in tokens[:4]
    assert "".join(tokens[1:tokens.index("</think>")]).strip() == ""
    assert all(x is None for x in reasoning)
    assert content and content == content.lstrip() and len(content.split()) >= 3


def test_cached_tokens_report_what_the_prompt_cache_reused(client, server):
    """usage.prompt_tokens_details.cached_tokens: 0 on a conversation's first turn; on the next turn the prompt
    tokens the prompt cache gave (what its counter adds), whole and in the streamed usage chunk."""
    history = [{"role": "user", "content": "How does a dictionary store its keys, and which keys are allowed?"}]
    reused = server.scheduler.metrics()["prompt_cache_tokens_reused"]
    first = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert server.scheduler.metrics()["prompt_cache_tokens_reused"] == reused
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And a set?"}]
    second = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= second.usage.prompt_tokens
    assert server.scheduler.metrics()["prompt_cache_tokens_reused"] == reused + cached
    chunks = list(client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(ch.usage is None for ch in chunks[:-1]) and not chunks[-1].choices
    streamed = chunks[-1].usage
    assert streamed.prompt_tokens == second.usage.prompt_tokens
    assert 0 < streamed.prompt_tokens_details.cached_tokens <= streamed.prompt_tokens
    cold = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0,
                                          extra_body={"cache_prompt": False})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    text = client.completions.create(model="tiny", prompt="A tuple is an immutable", max_tokens=4, temperature=0)
    assert text.usage.prompt_tokens_details.cached_tokens == 0


def test_sampling_defaults_come_from_the_models_generation_config(client, server):
    """tiny's generation_config.json sets temperature, top_p and top_k: a request that leaves them out samples
    exactly as one that sends them (same seed, same tokens), in words, and not as the API's own defaults would;
    a request's own value wins; /props shows them."""
    from strata.train_tiny import real_word_fraction, training_words
    config = json.loads((builtin_dir("tiny") / "generation_config.json").read_text())
    given = {k: config[k] for k in ("temperature", "top_p", "top_k")}
    assert server.app.state.strata.sampling_defaults == given
    params = httpx.get(server.url + "/props").json()["default_generation_settings"]["params"]
    assert {k: params[k] for k in given} == given and params["min_p"] == 0.0
    words = training_words()
    ask = dict(model="tiny", messages=[{"role": "user", "content": "What is a generator?"}], max_tokens=24)
    differs = []
    for seed in (1, 2, 3):
        left_out = client.chat.completions.create(**ask, seed=seed).choices[0].message.content
        sent = client.chat.completions.create(**ask, seed=seed, temperature=given["temperature"],
                                              top_p=given["top_p"], extra_body={"top_k": given["top_k"]})
        assert left_out == sent.choices[0].message.content
        assert len(left_out.split()) >= 5 and real_word_fraction(left_out, words) >= 0.8, left_out
        api = client.chat.completions.create(**ask, seed=seed, temperature=1.0, top_p=1.0, extra_body={"top_k": 0})
        differs.append(api.choices[0].message.content != left_out)
    assert any(differs)
    greedy = client.chat.completions.create(**ask, temperature=0).choices[0].message.content
    assert client.chat.completions.create(**ask, temperature=0, seed=9).choices[0].message.content == greedy


def test_generation_config_values_a_request_could_not_send_are_left_out():
    from strata.serve.openai_api import Limits, generation_defaults
    got, refused = generation_defaults({"temperature": "warm", "top_p": 0, "top_k": 20, "min_p": 0.05,
                                        "repetition_penalty": 1.05, "do_sample": True, "max_new_tokens": 9},
                                       Limits(vocab_size=6144))
    assert got == {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05}
    assert len(refused) == 2 and "temperature" in refused[0] and "top_p" in refused[1]
    assert generation_defaults({"top_k": 7000}, Limits(vocab_size=6144))[0] == {}
