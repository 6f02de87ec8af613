"""What the GPU compiler makes of our Pallas (Triton backend) kernels, seen from a machine without a GPU: per kernel,
registers, spills, shared memory and the SASS's global loads by width, stores, barriers and instruction count.

Why: the decode kernels' speed on the H200 hangs on code quality we cannot see from the CPU machines: whether the
packed int4 tiles become 128-bit vector loads or per-byte ones, how many registers a program takes, whether it
spills. H200 time is scarce; this probe answers those questions here in seconds, before a GPU run.

How, in two processes (jaxlib and a standalone Triton each bring their own MLIR, so they cannot share one):
1. JAX side (the project's .venv): jax.export lowers the jitted function for CUDA on this CPU machine (jaxlib <=
   0.11 lowers each pallas_call to a custom call @__gpu$xla.gpu.triton whose backend_config holds the kernel's TTIR
   module as MLIR bytecode in `ir`, plus name, num_warps, num_stages, grid_x/y/z: see JAX's
   jax/_src/pallas/triton/pallas_call_registration.py). We read that bytecode back with jaxlib's Triton dialect and
   write each kernel as text TTIR (the pretty form with source locations, and the generic form as a fallback for a
   Triton whose assembly syntax differs) plus its launch parameters, under --out.
2. Triton side (`python bench/triton_sass_probe.py --compile DIR` in a venv with `pip install triton`, imports no
   JAX): triton.compile(TTIR file) for sm_90a (compute capability 90, the H200), then the wheel's own ptxas -v (with
   Triton's flags) for registers/spills and nvdisasm -g for the SASS, annotated with the kernel's source lines. It
   writes NN_name.{ttgir,ptx,cubin,sass,ptxas.log} and report.json in DIR and prints a table.

Setup once:  python3.11 -m venv /work/triton_probe/venv && /work/triton_probe/venv/bin/pip install triton
Run:         .venv/bin/python bench/triton_sass_probe.py --case expert_decode --tokens 1 --block 8 --warps 4 \\
                 --out /tmp/probe_decode
Again, from the written TTIR only:  /work/triton_probe/venv/bin/python bench/triton_sass_probe.py --compile DIR
Add a kernel: a builder in CASES returning (jitted fn, argument ShapeDtypeStructs).

CAVEAT: on the H200 the TTIR is compiled by the Triton inside XLA (jaxlib 0.11.2's pinned openxla fork and XLA's
own pass pipeline and options), not by the standalone Triton wheel used here (3.8.0 when written; 3.6.0 parses the
same TTIR), and the TTIR is lowered here by jaxlib 0.10.2 with compute capability 90 assumed. So the numbers are
indicative: good for "per-byte or vector loads?", "spills or not?", comparisons between block shapes; not exact
register counts of what runs on the GPU. SASS counts are static (a loop body appears once, not per iteration).
Reading the .sass: '//## File ..., line N' gives the innermost source line of the instructions below it (a call site
is reduced to its callee here); Triton's debug info knows one file, the kernel's, so a helper's line in another file
(blob_tiles.load_as, say) is shown under the kernel's file name.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

TRITON_PYTHON = "/work/triton_probe/venv/bin/python"
TARGET_CC = 90                     # H200 (sm_90a: Triton picks the 'a' arch for 90 itself)


# ---------------------------------------------------------------- JAX side: cases and TTIR extraction (.venv)

def _expert_decode(args):
    """The int4 decode expert op at Qwen3-Next-80B shapes, as tests/kernels/test_expert_decode.py's
    test_kernels_lower_for_cuda_at_real_shapes builds it (args.tokens tokens x 10 routes, 16,384 slots)."""
    import jax
    import jax.numpy as jnp
    from strata.jax_backend.kernels import expert_decode as K
    from strata.weights import quant as Q
    kw = dict(block=args.block or K.BLOCK_ROWS, warps=args.warps or K.WARPS)
    lay = Q.layout("int4", 2048, 512)
    spec, t = jax.ShapeDtypeStruct, args.tokens or 1
    fn = jax.jit(lambda p, x, s, w: K.experts_decode(lay, p, x, s, w, **kw))
    return fn, (spec((16384, lay.nbytes), jnp.uint8), spec((t, 2048), jnp.bfloat16), spec((t, 10), jnp.int32),
                spec((t, 10), jnp.float32))


def _prompt_attention(args):
    """The prompt parts' flash-attention kernel at Qwen3-Next-80B shapes (Hq 16, Hkv 2, hd 256): args.tokens queries
    (default 4096) over a cache of 131,072 + 4,096 rows, args.kv "int8" (with scales) or "bfloat16", args.block keys
    a loop step (default: the kernel's)."""
    import jax
    import jax.numpy as jnp
    from strata.jax_backend.kernels import decode_attention as K
    spec, t, cap = jax.ShapeDtypeStruct, args.tokens or 4096, 135168
    kw = dict(scale=256 ** -0.5, num_warps=args.warps or K.PROMPT_WARPS, block_k=args.block)
    q, pos = spec((t, 16, 256), jnp.bfloat16), spec((t,), jnp.int32)
    if args.kv == "int8":
        cache, scales = spec((cap, 2, 256), jnp.int8), spec((cap, 2), jnp.float32)
        fn = jax.jit(lambda q, k, v, ks, vs, p: K.prompt_attention(q, k, v, ks, vs, p, **kw))
        return fn, (q, cache, cache, scales, scales, pos)
    cache = spec((cap, 2, 256), jnp.bfloat16)
    fn = jax.jit(lambda q, k, v, p: K.prompt_attention(q, k, v, None, None, p, **kw))
    return fn, (q, cache, cache, pos)


def _tiered_decode(args):
    """The decode attention kernel over a host tier kept as banks (kv_resident with parked rows) at Qwen3-Next-80B
    shapes: args.tokens rows (default 16) of 16K device positions, host banks of 2 x rows rows of 128K + 16K
    positions (pinned host memory on the GPU), args.kv "int8" (with scales) or "bfloat16"."""
    import jax
    import jax.numpy as jnp
    from strata.jax_backend.kernels import decode_attention as K
    spec, s, dev, host = jax.ShapeDtypeStruct, args.tokens or 16, 16384, 147456
    q, i = spec((s, 1, 16, 256), jnp.bfloat16), spec((s,), jnp.int32)
    dt = jnp.int8 if args.kv == "int8" else jnp.bfloat16
    d, h = spec((s, dev, 2, 256), dt), spec((2 * s, host, 2, 256), dt)
    if args.kv == "int8":
        ds, hs = spec((s, dev, 2), jnp.float32), spec((2 * s, host, 2), jnp.float32)
        fn = jax.jit(lambda *a: K.tiered_decode_attention(*a, scale=256 ** -0.5))
        return fn, (q, d, d, ds, ds, i, h, h, hs, hs, i, i)
    fn = jax.jit(lambda q, k, v, p, kh, vh, n, r: K.tiered_decode_attention(q, k, v, None, None, p, kh, vh, None,
                                                                             None, n, r, scale=256 ** -0.5))
    return fn, (q, d, d, i, h, h, i, i)


def _banked_decode(args):
    """The decode attention kernel over a bank of slots (a decode window of fewer rows than slots, row_buckets) at
    Qwen3-Next-80B shapes: args.tokens rows (default 4) of a 16-slot bank of 16K positions, args.kv "int8" (with
    scales) or "bfloat16"; args.block 0: the same rows on caches of their own (no bank), to compare."""
    import jax
    import jax.numpy as jnp
    from strata.jax_backend.kernels import decode_attention as K
    spec, s, cap = jax.ShapeDtypeStruct, args.tokens or 4, 16384
    banked = args.block != 0
    b = 16 if banked else s
    q, i = spec((s, 1, 16, 256), jnp.bfloat16), spec((s,), jnp.int32)
    dt = jnp.int8 if args.kv == "int8" else jnp.bfloat16
    c, sc = spec((b, cap, 2, 256), dt), spec((b, cap, 2), jnp.float32)
    rows = (i,) if banked else ()
    if args.kv == "int8":
        fn = jax.jit(lambda q, k, v, ks, vs, p, *r: K.decode_attention(q, k, v, ks, vs, p, *r, scale=256 ** -0.5))
        return fn, (q, c, c, sc, sc, i, *rows)
    fn = jax.jit(lambda q, k, v, p, *r: K.decode_attention(q, k, v, None, None, p, *r, scale=256 ** -0.5))
    return fn, (q, c, c, i, *rows)


CASES = {"expert_decode": _expert_decode,    # name -> builder(args) -> (jitted fn, argument specs)
         "prompt_attention": _prompt_attention, "tiered_decode": _tiered_decode, "banked_decode": _banked_decode}


def extract_kernels(fn, specs, out: Path) -> list[dict]:
    """Export fn for CUDA and write each Triton kernel's TTIR (NN_name.ttir, NN_name.generic.ttir) and launch
    parameters (NN_name.json) under out; -> the parameters."""
    import jax
    from jax import export
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jaxlib.triton import dialect as tt_dialect
    target = "__gpu$xla.gpu.triton"
    exp = export.export(fn, platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])(*specs)
    ctx = mlir.make_ir_context()
    tt_dialect.register_dialect(ctx)               # to read the kernels' tt.* ops back from bytecode
    kernels = []
    with ctx, ir.Location.unknown():
        calls = []

        def visit(op):
            if (op.name == "stablehlo.custom_call"
                    and ir.StringAttr(op.attributes["call_target_name"]).value == target):
                calls.append(op)
            return ir.WalkResult.ADVANCE
        module = ir.Module.parse(exp.mlir_module())     # held: the ops collected live as long as it does
        module.operation.walk(visit)
        for i, call in enumerate(calls):
            cfg = ir.DictAttr(call.attributes["mhlo.backend_config"])
            meta = {k: ir.IntegerAttr(cfg[k]).value for k in ("num_warps", "num_stages", "grid_x", "grid_y", "grid_z")}
            meta["name"] = ir.StringAttr(cfg["name"]).value
            stem = f"{i:02d}{re.sub(r'[^A-Za-z0-9_]', '_', meta['name'])}"
            kernel = ir.Module.parse(ir.StringAttr(cfg["ir"]).value_bytes)       # MLIR bytecode, not compressed
            op = kernel.operation
            (out / f"{stem}.ttir").write_text(_point_locations(op.get_asm(enable_debug_info=True)))
            (out / f"{stem}.generic.ttir").write_text(op.get_asm(print_generic_op_form=True))
            (out / f"{stem}.json").write_text(json.dumps(meta, indent=1))
            kernels.append(meta)
    print(f"{len(kernels)} Triton kernel(s) from jax {jax.__version__}, written to {out}")
    return kernels


def _point_locations(ttir: str) -> str:
    """Source locations Triton turns into line info (the SASS listing's '//## File ..., line N'): JAX writes ranges
    ("f.py":172:29 to :86) where Triton's debug info takes points ("f.py":172:29); a call site (callee at caller) is
    kept as its callee, the innermost line (the load itself, not the pl.when around it); and Triton names the PTX
    .file after the function's location, which JAX leaves unknown: the unknowns become the kernel's file, line 0."""
    ttir = re.sub(r'(loc\("[^"]*":\d+:\d+) to [\d:]+\)', r"\1)", ttir)
    ttir = re.sub(r"loc\(callsite\((#loc\d*) at #loc\d*\)\)", r"loc(\1)", ttir)
    m = re.search(r'loc\(("[^"]+"):\d+:\d+\)', ttir)
    return re.sub(r"^(#loc\d*) = loc\(unknown\)", rf"\1 = loc({m.group(1)}:0:0)", ttir, flags=re.M) if m else ttir


# ---------------------------------------------------------------- Triton side: compile and read the SASS (triton venv)

SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")
LOAD_WIDTHS = ("U8", "S8", "U16", "S16", "64", "128", "256")       # no width modifier: 32 bits


def sass_stats(sass: str) -> dict:
    """Static counts over the SASS listing: global loads by width, other memory ops, barriers, all instructions."""
    ops = [m.group(1) for line in sass.splitlines() if (m := SASS_LINE.match(line))]
    ldg = Counter()
    for op in ops:
        parts = op.split(".")
        if parts[0] == "LDG":
            ldg[next((w for w in LOAD_WIDTHS if w in parts[1:]), "32")] += 1
    base = Counter(op.split(".")[0] for op in ops)
    return {"ldg": dict(sorted(ldg.items(), key=lambda kv: int(kv[0].lstrip("US")))),
            **{k.lower(): base[k] for k in ("LDGSTS", "STG", "LDS", "STS", "LDL", "STL", "LD", "ST")},
            "bar_sync": sum(op.startswith("BAR.SYNC") for op in ops), "instructions": len(ops),
            "opcodes": dict(Counter(ops).most_common())}


def ptxas_stats(log: str) -> dict:
    """ptxas -v: registers, spill bytes, static shared memory (Triton's own shared memory is dynamic: 'smem')."""
    def num(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0
    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"), "stack": num(r"(\d+) bytes stack frame"),
            "static_smem": num(r"(\d+) bytes smem")}


def _asm_block_locs(ptx: str) -> str:
    """LLVM's PTX printer gives each line of an inline asm block the block's .loc plus the line's index in it, so
    Triton's loads (a `mov` per register, then the `ld`) would be shown 1-4 source lines below their own: every line
    of a block gets the block's first .loc instead."""
    def fix(m):
        first = re.search(r"\.loc\s+\d+\s+\d+\s+\d+", m.group(0))
        return re.sub(r"\.loc\s+\d+\s+\d+\s+\d+", first.group(0), m.group(0)) if first else m.group(0)
    return re.sub(r"// begin inline asm.*?// end inline asm", fix, ptx, flags=re.S)


def compile_dir(out: Path) -> list[dict]:
    os.environ.setdefault("TRITON_CACHE_DIR", str(out / ".triton_cache"))     # before triton reads its knobs
    import triton
    from triton.backends.compiler import GPUTarget
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"      # the wheel's ptxas, nvdisasm
    rows = []
    for meta_file in sorted(out.glob("[0-9][0-9]*.json")):
        stem, meta = meta_file.stem, json.loads(meta_file.read_text())
        opts = {"num_warps": meta["num_warps"], "num_stages": meta["num_stages"], "num_ctas": 1}
        err = None
        for src in (f"{stem}.ttir", f"{stem}.generic.ttir"):     # pretty form first; generic if its syntax differs
            try:
                k = triton.compile(str(out / src), target=GPUTarget("cuda", TARGET_CC, 32), options=opts)
                break
            except Exception as e:                                 # noqa: BLE001 (reported, then the next form)
                err = f"{src}: {type(e).__name__}: {str(e)[:400]}"
                print(f"{stem}: {err}", file=sys.stderr)
        else:
            rows.append({"kernel": stem, **meta, "error": err})
            continue
        ptx = out / f"{stem}.ptx"
        ptx.write_text(_asm_block_locs(k.asm["ptx"]))     # only .loc lines differ from Triton's PTX
        (out / f"{stem}.ttgir").write_text(k.asm["ttgir"])
        arch = re.search(r"^\.target\s+(\w+)", k.asm["ptx"], re.M).group(1)          # sm_90a
        # ptxas again, with Triton's own flags (make_cubin: -lineinfo -v --gpu-name), for its -v report.
        log = subprocess.run([bin_dir / "ptxas", "-lineinfo", "-v", f"--gpu-name={arch}", ptx, "-o",
                              out / f"{stem}.cubin"], capture_output=True, text=True, check=True).stderr
        (out / f"{stem}.ptxas.log").write_text(log)
        sass = subprocess.run([bin_dir / "nvdisasm", "-g", "-c", out / f"{stem}.cubin"], capture_output=True,
                              text=True, check=True).stdout                       # -g: with source lines
        (out / f"{stem}.sass").write_text(sass)
        rows.append({"kernel": stem, **meta, "arch": arch, "smem": k.metadata.shared, **ptxas_stats(log),
                     **sass_stats(sass)})
    report = {"triton": triton.__version__, "target_cc": TARGET_CC, "kernels": rows}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print_table(report)
    return rows


def print_table(report: dict) -> None:
    print(f"Triton {report['triton']}, sm_{report['target_cc']}a; SASS counts are static (a loop body once)")
    head = ("kernel", "warps", "stages", "grid", "regs", "spill st/ld", "smem", "LDG by width (bits or type)",
            "LDGSTS", "STG", "BAR", "SASS")
    lines = [head]
    for r in report["kernels"]:
        grid = f"{r['grid_x']}x{r['grid_y']}x{r['grid_z']}"
        if "error" in r:
            lines.append((r["kernel"], str(r["num_warps"]), str(r["num_stages"]), grid, "compile failed", "", "",
                          r["error"][:60], "", "", "", ""))
            continue
        ldg = " ".join(f"{w}:{n}" for w, n in r["ldg"].items()) or "-"
        lines.append((r["kernel"], str(r["num_warps"]), str(r["num_stages"]), grid, str(r["registers"]),
                      f"{r['spill_stores']}/{r['spill_loads']}", str(r["smem"]), ldg, str(r["ldgsts"]),
                      str(r["stg"]), str(r["bar_sync"]), str(r["instructions"])))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())


# ---------------------------------------------------------------- CLI

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", metavar="DIR", help="Triton side only: compile the TTIR files in DIR (triton venv)")
    ap.add_argument("--case", choices=sorted(CASES), default="expert_decode")
    ap.add_argument("--tokens", type=int, help="expert_decode: tokens (default 1); prompt_attention: queries (4096); "
                                              "tiered_decode: rows (16); banked_decode: rows (4)")
    ap.add_argument("--kv", default="int8", choices=("int8", "bfloat16"),
                    help="prompt_attention, tiered_decode, banked_decode: the cache's dtype")
    ap.add_argument("--block", type=int, help="expert_decode: rows a program; prompt_attention: keys a step (default: "
                                              "the kernel's); banked_decode: 0 for caches of the rows' own")
    ap.add_argument("--warps", type=int, help="Triton warps a program (default: the kernel's)")
    ap.add_argument("--out", default="/work/triton_probe/out", help="folder for the TTIR, PTX, SASS and report.json")
    ap.add_argument("--triton-python", default=TRITON_PYTHON, help="python of a venv with triton installed")
    args = ap.parse_args()
    if args.compile:
        compile_dir(Path(args.compile))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))        # the repo's strata package
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("[0-9][0-9]*.*"):                             # a previous run's kernels
        stale.unlink()
    fn, specs = CASES[args.case](args)
    extract_kernels(fn, specs, out)
    (out / "case.json").write_text(json.dumps(vars(args), indent=1))
    subprocess.run([args.triton_python, str(Path(__file__).resolve()), "--compile", str(out)], check=True)


if __name__ == "__main__":
    main()
