"""bench/prompt_probe.py's premise, on the CPU: the forward pass's parts (ops.scope) reach XLA's optimized HLO, and the
probe's parser charges the instructions of a prompt part's compiled call to every part of the layer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"
sys.path.insert(0, "bench")
from prompt_probe import hlo_scopes
from strata.engine import Engine
seq = Engine.load("demo", max_context=128, prefill=32).sequence()
seq.read(list(range(20)))
print(json.dumps(sorted(set(hlo_scopes({dump!r})["by_module"].values()))))
"""


def test_the_forward_pass_names_its_parts_in_the_optimized_hlo(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(dump=str(tmp_path))], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    scopes = set(json.loads(out.stdout.strip().splitlines()[-1]))
    # the demo is a Qwen3-Next: delta-rule and attention layers, routed and shared experts
    assert {"delta_proj", "delta_rule", "delta_out", "attn_proj", "attn", "attn_out", "router", "routed_experts",
            "shared_expert", "head"} <= scopes, scopes


def test_the_timeline_charges_each_idle_gap_to_the_kernel_after_it():
    """The probe's stream timeline on hand-made trace events (a unit's own test): three kernels of the main module
    with an eager op between them; an overlapping kernel does not open a gap, and the copy lane is not the compute
    stream."""
    sys.path.insert(0, str(ROOT / "bench"))
    from prompt_probe import timeline
    lane, copies = "/device:GPU:0 / Stream #14(Compute)", "/device:GPU:0 / Stream #15(MemcpyH2D)"

    def kernel(name, ts, dur, module="jit_read", thread=lane):
        return {"thread": thread, "name": name, "ts": ts, "dur": dur, "args": {"hlo_module": module}}
    events = [kernel("gemm_a", 0.0, 100.0), kernel("fusion_b", 90.0, 20.0),        # overlaps: no gap
              kernel("wrapped_broadcast", 160.0, 5.0, module="jit_broadcast_in_dim"),    # 50 us after fusion_b
              kernel("gemm_c", 400.0, 100.0),                                            # 235 us after the broadcast
              kernel("MemcpyH2D", 50.0, 1000.0, thread=copies),
              {"thread": "host / python", "name": "dispatch", "ts": 0.0, "dur": 900.0, "args": {}}]
    t = timeline(events)
    assert t["lane"] == lane
    assert t["span_ms"] == 0.5 and t["idle_ms"] == 0.285 and t["busy_ms"] == 0.215
    assert (t["gaps_over_20us"], t["gaps_over_100us"]) == (2, 1)
    assert t["idle_by_module"] == [["jit_read", 0.235], ["jit_broadcast_in_dim", 0.05]]
    assert t["longest_gaps"][0] == [235.0, "wrapped_broadcast", "gemm_c", "jit_read"]
    assert t["modules"][0] == ["jit_read", 3, 0.22]
    assert timeline([events[-1]]) == {}                     # no GPU stream (a CPU run): nothing to say
