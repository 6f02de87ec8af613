"""The numerics guard's float32 rung on a bfloat16 engine on the CPU. The model is the demo's shape with every layer
an attention layer and every weight rounded to bfloat16, so an engine loaded as float32 holds exactly the weights the
bfloat16 one does; the bfloat16 engine keeps a float32 KV cache (kv = "float32"), so a slot's state is float32 too.
The rung's prompt-part and decode rows then equal the float32 engine's within float32 rounding (the default path's
bfloat16 activations are ~1e-2 off), on one stage and on a layer split; a float32 engine leaves the rung out and
says why; a deterministic non-finite row retried on float32 follows the ladder (default, then float32) to the guard's
explicit error (the scheduler's side of the ladder is tested against a FakeExecutor in test_guard.py)."""
from __future__ import annotations

import json
import logging
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from strata import Engine
from strata.config import Settings
from strata.demo import DEMO_CONFIG, demo_tensors
from strata.demo_tokenizer import write_demo_tokenizer
from strata.engine.runner import WindowRunner
from strata.plan import DEFAULT, PromptPart, idle_plan
from strata.sched.guard import Attempt, GiveUp, Guard

SHAPE = dict(max_context=64, prefill=16, parallel=2)
FAULT_AT = (1, 40)                         # layer 1's output at position 40
TOP = 20                                   # logprobs compared per row


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16") / "model"
    out.mkdir()
    cfg = dict(DEMO_CONFIG, vocab_size=write_demo_tokenizer(out), layer_types=["full_attention"] * 4)
    tensors = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in demo_tensors(cfg, seed=5).items()}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def wide(model):
    return Engine.load(model, dtype="float32", **SHAPE)


def narrow_runner(model, **kw):
    """The bfloat16 engine (a float32 KV cache), with the deterministic fault FAULT_AT on every path."""
    settings = Settings.build(allow_faults=True, model=str(model), dtype="bfloat16", kv="float32",
                              fault_nonfinite=FAULT_AT, **SHAPE, **kw)
    return WindowRunner(Engine.load(model, settings=settings), 2, 16)


@pytest.fixture(scope="module")
def narrow(model):
    return narrow_runner(model)


def log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def test_a_float32_engine_leaves_the_rung_out_and_says_why(wide, caplog):
    with caplog.at_level(logging.INFO, "strata"):
        r = WindowRunner(wide, 2, 16)
    assert "float32" not in r.numerics and r.numerics == ("cpu_experts",)
    assert any("float32 (the engine computes in float32 already)" in m for m in caplog.messages), caplog.messages


@pytest.mark.parametrize("split", [None, "2"], ids=["one_stage", "split"])
def test_the_float32_rung_computes_a_float32_engines_rows(model, narrow, wide, split):
    """A prompt part and three decode rows of slot 0 on the rung (slot 1 idle), before the fault's position: each
    sampled token is the float32 engine's argmax after the same tokens (so its greedy output), and each row's top
    logprobs that engine's log-softmax within float32 rounding; the same on a layer split (two CPU devices: the
    first stage widens the embedding, the float32 rows cross the hand-off)."""
    r = narrow if split is None else narrow_runner(model, layer_split=split)
    assert len(r.engine.stages) == (1 if split is None else 2)
    assert r.numerics == ("float32", "cpu_experts")
    prompt = np.array(wide.tokenizer.encode("the heron waits by the mill pond"), np.int32)
    n = len(prompt)
    assert n <= 16 and n + 3 < FAULT_AT[1]
    on = ("float32", DEFAULT)
    lp = np.full(2, TOP, np.int32)
    r.repair((0,))
    res = r.run(replace(idle_plan(2), part=PromptPart(slot=0, tokens=prompt, start=0, last=True), numerics=on,
                        logprobs=lp))
    assert res.part_finite
    got, rows = [res.part_next], [res.part_logprobs]
    for i in range(3):
        res = r.run(replace(idle_plan(2), decode_active=np.array([True, False]), numerics=on, logprobs=lp,
                            decode_tokens=np.array([got[-1], 0], np.int32), decode_pos=np.array([n + i, 0], np.int32)))
        assert res.decode_finite[0]
        got.append(int(res.decode_next[0]))
        rows.append(res.decode_logprobs)
    ref = wide.logits(np.concatenate([prompt, got[:3]]))
    for i, row in enumerate(rows):
        exact = log_softmax(ref[n - 1 + i])
        assert got[i] == int(np.argmax(exact))
        assert row.top_ids[0].tolist() == np.argsort(-exact, kind="stable")[:TOP].tolist()
        np.testing.assert_allclose(row.top[0], exact[row.top_ids[0]], rtol=0, atol=1e-5)


def test_a_deterministic_fault_retried_on_float32_follows_the_ladder(narrow):
    """The fault is on every path: a prompt read in parts goes non-finite in the part holding the fault's position,
    the guard retries it on float32 (the first rung offered: reference_ops is left out on a CPU), where it goes
    non-finite there again (the parts before it finite), and the guard gives up naming both attempts."""
    r, guard = narrow, Guard(narrow.numerics)
    prompt = np.arange(100, 148, dtype=np.int32)                  # parts 0..15, 16..31, 32..47 (the fault's)
    attempts, numerics = (), DEFAULT
    while True:
        r.repair((0,))                                            # the scheduler's repair before each attempt
        for start in range(0, len(prompt), 16):
            part = PromptPart(slot=0, tokens=prompt[start:start + 16], start=start, last=start + 16 == len(prompt))
            res = r.run(replace(idle_plan(2), part=part, numerics=(numerics, DEFAULT)))
            if not res.part_finite:
                break
        assert start == 32
        attempts += (Attempt(numerics, start, start + 15),)
        d = guard.failed("L", attempts, now=0.0)
        if isinstance(d, GiveUp):
            break
        numerics = d.numerics
    assert [a.numerics for a in d.attempts] == [DEFAULT, "float32"] and d.position == 47
    assert d.why == "again at the same position"
