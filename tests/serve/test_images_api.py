"""Images through the API, with the official openai client against a real server over demo-flash (qwen4_exp with a
vision tower): image_url parts with data: URLs give the engine's own reply for the expanded prompt and images; a
follow-up turn with the same image reuses everything before its new text, a different image does not share past
the text before it; /v1/models and /props say the model takes images; every unusable image is a 400 naming its part;
a model whose tower is off says it takes none."""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
from PIL import Image as PILImage

from strata.engine import Engine
from strata.serve.images import expand, read_images, settings_for

SHAPE = dict(model="demo-flash", parallel=2, prefill=64, max_context=1024, max_image_pixels=200 * 200)


def data_url(rgb: np.ndarray, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    PILImage.fromarray(rgb).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def picture(seed: int, h: int = 48, w: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def user(text: str, *urls: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}]
            + [{"type": "image_url", "image_url": {"url": u}} for u in urls]}


@pytest.fixture(scope="module")
def flash():
    return Engine.load("demo-flash", max_context=SHAPE["max_context"], prefill=SHAPE["prefill"],
                       say=lambda line: None)


@pytest.fixture(scope="module")
def server(serve, flash):
    with serve(flash, **SHAPE) as s:
        yield s


def _client(s):
    return openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _engine_reply(engine, messages, max_tokens):
    """What the engine itself generates (greedy) for the chat: the rendered prompt, its image placeholders expanded."""
    tok = engine.tokenizer
    _, ids = tok.encode_chat(messages, add_generation_prompt=True)
    urls = [p["image_url"]["url"] for m in messages if isinstance(m["content"], list) for p in m["content"]
            if p["type"] == "image_url"]
    images = read_images([("x", u) for u in urls], settings_for(tok.source), SHAPE["max_image_pixels"])
    ids, _ = expand(list(ids), images, engine.images.vc)
    out = engine.generate(ids, max_tokens, images=images, stop_token_ids=())
    return tok.decode(out), len(ids)


def test_an_image_request_gives_the_engines_reply_and_the_next_turn_reuses_it(server, flash):
    client = _client(server)
    first = [user("What is in this picture?", data_url(picture(1)))]
    r = client.chat.completions.create(model="demo-flash", messages=first, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    want, n = _engine_reply(flash, first, 8)
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == n > 64     # an image read across parts
    # the next turn, the same image: everything before its new text comes from the prompt cache
    second = first + [{"role": "assistant", "content": r.choices[0].message.content},
                      user("And the colours?")]
    r2 = client.chat.completions.create(model="demo-flash", messages=second, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    want2, n2 = _engine_reply(flash, second, 8)
    assert r2.choices[0].message.content == want2 and r2.usage.prompt_tokens == n2
    assert r2.usage.prompt_tokens_details.cached_tokens >= n - 8
    # the same conversation with another image of the same size: nothing past the text before the image is shared
    other = [user("What is in this picture?", data_url(picture(2)))] + second[1:]
    r3 = client.chat.completions.create(model="demo-flash", messages=other, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r3.usage.prompt_tokens == n2 and r3.usage.prompt_tokens_details.cached_tokens < 64
    assert r3.choices[0].message.content == _engine_reply(flash, other, 8)[0]


def test_two_images_and_a_jpeg_stream_with_logprobs(server, flash):
    """(logprobs: the decode rows after the images sample from their logits, the shaped path)"""
    client = _client(server)
    messages = [user("Compare these.", data_url(picture(3)), data_url(picture(4, 80, 40), "JPEG"))]
    stream = client.chat.completions.create(model="demo-flash", messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, logprobs=True,
                                            top_logprobs=2, extra_body={"ignore_eos": True})
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    want, n = _engine_reply(flash, messages, 6)
    assert text == want and usage.prompt_tokens == n


def test_the_model_says_it_takes_images(server):
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert models[0]["modalities"] == ["text", "image"]
    assert httpx.get(server.url + "/props").json()["modalities"]["vision"] is True


@pytest.mark.parametrize("url, words", [
    ("https://example.com/cat.png", "not fetched"),
    ("data:image/png;base64,@@@@", "base64"),
    ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "not a PNG, JPEG or WebP"),
    ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", "image/gif"),
    (data_url(picture(5, 300, 300)), "90000"),
])
def test_an_image_that_cannot_be_used_is_a_400_naming_its_part(server, url, words):
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo-flash", messages=[user("Look.", data_url(picture(6)), url)],
                                       max_tokens=4)
    err = e.value.body
    assert err["param"] == "messages[0].content[2].image_url.url" and words in err["message"], err
    # and the server goes on serving
    r = client.chat.completions.create(model="demo-flash", messages=[user("Hi.")], max_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_a_server_whose_tower_is_off_takes_no_images(serve):
    engine = Engine.load("demo-flash", max_context=256, prefill=64, vision="off", say=lambda line: None)
    with serve(engine, **dict(SHAPE, max_context=256)) as s:
        with pytest.raises(openai.BadRequestError) as e:
            _client(s).chat.completions.create(model="demo-flash", messages=[user("Look.", data_url(picture(7)))],
                                               max_tokens=2)
        assert e.value.body["param"] == "messages[0].content[1].image_url.url"
        assert "takes no images" in e.value.body["message"]
        assert httpx.get(s.url + "/v1/models").json()["data"][0]["modalities"] == ["text"]


@pytest.mark.parametrize("paths", [dict(expert_cache=24), dict(expert_cache=24, window_fetch=False)])
def test_with_a_small_expert_cache_an_image_request_gives_the_resident_engines_reply(serve, flash, paths):
    """Most experts off the device: decode windows that fetch their misses, or every window layer by layer (the
    engine's own Sequence path too) give the all-resident engine's reply."""
    engine = Engine.load("demo-flash", max_context=SHAPE["max_context"], prefill=SHAPE["prefill"],
                         say=lambda line: None, **paths)
    messages = [user("What is in this picture?", data_url(picture(8)))]
    want, n = _engine_reply(flash, messages, 6)
    assert _engine_reply(engine, messages, 6) == (want, n)
    with serve(engine, **SHAPE) as s:
        r = _client(s).chat.completions.create(model="demo-flash", messages=messages, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == n
