"""Control vectors on the sycl backend: the same forward pass (strata/model/forward.py steer) with the rows' scales
as device arrays. A tiny random Qwen3-Next: the sequence path's logits equal the jax backend's at several scales, and
a runner window of three scales (a part per slot, then decode rows together) gives each row jax's greedy tokens."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from gguf_writer import write_control_vector
from oracle import build_hf_model
from strata import Engine
from strata.engine.runner import WindowRunner
from strata.plan import PromptPart, idle_plan

SCALES = (1.0, 0.0, -2.0)
PART = 16


@pytest.fixture(scope="module")
def engines(sycl_device, tmp_path_factory):
    pytest.importorskip("torch")
    tmp = tmp_path_factory.mktemp("cv_sycl")
    model = build_hf_model("qwen3_next", 1)
    model.save_pretrained(tmp / "model")
    rng = np.random.default_rng(1)
    H, L = model.config.hidden_size, model.config.num_hidden_layers
    cv = write_control_vector(tmp / "cv.gguf", {n: rng.standard_normal(H).astype(np.float32) for n in range(1, L)})
    kw = dict(max_context=256, prefill=PART, control_vector=f"{cv}:0.5")
    return (Engine.load(tmp / "model", **kw),
            Engine.load(tmp / "model", backend="sycl", device=sycl_device, **kw))


def test_logits_equal_the_jax_backends_at_each_scale(engines):
    jax_e, sycl_e = engines
    prompt = list(range(3, 43))
    for s in SCALES:
        ref = jax_e.logits(prompt, control_scale=s)
        got = sycl_e.logits(prompt, control_scale=s)
        assert np.abs(got - ref).max() <= 1e-4 * (ref.max() - ref.min()), s


def test_a_window_of_three_scales_gives_each_row_its_greedy_tokens(engines):
    jax_e, sycl_e = engines
    prompt = list(range(5, 30))
    want = [jax_e.generate(prompt, 6, stop_token_ids=[], control_scale=s) for s in SCALES]
    assert want[0] != want[1]
    n = len(SCALES)
    r = WindowRunner(sycl_e, n, PART)
    base = replace(idle_plan(n), control_scale=np.array(SCALES, np.float32))
    got = [[] for _ in range(n)]
    for i in range(n):
        for at in range(0, len(prompt), PART):
            res = r.run(replace(base, part=PromptPart(slot=i, tokens=np.asarray(prompt[at:at + PART], np.int32),
                                                      start=at, last=at + PART >= len(prompt))))
        got[i].append(res.part_next)
    for step in range(1, 6):
        res = r.run(replace(base, decode_active=np.ones(n, bool),
                            decode_tokens=np.array([g[-1] for g in got], np.int32),
                            decode_pos=np.full(n, len(prompt) + step - 1, np.int32), steps=np.full(n, step, np.int32)))
        for i in range(n):
            got[i].append(int(res.decode_next[i]))
    assert got == want
