"""Per-call arguments that rarely change stay on the device: DeviceArgs sends a value again only when it changed,
and a decode window's rows reach the runner's compiled function as one array (strata/engine/runner.py)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from lowerings import lowered
from strata import Engine
from strata.engine.core import DeviceArgs
from strata.engine.runner import WindowRunner
from strata.plan import idle_plan


class CountingOps:
    def __init__(self, eager: bool = False):
        self.sent = []
        self.eager = eager

    def to_device(self, x):
        self.sent.append(np.array(x))
        return ("device", len(self.sent))


def test_window_args_send_only_changed_values():
    ops = CountingOps()
    args = DeviceArgs(ops)
    t = np.array([0.0, 0.7], np.float32)
    first = args.get("temperature", t)
    assert args.get("temperature", t.copy()) is first and len(ops.sent) == 1      # equal value: the same copy
    t[1] = 0.8                                    # the caller's array changed in place: sent again
    second = args.get("temperature", t)
    assert second != first and len(ops.sent) == 2 and ops.sent[-1][1] == np.float32(0.8)
    args.get("temperature", t.astype(np.float64))                                  # another dtype: sent again
    args.get("top_k", np.array([0, 0], np.int32))                                  # names are separate
    assert len(ops.sent) == 4


def test_an_eager_backend_gets_its_host_arrays():
    """An eager backend reads some arguments on the host (SYCL's rows-mode kernels take a window's active mask
    there): DeviceArgs hands them over as they are and sends nothing."""
    ops = CountingOps(eager=True)
    active = np.array([1, 0, 1], np.int32)
    got = DeviceArgs(ops).get("active", active)
    assert isinstance(got, np.ndarray) and np.array_equal(got, active) and ops.sent == []


def test_warm_up_compiles_greedy_and_sampled_windows():
    """A window whose rows are all greedy compiles without the sampler's sort of the vocabulary (ops.sample's
    all_greedy), a static choice: the warm-up compiles both forms, so windows of either kind, and mixed ones,
    compile nothing under load."""
    engine = Engine.load("demo", max_context=256, prefill=16)
    runner = WindowRunner(engine, 3, 16)
    runner.warm_up()
    base = replace(idle_plan(3), decode_active=np.array([True, True, False]), decode_tokens=np.array([5, 6, 0],
                   np.int32), decode_pos=np.array([3, 4, 0], np.int32), seeds=np.array([[1, 0], [2, 0], [3, 0]],
                                                                                       np.uint32))
    with lowered() as compiled:
        for temperature in ([0.0, 0.0, 0.0], [0.0, 0.8, 0.0], [0.0, 0.0, 5.0]):   # greedy, mixed, an idle row hot
            res = runner.run(replace(base, temperature=np.array(temperature, np.float32)))
            assert res.decode_finite.all()
            base = replace(base, decode_tokens=res.decode_next, decode_pos=base.decode_pos + 1)
    assert compiled == [], f"{len(compiled)} functions were compiled under load, after warm-up"
    # an inactive row's temperature does not make a window sampled; the greedy and general forms' tokens for greedy
    # rows are one and the same (tests/test_sampling.py)
    from strata.engine.core import all_greedy
    assert all_greedy(np.array([0.0, 0.0, 5.0], np.float32), base.decode_active)
    assert not all_greedy(np.array([0.0, 0.8, 0.0], np.float32), base.decode_active)


def test_runner_decode_sends_sampling_settings_once_and_keeps_steady_rows_on_device():
    """The sampling settings go to the device once; in steady decoding (each row's token, position + 1, step + 1,
    as the scheduler plans it) the window's rows are the ones its predecessor computed on the device, so nothing is
    sent; a plan that departs from them sends them, and the tokens are the same either way."""
    engine = Engine.load("demo", max_context=128, prefill=16)
    runner = WindowRunner(engine, 2, 16)
    sent = []
    to_device = engine.backend.to_device
    engine.backend.to_device = lambda x: sent.append(x) or to_device(x)
    plan = replace(idle_plan(2), decode_active=np.array([True, False]), decode_tokens=np.array([5, 0], np.int32),
                   decode_pos=np.array([0, 0], np.int32))
    first = runner.run(plan)
    n_first = len(sent)
    steady = [first]
    for i in range(1, 4):
        plan = replace(plan, decode_tokens=np.where(plan.decode_active, steady[-1].decode_next, 0).astype(np.int32),
                       decode_pos=np.array([i, 0], np.int32), steps=np.array([i, 0], np.int32))
        steady.append(runner.run(plan))
    assert len(sent) == n_first, f"steady decoding sent {len(sent) - n_first} arrays"
    runner.run(replace(plan, decode_pos=np.array([4, 0], np.int32), steps=np.array([4, 0], np.int32),
                       decode_tokens=np.array([9, 0], np.int32), temperature=np.array([0.5, 0.0], np.float32)))
    assert len(sent) == n_first + 2, "a changed setting and departing rows are sent, once each"
    engine.backend.to_device = to_device
    assert first.decode_next.dtype.kind == "i" and first.decode_finite.dtype == bool
    assert all(r.decode_finite[0] for r in steady)
    # greedy tokens: the same as the engine API's, which sends its token each call
    seq = engine.sequence()
    sp = (np.array([0.0], np.float32), np.array([0], np.int32), np.array([1.0], np.float32),
          np.array([0.0], np.float32))
    want, tok = [], 5
    for step in range(4):
        tok = seq.decode(tok, sp, np.zeros(2, np.uint32), step)
        want.append(tok)
    assert [int(r.decode_next[0]) for r in steady] == want


def test_engine_decode_is_one_call_with_settings_sent_once():
    """Sequence.decode on a fused engine: one compiled call per token; the sampling settings and seed go to the
    device once, and the tokens equal the layer-by-layer composition's (read_part, then the sampler)."""
    engine = Engine.load("demo", max_context=128, prefill=16)
    sp = (np.array([0.0], np.float32), np.array([0], np.int32), np.array([1.0], np.float32),
          np.array([0.0], np.float32))
    seed = np.zeros(2, np.uint32)
    seq = engine.sequence()
    seq.read([3, 4, 5])
    sent = []
    to_device = engine.backend.to_device
    engine.backend.to_device = lambda x: sent.append(x) or to_device(x)
    got = [seq.decode(7, sp, seed, 1)]
    for step in range(2, 6):
        got.append(seq.decode(got[-1], sp, seed, step))
    engine.backend.to_device = to_device
    assert len(sent) == 5, f"{len(sent)} transfers of settings for 5 tokens (4 settings + the seed, once)"
    ref = engine.sequence()
    ref.read([3, 4, 5])
    want, tok = [], 7
    for step in range(1, 6):
        logits, ref.state = engine.read_part(ref.state, np.array([tok], np.int32), ref.pos, 1, False)
        tok = int(np.asarray(engine._sample(logits, *sp, seed, np.int32(step)))[0])
        ref.pos += 1
        want.append(tok)
    assert got == want
