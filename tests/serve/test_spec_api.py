"""Speculative decoding served: a real server over the demo engine with spec 4 and the MTP head reports drafts per
request (its log line and timings), per slot in /slots and /metrics, and totals in /metrics; its greedy reply is the
one spec off gives, whose /slots and log line name no drafts; the same on a layer split of three stages (seed 004's
users run --spec 4 --mtp --layer-split); --spec auto drafts where the model has a head and windows compile. The
engines' shapes are tests/sched/test_spec.py's (a session compiles them once: JAX's persistent cache), and windows
compile at first use: what the server reports is the subject here."""
from __future__ import annotations

import logging
import re

import httpx
import openai

from strata.engine import Engine
from strata.engine.runner import WindowRunner
from strata.sched.drafts import DraftPolicy
from strata.sched.scheduler import Scheduler

HI = [{"role": "user", "content": "Say hi."}]
SHAPE = dict(parallel=3, prefill=8, max_context=128)


def _scheduler(engine, drafts):
    runner = WindowRunner(engine, SHAPE["parallel"], SHAPE["prefill"])
    runner.warm_up = lambda: 0.0
    return Scheduler(runner, tokenizer=engine.tokenizer, eos_token_ids=engine.eos_token_ids,
                     max_context=SHAPE["max_context"], queue_limit=8, drafts=drafts)


def test_drafts_in_the_log_slots_and_metrics(serve, caplog):
    quiet = dict(max_context=SHAPE["max_context"], prefill=SHAPE["prefill"], say=lambda line: None)
    plain, spec = Engine.load("demo", **quiet), Engine.load("demo", spec=4, mtp=True, **quiet)
    split = Engine.load("demo", spec=4, mtp=True, layer_split="1,3", **quiet)
    replies, slots, texts = [], [], []
    with caplog.at_level(logging.INFO, logger="strata"):
        for engine, drafts in ((plain, None), (spec, DraftPolicy(4, adaptive=False)),
                               (split, DraftPolicy(4, adaptive=False))):
            with serve(engine, _scheduler(engine, drafts), **SHAPE) as s:
                client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)
                r = client.chat.completions.create(model="demo", messages=HI, max_tokens=12, temperature=0)
                replies.append(r.choices[0].message.content)
                slots.append(httpx.get(s.url + "/slots").json())
                texts.append(httpx.get(s.url + "/metrics").text)
    assert replies[0] == replies[1] == replies[2]
    for text in texts[1:]:
        assert float(re.search(r"^strata_drafts_verified_total (\S+)", text, re.M).group(1)) > 0
    assert re.search(r'^strata_stage_handoff_seconds_total\{device="cpu:2",layers="3-3",stage="2"\} ', texts[2], re.M)
    text = texts[1]
    assert r.model_extra["timings"]["drafts"] > 0
    assert not {"drafts", "drafts_accepted"} & set(slots[0][0]) and {"drafts", "drafts_accepted"} <= set(slots[1][0])
    assert float(re.search(r"^strata_drafts_verified_total (\S+)", text, re.M).group(1)) > 0
    assert re.search(r'^strata_drafts_accepted_total \S+', text, re.M)
    assert re.search(r'^strata_slot_draft_acceptance\{slot="0"\} \S+', text, re.M)
    lines = [m for m in caplog.messages if "prompt" in m and "tokens =" in m]
    assert len(lines) == 3 and "drafts accepted" not in lines[0]
    assert all(re.search(r"drafts accepted \d+ of [1-9]\d*", line) for line in lines[1:])


def test_spec_auto_drafts_where_the_model_has_a_head_and_the_windows_compile(serve, caplog):
    """--spec auto: the demo model (an MTP head, every expert on the device) drafts up to AUTO_DRAFTS tokens with the
    head, its greedy reply the plain one, and the server reports its drafts; with experts copied in layer by layer
    (no compiled windows) it is off, and the load log says why. A value that is neither auto nor 0-8 is refused."""
    import pytest

    from strata.config import AUTO_DRAFTS, ConfigError, Settings
    quiet = dict(max_context=SHAPE["max_context"], prefill=SHAPE["prefill"])
    said: list[str] = []
    auto = Engine.load("demo", spec="auto", say=said.append, **quiet)
    assert (auto.settings.sched.spec, auto.settings.sched.mtp, auto.mtp is not None) == (AUTO_DRAFTS, True, True)
    assert f"strata spec: auto: each slot drafts up to {AUTO_DRAFTS} tokens with the MTP head" in " ".join(said)
    plain = Engine.load("demo", say=lambda line: None, **quiet)
    replies, slots = [], []
    for engine in (plain, auto):
        with serve(engine, **SHAPE) as s:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)
            replies.append(client.chat.completions.create(model="demo", messages=HI, max_tokens=12, temperature=0))
            slots.append(httpx.get(s.url + "/slots").json())
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    assert replies[1].model_extra["timings"]["drafts"] > 0 and "drafts" in slots[1][0] and "drafts" not in slots[0][0]
    said.clear()
    off = Engine.load("demo", spec="auto", expert_cache=8, window_fetch=False, say=said.append, **quiet)
    assert (off.settings.sched.spec, off.mtp, "mtp" in off.params) == (0, None, False)
    assert any("strata spec: auto: off (decode windows are not compiled here" in line for line in said)
    with pytest.raises(ConfigError, match=r'spec = "fast" \(a string\) is not allowed; spec must be "auto" or an '
                                          r'integer in \[0, 8\]'):
        Settings.build(spec="fast")
