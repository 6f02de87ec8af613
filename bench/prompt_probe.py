"""Where a prompt part's and a decode window's device time goes, by part of the layer, against each part's floor.

    python bench/prompt_probe.py --out OUT.json          # GPU: real shapes, int4 experts, 4 layers (3 linear + 1 full)
    python bench/prompt_probe.py --smoke                 # the same on a CPU in a minute (tiny shapes)

The forward pass names its parts (forward.py: `with ops.scope(...)`, jax.named_scope here), XLA keeps the names in
each optimized instruction's op_name, and the profiler's GPU kernel events name their instruction (args hlo_op,
hlo_module). So every kernel of one traced call is charged to a scope: delta_proj, delta_rule, delta_out, attn_proj,
attn, attn_out, router, routed_experts, shared_expert, head (or "other"). Per scope: the kernels' total time, their
count, the busiest kernels, and the floor of that scope's work at these shapes: max(FLOPs / bf16 rate, bytes / HBM
rate) with the rates of ../shared/notes/pallas-gpu.md. Cases: one prompt part of --prompt tokens at position 0, and
decode windows of 1 and 4 rows at --context through the WindowRunner (the server's path); with --verify K, instead of
the prompt part, verify windows of K drafts + 1 per row (the MTP head's work charged to "mtp"; floors not counted).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402

SCOPES = ("delta_proj", "delta_rule", "delta_out", "attn_proj", "attn", "attn_out", "mlp", "router",
          "routed_experts", "shared_expert", "head", "mtp")
HBM = 3.6e12        # bytes/s, read + write (measured on the H200)
BF16 = 790e12       # FLOP/s, dense bf16 (the H200's rate used by kernel_speed)


def hlo_scopes(dump_dir: str) -> dict:
    """XLA's optimized HLO text under dump_dir -> {(module, instruction): scope} and {instruction: scope} (the
    latter for events that name no module; a name in several modules keeps the first scope seen). An instruction
    without an op_name (XLA drops it on some fusions) takes the commonest scope of the computation it calls."""
    by_module, by_name, by_kernel = {}, {}, {}
    header = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
    inst = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
    op_name = re.compile(r"metadata=\{op_name=\"([^\"]*)\"")
    calls = re.compile(r"calls=%?([\w.\-]+)")

    def scope_of(name: str) -> str:
        parts = name.split("/")
        if "mtp" in parts:                   # the MTP head's layer is charged to the head as a whole
            return "mtp"
        return next((p for p in reversed(parts) if p in SCOPES), "other")
    for path in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")):
        module, comp = None, None
        votes: dict = {}                 # computation -> {scope: count}
        lines = []                       # (instruction, scope or None, called computation or None)
        with open(path) as f:
            for line in f:
                if module is None and line.startswith("HloModule "):
                    module = line.split()[1].rstrip(",")
                    continue
                m = inst.match(line)
                if not m:
                    h = header.match(line)
                    if h:
                        comp = h.group(1)
                    continue
                o, c = op_name.search(line), calls.search(line)
                scope = scope_of(o.group(1)) if o else None
                if scope is not None:
                    v = votes.setdefault(comp, {})
                    v[scope] = v.get(scope, 0) + 1
                lines.append((m.group(1), scope, c.group(1) if c else None))
        for name, scope, called in lines:
            if scope is None and called in votes:
                v = votes[called]
                named = {k: n for k, n in v.items() if k != "other"} or v
                scope = max(named, key=named.get)
            scope = scope or "other"
            by_module[(module, name)] = scope
            by_name.setdefault(name, scope)
            by_kernel.setdefault(name.replace(".", "_"), scope)    # a fusion's kernel: its name, "." -> "_"
    return {"by_module": by_module, "by_name": by_name, "by_kernel": by_kernel}


def _module_name(name: str) -> str:
    return name[:-len("." + name.rsplit(".", 1)[-1])] if re.search(r"\.\d+$", name) else name


def _stream_events(events: list) -> list:
    """The trace's events on GPU streams (kernels and copies); none on a CPU."""
    return [e for e in events if "GPU" in e["thread"].split(" / ")[0] and "Stream" in e["thread"]]


def charge(events: list, scopes: dict) -> dict:
    """GPU kernel events -> {scope: {ms, kernels, top: [[name, count, ms]]}} and what could not be matched."""
    gpu = _stream_events(events)
    if not gpu:      # a CPU (the smoke run): XLA's thunks, on the host threads that ran them
        gpu = [e for e in events if "hlo_op" in e["args"]]
    out: dict = {}
    lanes = sorted({e["thread"] for e in gpu})
    unmatched = {}
    for e in gpu:
        a = e["args"]
        op = a.get("hlo_op") or a.get("long_name") or ""
        module = a.get("hlo_module", "")
        scope = scopes["by_module"].get((module, op)) or scopes["by_module"].get((_module_name(module), op)) \
            or scopes["by_name"].get(op) or scopes["by_name"].get(e["name"]) \
            or scopes["by_kernel"].get(e["name"])
        if scope is None:
            scope = "unmatched"
            unmatched[e["name"][:60]] = unmatched.get(e["name"][:60], 0) + e["dur"] / 1000
        s = out.setdefault(scope, {"ms": 0.0, "kernels": 0, "names": {}})
        s["ms"] += e["dur"] / 1000
        s["kernels"] += 1
        n = s["names"].setdefault(e["name"][:60], [0, 0.0])
        n[0] += 1
        n[1] += e["dur"] / 1000
    for s in out.values():
        s["top"] = [[k, c, round(ms, 4)] for k, (c, ms) in sorted(s.pop("names").items(), key=lambda kv: -kv[1][1])[:6]]
        s["ms"] = round(s["ms"], 4)
    busy = sum(e["dur"] for e in gpu) / 1000
    sample = [{"name": e["name"][:60], "args": {k: str(v)[:80] for k, v in e["args"].items()}} for e in gpu[:3]]
    return {"scopes": out, "kernel_ms": round(busy, 4), "lanes": lanes,
            "unmatched": dict(sorted(unmatched.items(), key=lambda kv: -kv[1])[:10]), "sample_events": sample}


def timeline(events: list, top: int = 10) -> dict:
    """Where the compute stream waited during one traced call: its kernels in time order, the span from the first
    kernel's start to the last one's end, the busy time (their union) and the idle gaps between them. Idle time is
    charged to the kernel after each gap and to that kernel's XLA module (a module other than the prompt's or the
    window's own is an eager op run outside the compiled call: the host dispatched it, and the device waited);
    kernels per module show those calls. -> {span_ms, busy_ms, idle_ms, gaps over 20 / 100 us, idle by module and by
    next kernel, the longest gaps with their neighbours, kernels and ms per module}."""
    gpu = _stream_events(events)
    if not gpu:
        return {}
    lanes: dict = {}
    for e in gpu:
        lanes.setdefault(e["thread"], []).append(e)
    lane = sorted(max(lanes.values(), key=len), key=lambda e: e["ts"])    # the compute stream: the most events
    module = lambda e: e["args"].get("hlo_module", "?")                   # noqa: E731
    idle_by_module: dict = {}
    idle_by_next: dict = {}
    gaps = []
    end, prev = lane[0]["ts"], None
    for e in lane:
        gap = e["ts"] - end
        if gap > 0 and prev is not None:
            gaps.append((gap, prev["name"][:50], e["name"][:50], module(e)))
            idle_by_module[module(e)] = idle_by_module.get(module(e), 0.0) + gap
            idle_by_next[e["name"][:50]] = idle_by_next.get(e["name"][:50], 0.0) + gap
        if e["ts"] + e["dur"] >= end:
            end, prev = e["ts"] + e["dur"], e
    per_module: dict = {}
    for e in lane:
        m = per_module.setdefault(module(e), [0, 0.0])
        m[0] += 1
        m[1] += e["dur"]
    span = end - lane[0]["ts"]
    idle = sum(g for g, *_ in gaps)
    ranked = lambda d: [[k, round(v / 1000, 4)] for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]  # noqa
    return {"lane": lane[0]["thread"], "span_ms": round(span / 1000, 4), "busy_ms": round((span - idle) / 1000, 4),
            "idle_ms": round(idle / 1000, 4), "gaps_over_20us": sum(g > 20 for g, *_ in gaps),
            "gaps_over_100us": sum(g > 100 for g, *_ in gaps), "idle_by_module": ranked(idle_by_module),
            "idle_by_next_kernel": ranked(idle_by_next),
            "longest_gaps": [[round(g, 1), a, b, m] for g, a, b, m in sorted(gaps, reverse=True)[:top]],
            "modules": [[k, c, round(us / 1000, 4)] for k, (c, us) in
                        sorted(per_module.items(), key=lambda kv: -kv[1][1])[:top]]}


def floors(cfg, tokens: int, context: int, expert_bytes: int, *, prompt: bool) -> dict:
    """Per scope, summed over the probe model's layers: (FLOPs, bytes) of the work at these shapes, and the floor
    in ms. tokens: rows of the call (prompt: a part's tokens, causal from position 0; else a decode window's rows,
    each at `context`)."""
    from strata.model.config import LINEAR
    h, bf = cfg.hidden_size, 2
    n_lin = sum(1 for k in cfg.layer_types if k == LINEAR)
    n_full = len(cfg.layer_types) - n_lin
    hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lin_in = 2 * hk * dk + hv * dv + hv * dv + 2 * hv        # qkv, z, b, a
    full_in = hq * hd * 2 + 2 * hkv * hd                     # q, gate, k, v
    t = tokens

    def dense(n_out, n_in, layers):
        return (2 * t * n_in * n_out * layers, (n_in * n_out * bf + t * (n_in + n_out) * bf) * layers)

    f = {"delta_proj": dense(lin_in, h, n_lin), "delta_out": dense(h, hv * dv, n_lin),
         "attn_proj": dense(full_in, h, n_full), "attn_out": dense(h, hq * hd, n_full),
         "router": dense(cfg.num_experts, h, n_lin + n_full)}
    c = 64                                                   # the chunk of the chunked rule
    state = hv * dk * dv * 4
    if prompt:   # chunked: per token and head ~2 (2 C dk + C (dk + dv) + 3 dk dv + C dv) FLOPs; q, k, v, o in fp32
        f["delta_rule"] = (2 * t * hv * (2 * c * dk + c * (dk + dv) + 3 * dk * dv + c * dv) * n_lin,
                           (t * hv * (2 * dk + 2 * dv) * 4 + 2 * state) * n_lin)
        f["attn"] = (2 * 2 * (t * t / 2) * hq * hd * n_full, (t * hq * hd * 2 * bf + 2 * t * hkv * hd) * n_full)
    else:        # recurrent: the state read and written per row; attention reads each row's int8 keys and values
        f["delta_rule"] = (6 * t * hv * dk * dv * n_lin, 2 * state * t * n_lin)
        f["attn"] = (2 * 2 * t * context * hq * hd * n_full, t * context * 2 * hkv * (hd + 4) * n_full)
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    distinct = e * (1 - (1 - k / e) ** t)                    # experts a window of t rows touches (uniform routing)
    inter = cfg.moe_intermediate_size
    f["routed_experts"] = (2 * t * k * 3 * h * inter * (n_lin + n_full), distinct * expert_bytes * (n_lin + n_full))
    sh = cfg.shared_expert_intermediate_size
    f["shared_expert"] = (2 * t * 3 * h * sh * (n_lin + n_full), (3 * h * sh * bf + t * h * 4 * bf) * (n_lin + n_full))
    head_rows = 1 if prompt else t
    f["head"] = (2 * head_rows * h * cfg.vocab_size, h * cfg.vocab_size * bf)
    return {s: {"flops": float(fl), "bytes": float(by), "floor_ms": 1000 * max(fl / BF16, by / HBM)}
            for s, (fl, by) in f.items()}


def report(name: str, wall_ms: float, charged: dict, floor: dict, waits: dict | None = None) -> dict:
    sc = charged["scopes"]
    total_floor = sum(v["floor_ms"] for v in floor.values())
    print(f"\n{name}: {wall_ms:.3f} ms per call, kernels {charged['kernel_ms']:.3f} ms, floor {total_floor:.3f} ms")
    print("| scope | ms | kernels | floor ms | floor / ms | busiest kernel |")
    print("|---|---|---|---|---|---|")
    for s in sorted(sc, key=lambda s: -sc[s]["ms"]):
        fl = floor.get(s, {}).get("floor_ms")
        ms = sc[s]["ms"]
        top = sc[s]["top"][0] if sc[s]["top"] else ["", 0, 0]
        fl_text, frac = ("", "") if fl is None else (f"{fl:.3f}", f"{fl / max(ms, 1e-9):.0%}")
        print(f"| {s} | {ms:.3f} | {sc[s]['kernels']} | {fl_text} | {frac} | {top[0][:40]} ({top[1]}x, "
              f"{top[2]:.3f} ms) |")
    if charged["unmatched"]:
        print(f"unmatched kernels: {charged['unmatched']}")
    if waits:
        print(f"stream: span {waits['span_ms']:.3f} ms, busy {waits['busy_ms']:.3f}, idle {waits['idle_ms']:.3f} in "
              f"{waits['gaps_over_20us']} gaps over 20 us ({waits['gaps_over_100us']} over 100 us); idle before "
              f"module: {waits['idle_by_module'][:4]}; longest: {waits['longest_gaps'][:4]}; kernels by module: "
              f"{waits['modules'][:4]}")
    return {"wall_ms": wall_ms, **charged, "floors": floor, "floor_ms": total_floor, "stream": waits or {}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--kernels", default="auto", choices=("auto", "xla", "pallas"))
    ap.add_argument("--command-buffers", action="store_true", help="keep XLA's command buffers (CUDA graphs) on")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--verify", type=int, default=0, help="K: verify windows of K drafts + 1 instead of a prompt part")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dump = tempfile.mkdtemp(prefix="strata_hlo_")
    # XLA reads its flags once, at the first compilation: set before jax is imported. Inside a command buffer (a CUDA
    # graph) a kernel's event names the buffer, not its instruction, so they are off unless asked for: a kernel's
    # device time is the same either way, the wall time per call is not (see dispatch_probe for that)
    flags = f" --xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"
    if not args.command_buffers:
        flags += " --xla_gpu_enable_command_buffer="
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + flags).strip()
    import jax
    import ml_dtypes

    from engine_speed import timed
    from strata.demo import QWEN3_NEXT_80B
    from strata.jax_backend.random_weights import RandomDeviceReader
    from strata.backend import get_backend
    from strata.config import Settings
    from strata.engine import Engine
    from strata.model.config import ModelConfig
    from strata.model.params import params_from_reader
    from strata.experts.synthetic import SyntheticStore
    from trace_summary import traced_events
    over = {"num_experts": 16, "vocab_size": 4096} if args.smoke else {}
    if args.smoke:
        args.prompt, args.context = min(args.prompt, 256), min(args.context, 256)
    cfg = ModelConfig.from_hf(dict(QWEN3_NEXT_80B, num_hidden_layers=args.layers, **over), source="prompt probe")
    batches = [int(b) for b in args.batches.split(",") if b]
    if args.verify:
        from spec_speed import offer_drafts, real_engine
        engine = real_engine(args.layers, args.verify, args.context, "int4", args.smoke)
        backend = engine.backend
        store_bytes = engine.mtp[0].layout.nbytes
    else:
        backend = get_backend("jax", kernels=args.kernels)
        params = params_from_reader(cfg, RandomDeviceReader(ml_dtypes.bfloat16))
        engine = Engine(cfg, params, backend, Settings.build(
            dtype="bfloat16", max_context=max(args.prompt, args.context) + 64, prefill=args.prompt,
            parallel=max(batches + [1]), kernels=args.kernels))
        n_moe = sum(cfg.is_sparse_layer(i) for i in range(args.layers))
        store = SyntheticStore("int4", cfg.hidden_size, cfg.moe_intermediate_size, n_moe, cfg.num_experts)
        engine.attach_experts(store, say=lambda line: None)
        store_bytes = store.layout.nbytes
    result = {"bench": "prompt_probe", **results_file.stamp(), "layers": args.layers, "prompt": args.prompt,
              "context": args.context, "kernels": args.kernels, "pallas_ops": sorted(backend.pallas_ops),
              "device": str(jax.devices()[0]), "hbm_bytes_per_s": HBM, "bf16_flops": BF16, "verify": args.verify,
              "cases": {}}
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt).tolist()
    cases = []       # (key, title, wall ms, events, floors) per case; charged once every case has compiled (dumped)
    if not args.verify:
        def read():
            seq = engine.sequence()
            seq.read(ids, part_size=args.prompt)
            return seq
        read()
        wall = 1000 * timed(read, 3)
        events = traced_events(read)
        if isinstance(events, dict):
            print(f"trace: {events['error']}")
            return 1
        cases.append(("prompt", f"prompt part of {args.prompt} tokens, {args.layers} layers", wall, events,
                      floors(cfg, args.prompt, 0, store_bytes, prompt=True)))
    from dataclasses import replace

    from strata.engine.runner import WindowRunner
    from strata.plan import idle_plan
    for b in batches:
        runner = WindowRunner(engine, b, 16)
        plan = replace(idle_plan(b), decode_active=np.ones(b, bool), decode_pos=np.full(b, args.context, np.int32),
                       decode_tokens=np.arange(b, dtype=np.int32))
        window = lambda: runner.run(plan)            # noqa: E731 - the same position each time: timing only
        window()
        t = time.perf_counter()
        for _ in range(16):
            window()
        wall = 1000 * (time.perf_counter() - t) / 16
        cases.append((f"decode_b{b}", f"decode window of {b} rows at {args.context}", wall, traced_events(window),
                      floors(cfg, b, args.context, store_bytes, prompt=False)))
        if args.verify:
            k = args.verify
            vplan = replace(plan, draft_len=np.full(b, k, np.int32))

            def verify():
                offer_drafts(runner, k)
                return runner.run(vplan)
            verify()
            t = time.perf_counter()
            for _ in range(16):
                verify()
            wall = 1000 * (time.perf_counter() - t) / 16
            cases.append((f"verify_b{b}", f"verify window of {k}+1 positions a row, {b} rows at {args.context}", wall,
                          traced_events(verify), floors(cfg, b * (k + 1), args.context, store_bytes, prompt=False)))
    scopes = hlo_scopes(dump)
    for key, title, wall, events, floor in cases:
        result["cases"][key] = report(title, wall, charge(events, scopes), floor, timeline(events))
    results_file.write(result, args.out, "prompt_probe" + ("_smoke" if args.smoke else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
