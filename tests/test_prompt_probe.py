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
