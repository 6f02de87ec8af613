"""Control vectors in the runner's windows (demo model): rows of different scales in one window (decode rows and
prompt parts beside them) each get what they get alone and what Engine.generate gives at their scale, on every
window form: compiled decode rows and parts, verify windows with the MTP head over a layer split, and layer by layer
(a small expert cache). The oracle comparisons are tests/model/test_control_vector.py's."""
from __future__ import annotations

import json
from dataclasses import replace

import anyio
import numpy as np
import pytest

from gguf_writer import write_control_vector
from strata import Engine
from strata.builtin import builtin_dir
from strata.engine.runner import WindowRunner
from strata.plan import DEFAULT, PromptPart, idle_plan
from strata.sched.drafts import DraftPolicy
from strata.sched.request import Delta, Finished, Request
from strata.sched.scheduler import Scheduler

CTX, PART = 512, 16
SCALES = (1.0, 0.0, -2.5)
FORMS = {"compiled": {}, "spec4-split": dict(spec=4, mtp=True, layer_split="1,3"),
         "window-fetch": dict(expert_cache=16), "layer-by-layer": dict(expert_cache=16, window_fetch=False)}


@pytest.fixture(scope="module")
def vector(tmp_path_factory):
    cfg = json.loads((builtin_dir("demo") / "config.json").read_text())
    rng = np.random.default_rng(5)
    dirs = {n: rng.standard_normal(cfg["hidden_size"]).astype(np.float32) * 2
            for n in range(1, cfg["num_hidden_layers"])}
    return str(write_control_vector(tmp_path_factory.mktemp("cv") / "demo.gguf", dirs))


async def _collect(receive):
    text, final = "", None
    async with receive:
        async for ev in receive:
            if isinstance(ev, Delta):
                text += ev.content + ev.reasoning
            else:
                final = ev
    return text, final


def _serve(engine, requests, parallel) -> dict:
    """All requests at once (parts of PART beside the decoding rows, lookahead on) -> {id: (text, final)}."""
    runner = WindowRunner(engine, parallel, PART)
    runner.warm_up = lambda: 0.0
    spec = engine.settings.sched.spec
    sched = Scheduler(runner, tokenizer=engine.tokenizer, eos_token_ids=engine.eos_token_ids, max_context=CTX,
                      queue_limit=16, drafts=DraftPolicy(spec, adaptive=False) if spec else None)
    results = {}

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(sched.run)

            async def one(req):
                results[req.id] = await _collect(sched.submit(req))
            async with anyio.create_task_group() as inner:
                for r in requests:
                    inner.start_soon(one, r)
            tg.cancel_scope.cancel()
    anyio.run(main)
    if spec:
        assert sched.metrics()["windows_verifying"] > 0
    return results


@pytest.mark.parametrize("form", sorted(FORMS))
def test_rows_of_different_scales_in_one_window_equal_each_alone(vector, form):
    engine = Engine.load("demo", max_context=CTX, prefill=PART, control_vector=vector, say=lambda line: None,
                         **FORMS[form])
    if form == "layer-by-layer":
        assert type(WindowRunner(engine, 1, PART).rows).__name__ == "HostRows"
    tok = engine.tokenizer
    prompt = tuple(tok.encode(tok.apply_chat_template([{"role": "user", "content": "the heron waits by the mill pond. "
                                                                                   * 6}])))
    reqs = [Request(id=f"s{s}", prompt_ids=prompt[:len(prompt) - 3 * i], max_tokens=12, stop_token_ids=(),
                    control_scale=s, cache_key=(("control_vector_scale", s),)) for i, s in enumerate(SCALES)]
    together = _serve(engine, reqs, len(reqs))
    for r in reqs:
        alone = _serve(engine, [r], len(reqs))[r.id]
        want = tok.decode(engine.generate(list(r.prompt_ids), r.max_tokens, stop_token_ids=[],
                                          control_scale=r.control_scale), skip_special_tokens=True)
        assert isinstance(together[r.id][1], Finished) and together[r.id][1].completion_tokens == r.max_tokens
        assert together[r.id][0] == alone[0] == want, (form, r.control_scale)
    same = engine.generate(list(prompt), 12, stop_token_ids=[], control_scale=0.0)
    assert engine.generate(list(prompt), 12, stop_token_ids=[]) != same       # the vector changes the tokens


def test_the_guards_numerics_paths_take_each_rows_scale(vector):
    """Windows run by hand on each numerics path a guard's retry may take (every slot on it; a bfloat16 engine, so
    the float32 path is offered): a part per slot, then decode rows of the three scales together -> what each row
    gets alone on that path; on the default path, Engine.generate's tokens at each scale."""
    engine = Engine.load("demo", max_context=CTX, prefill=PART, control_vector=vector, say=lambda line: None,
                         dtype="bfloat16", guard_ladder="float32,cpu_experts", expert_cache=32)
    prompt = engine.tokenizer.encode("the heron waits by the mill pond, " * 3)
    runner = WindowRunner(engine, len(SCALES), PART)
    assert runner.numerics == ("float32", "cpu_experts")
    n = len(SCALES)

    def run(path, rows):
        """Greedy tokens of the slots `rows` (each its prompt, then 7 decode windows of those rows together)."""
        base = replace(idle_plan(n), control_scale=np.array(SCALES, np.float32),
                       numerics=None if path == DEFAULT else (path,) * n)
        got = {i: [] for i in rows}
        for i in rows:
            for at in range(0, len(prompt), PART):
                chunk = np.asarray(prompt[at:at + PART], np.int32)
                res = runner.run(replace(base, part=PromptPart(slot=i, tokens=chunk, start=at,
                                                               last=at + PART >= len(prompt))))
            got[i].append(res.part_next)
        on = np.isin(np.arange(n), rows)
        for step in range(1, 8):
            res = runner.run(replace(base, decode_active=on,
                                     decode_tokens=np.array([got[i][-1] if i in got else 0 for i in range(n)],
                                                            np.int32),
                                     decode_pos=np.full(n, len(prompt) + step - 1, np.int32),
                                     steps=np.full(n, step, np.int32)))
            for i in rows:
                got[i].append(int(res.decode_next[i]))
        return [got[i] for i in rows]
    want = [engine.generate(prompt, 8, stop_token_ids=[], control_scale=s) for s in SCALES]
    for path in (DEFAULT, *runner.numerics):
        together = run(path, list(range(n)))
        assert together == [run(path, [i])[0] for i in range(n)], path
        assert together[0] != together[1], path                  # scale 1 and 0 differ
        if path == DEFAULT:
            assert together == want
