"""Control vectors over HTTP with the official openai client (the tiny model, a server started with
--control-vector): control_vector_scale per request (on and off differ, each deterministic, alone or beside the
other), the default equal to scale 1, /props naming the files, and bad scales (or a scale with no vector loaded) a
400 naming the field."""
from __future__ import annotations

import json

import numpy as np
import openai
import pytest
from gguf_writer import write_control_vector
from servers import alone_then_together

from strata.builtin import builtin_dir

ASK = [{"role": "user", "content": "What does the if statement do?"}]


@pytest.fixture(scope="module")
def vector(tmp_path_factory):
    cfg = json.loads((builtin_dir("tiny") / "config.json").read_text())
    rng = np.random.default_rng(3)
    dirs = {n: rng.standard_normal(cfg["hidden_size"]).astype(np.float32) for n in range(1, cfg["num_hidden_layers"])}
    return str(write_control_vector(tmp_path_factory.mktemp("cv") / "tiny.gguf", dirs))


@pytest.fixture(scope="module")
def tiny_engine():
    from strata.engine import Engine
    return Engine.load("tiny", max_context=1024)


@pytest.fixture(scope="module")
def server(vector, serve):
    from strata.engine import Engine
    engine = Engine.load("tiny", max_context=1024, control_vector=f"{vector}:4")
    with serve(engine, model="tiny", parallel=2, prefill=64, max_context=1024, control_vector=f"{vector}:4") as s:
        yield s


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_per_request_scales_on_and_off_differ_and_each_is_deterministic(server):
    client = _client(server)

    def ask(scale):
        extra = {} if scale is None else {"extra_body": {"control_vector_scale": scale}}
        r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=24, temperature=0, **extra)
        return r.choices[0].message.content
    alone, together = alone_then_together(ask, [1.0, 0.0, 1.0, 0.0, None], timeout=300)
    on, off = alone[0], alone[1]
    assert on != off
    assert alone == together == [on, off, on, off, on]
    text = client.completions.create(model="tiny", prompt="The if statement", max_tokens=12, temperature=0,
                                     extra_body={"control_vector_scale": -1.5}).choices[0].text
    assert text == client.completions.create(model="tiny", prompt="The if statement", max_tokens=12, temperature=0,
                                             extra_body={"control_vector_scale": -1.5}).choices[0].text


def test_scale_zero_answers_what_a_server_without_the_vector_answers(server, tiny_engine, serve):
    body = dict(model="tiny", messages=ASK, max_tokens=24, temperature=0)
    with server.client() as c:
        off = c.post("/v1/chat/completions", json={**body, "control_vector_scale": 0}).json()
    with serve(tiny_engine, model="tiny", parallel=2, prefill=64, max_context=1024) as plain, plain.client() as c:
        assert c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] == \
            off["choices"][0]["message"]["content"]
        r = c.post("/v1/chat/completions", json={**body, "control_vector_scale": 1})
        assert r.status_code == 400
        assert "control_vector_scale scales the server's control vector, and this server loaded none" in \
            r.json()["error"]["message"]
        assert "control_vector" not in c.get("/props").json()


def test_props_names_the_vector(server, vector):
    with server.client() as c:
        assert c.get("/props").json()["control_vector"] == {"files": [{"path": vector, "scale": 4.0}],
                                                            "default_scale": 1.0}


@pytest.mark.parametrize("value, message", [
    ("high", "control_vector_scale must be a number, got string"),
    (1000, "control_vector_scale must be in [-100, 100] (1 = as loaded, 0 = off), got 1000"),
    (True, "control_vector_scale must be a number, got boolean"),
])
def test_a_bad_scale_is_a_400_naming_it(server, value, message):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK, "max_tokens": 4,
                                                  "control_vector_scale": value})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "control_vector_scale"
