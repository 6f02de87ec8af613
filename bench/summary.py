"""The headline figures: bench/results/SUMMARY.json and the README's table, both made from the result files.

    python bench/summary.py            # rebuild SUMMARY.json from bench/results/*.json and the README's table

Every headline key names one figure (tokens/s, ms) with the machine, date, commit and result file it comes from.
A key is read from the result files that can hold it; when several do, the newest measurement (by its date) wins, so
re-running a bench updates the summary. Files from runs under XLA_FLAGS (recorded as "xla_flags") are comparisons and
never headlines. A key no file holds yet is listed as not measured, never guessed. The bench
scripts call refresh() after writing their result, so the summary and the README follow every recorded run.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- summary:begin (bench/summary.py writes this table) -->", "<!-- summary:end -->"


@dataclass(frozen=True)
class Source:
    bench: str                       # the result file's "bench" field
    path: tuple                      # keys leading to the figure inside the file
    prompt_tokens: int | None = None  # engine_speed results: the prompt length the run used
    require: tuple = ()              # (field, value) pairs the file must have
    skip: tuple = ()                 # (field, value) pairs that rule a file out
    fitted: bool = False             # engine_speed: the 48-layer figure measured at 48 layers or fitted from two or
                                     # more layer counts (one smaller count scaled in proportion multiplies the
                                     # fixed per-window cost too: a spot check, not a headline)


@dataclass(frozen=True)
class Key:
    name: str
    label: str                       # what a reader of the README's table sees
    unit: str
    sources: tuple[Source, ...]


# the engine's headline figures are its default path (kernels = auto; files from before that option existed ran the
# then-default XLA path), never the comparison runs of `--kernels xla` or `--kernels pallas`
ENGINE = (("kernels", "xla"), ("kernels", "pallas"))



def decode_sources(batch: str) -> tuple:
    """Steady decoding as the server runs it, windows dispatched ahead (the scheduler's `lookahead`, on by default),
    where a run measured it: that source is first, so it wins over the same file's windows run one by one;
    long_decode's 4K rows are the same windows (48 layers, bf16 KV)."""
    return (Source("long_decode_decode", ("runs", f"bfloat16_4096_b{batch}", "tok_s")),
            Source("engine_speed_real_shapes", (f"decode_ahead_tok_s_b{batch}_48_layers",), 4096, skip=ENGINE,
                   fitted=True),
            Source("engine_speed_real_shapes", (f"decode_tok_s_b{batch}_48_layers",), 4096, skip=ENGINE, fitted=True))


KEYS = (
    Key("decode_tok_s_b1", "decode, batch 1, 4K context, every expert on the GPU, windows dispatched ahead",
        "tok/s", decode_sources("1")),
    Key("decode_tok_s_b4", "decode, batch 4, 4K context, every expert on the GPU, windows dispatched ahead",
        "tok/s", decode_sources("4")),
    Key("decode_tok_s_b16", "decode, batch 16, 4K context, every expert on the GPU, windows dispatched ahead",
        "tok/s", decode_sources("16")),
    # bench/prompt_speed.py's default engine (the WindowRunner, as the server reads prompts), and before it
    # engine_speed's Engine API reads
    Key("prompt_tok_s_4k", "prompt of 4K tokens", "tok/s",
        (Source("prompt_speed", ("runs", "default", "4096", "tok_s")),
         Source("engine_speed_real_shapes", ("prompt_tok_s_48_layers",), 4096, skip=ENGINE, fitted=True),)),
    Key("prompt_tok_s_32k", "prompt of 32K tokens (parts of 4K)", "tok/s",
        (Source("prompt_speed", ("runs", "default", "32768", "tok_s")),
         Source("engine_speed_real_shapes", ("prompt_tok_s_48_layers",), 32768, skip=ENGINE, fitted=True),)),
    Key("prompt_tok_s_128k", "prompt of 128K tokens (parts of 4K)", "tok/s",
        (Source("prompt_speed", ("runs", "default", "131072", "tok_s")),)),
    Key("offload_decode_tok_s_b1", "decode, batch 1, 12 GiB expert cache (32%), the rest in host RAM", "tok/s",
        (Source("offload_speed", ("runs", "uniform", "decode", "b1", "tok_s"), require=(("window_fetch", True),)),)),
    Key("offload_decode_tok_s_b1_skewed", "decode, batch 1, 12 GiB expert cache, skewed routing (20% of the experts "
        "take ~80% of the routes)", "tok/s",
        (Source("offload_speed", ("runs", "skewed", "decode", "b1", "tok_s"), require=(("window_fetch", True),)),)),
    Key("offload_prompt_tok_s_4k", "prompt of 4K tokens, 12 GiB expert cache, the other layers' experts streamed "
        "from host RAM", "tok/s", (Source("offload_speed", ("runs", "uniform", "prompt", "4096", "tok_s"),
                                          require=(("window_fetch", True), ("stream_parts", True))),)),
    # the real server (bench/serve_load.py) on the random-weights model at real shapes, 64 tokens a client
    Key("serve_tok_s_16_clients", "server: 16 streaming clients, tokens/s in all (random weights at real shapes)",
        "tok/s", (Source("serve_load", ("aggregate_tok_s_16_clients",),
                         require=(("model", "random:qwen3-next-80b-a3b"),)),)),
    Key("serve_itl_ms_p99_16", "server: 16 streaming clients, p99 time between a client's text events", "ms",
        (Source("serve_load", ("inter_event_ms_p99_16",), require=(("model", "random:qwen3-next-80b-a3b"),)),)),
    Key("long_decode_tok_s_b1_128k", "decode, batch 1, 128K context, all KV on the GPU (bf16)", "tok/s",
        (Source("long_decode_decode", ("runs", "bfloat16_131072_b1", "tok_s")),)),
    Key("long_decode_tok_s_b16_128k", "decode, batch 16, 128K context each, all KV on the GPU (bf16)", "tok/s",
        (Source("long_decode_decode", ("runs", "bfloat16_131072_b16", "tok_s")),)),
    Key("long_decode_tok_s_b1_128k_kv16k", "decode, batch 1, 128K context, 16K of it on the GPU and the rest in "
        "pinned host RAM (bf16)", "tok/s", (Source("long_decode_decode", ("runs", "bfloat16_kv16384_131072_b1",
                                                                         "tok_s")),)),
    Key("followup_ttft_ms_64k", "time to first token of a follow-up turn on a 64K conversation", "ms",
        (Source("followup_ttft", ("ttft_ms_64k",)),)),
    # agents sharing a prompt (bench/agents.py: 8 agents on 4 slots, an 8K system prompt with tools, 10 turns each)
    Key("agents_reuse_fraction", "8 agents on 4 slots sharing an 8K system prompt: prompt tokens reused of the most "
        "that could be", "x", (Source("agents", ("agents_reuse_fraction",), require=(("agents", 8), ("slots", 4))),)),
    Key("agents_followup_ttft_ratio", "the same: a follow-up turn's TTFT alone over a cold prompt of its new tokens",
        "x", (Source("agents", ("agents_followup_ttft_ratio",), require=(("agents", 8), ("slots", 4))),)),
    # speculative decoding (bench/spec_speed.py at real shapes, 4 drafts + 1, random weights)
    Key("spec_verify_cost_ratio_b1", "speculative decoding: a verify window of 4 drafts + 1 over a 1-token window, "
        "batch 1", "x", (Source("spec_speed", ("spec_verify_cost_ratio_b1",),
                                require=(("model", "qwen3-next-80b shapes, random weights"), ("k", 4))),)),
    Key("spec_tok_s_b1", "speculative decoding, batch 1, at the tiny model's measured acceptance", "tok/s",
        (Source("spec_speed", ("spec_tok_s_b1",), require=(("model", "qwen3-next-80b shapes, random weights"),
                                                            ("k", 4))),)),
    # the layer split at real shapes with both stages on the one GPU (bench/split_speed.py --one-device): the
    # hand-off's and the second stage's dispatch cost; a run without the server's XLA flags is a comparison
    Key("split_decode_cost_ratio_b1", "layer split in two, both stages on one GPU: a batch-1 decode window over the "
        "unsplit one", "x", (Source("split_speed", ("split_over_unsplit_decode_b1",),
                                    require=(("model", "random:qwen3-next-80b-a3b"), ("one_device", True)),
                                    skip=(("default_xla_flags", ""),)),)),
    # Qwen3.8-Flash-Next at real shapes (bench/flash_speed.py: random weights, int4 experts as many as the device
    # holds, the PLE table in host RAM)
    Key("q38_decode_tok_s_b1", "Qwen3.8-Flash-Next: decode, batch 1, 4K context, windows dispatched ahead", "tok/s",
        (Source("flash_speed", ("q38_decode_tok_s_b1",), require=(("model", "random:qwen3.8-flash-next"),)),)),
    Key("q38_decode_tok_s_b16", "Qwen3.8-Flash-Next: decode, batch 16, 4K context, windows dispatched ahead",
        "tok/s", (Source("flash_speed", ("q38_decode_tok_s_b16",),
                         require=(("model", "random:qwen3.8-flash-next"),)),)),
    Key("q38_prompt_tok_s_4k", "Qwen3.8-Flash-Next: prompt of 4K tokens", "tok/s",
        (Source("flash_speed", ("q38_prompt_tok_s_4k",), require=(("model", "random:qwen3.8-flash-next"),)),)),
    # `make test` on the 2-core CPU machine (tests/compile_report.py --json after a run with the report on)
    Key("make_test_s_cold", "`make test` on the 2-core CPU machine, empty compile cache (pytest's time)", "s",
        (Source("test_suite", ("pytest_wall_s",), require=(("cache", "empty"),)),)),
    Key("make_test_s_warm", "`make test` on the 2-core CPU machine, the compile cache of a run before", "s",
        (Source("test_suite", ("pytest_wall_s",), require=(("cache", "warm"),)),)),
    # peers, measured on the same machine and shapes by bench/transformers_speed.py
    Key("peer_transformers_prompt_tok_s_4k", "peer: Hugging Face transformers, prompt of 4K tokens (bf16 experts)",
        "tok/s", (Source("transformers_speed", ("prompt_tok_s_48_layers",), fitted=True),)),
    Key("peer_transformers_decode_tok_s_b1", "peer: Hugging Face transformers, decode, batch 1 (bf16 experts)",
        "tok/s", (Source("transformers_speed", ("decode_tok_s_b1_48_layers",), fitted=True),)),
)


def _prompt_tokens(result: dict) -> int | None:
    """The prompt length an engine_speed result measured (every layer count ran the same prompt)."""
    layers = result.get("layers") or {}
    for run in layers.values():
        if isinstance(run, dict) and "prompt_tokens" in run:
            return int(run["prompt_tokens"])
    return None


def _fitted(result: dict) -> bool:
    counts = {int(n) for n in (result.get("layers") or {})}
    return len(counts) >= 2 or 48 in counts


def _dig(result: dict, path: tuple):
    v = result
    for k in path:
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def collect(results_dir: Path = RESULTS) -> dict:
    """-> {key: {"value", "unit", "label", "machine", "date", "commit", "source"}} for every key some file holds."""
    files = []
    for path in sorted(results_dir.glob("*.json")):
        if path.name == "SUMMARY.json":
            continue
        try:
            files.append((path, json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"bench/summary.py: {path} is not a readable JSON result: {e}")
    out = {}
    for key in KEYS:
        found = []
        for src in key.sources:
            for f, result in files:
                if result.get("bench") != src.bench or "smoke" in f.name:
                    continue
                if result.get("xla_flags") or result.get("comparison"):   # runs under other compiler flags or
                    continue                                                 # options are comparisons
                if src.prompt_tokens is not None and _prompt_tokens(result) != src.prompt_tokens:
                    continue
                if any(result.get(field) != value for field, value in src.require):
                    continue
                if any(result.get(field) == value for field, value in src.skip):
                    continue
                if src.fitted and not _fitted(result):
                    continue
                v = _dig(result, src.path)
                if v is not None and v > 0:              # a fit can come out negative: no figure, not a zero
                    found.append((str(result.get("date", "")), f.name, result, v))
        if found:
            date, name, result, v = max(found, key=lambda x: (x[0], x[1]))
            out[key.name] = {"value": round(float(v), 3), "unit": key.unit, "label": key.label,
                             "machine": result.get("machine", "unknown"), "date": date,
                             "commit": result.get("commit", "unknown"), "source": name}
    return out


def table(summary: dict) -> str:
    """The README's performance table, one row per headline key (measured or not)."""
    rows = ["| figure | key | value | machine | date | commit | from |", "|---|---|---|---|---|---|---|"]
    for key in KEYS:
        s = summary.get(key.name)
        if s is None:
            rows.append(f"| {key.label} | `{key.name}` | not measured yet | | | | |")
            continue
        v = s["value"]
        shown = f"{v:.2f}" if key.unit == "x" else f"{v:,.0f}" if v >= 1000 else f"{v:,.1f}"     # ratios near 1
        rows.append(f"| {key.label} | `{key.name}` | {shown} {s['unit']} | {s['machine']} | {s['date'][:10]} | "
                    f"{s['commit']} | `{s['source']}` |")
    return "\n".join(rows)


def write_readme(summary: dict, readme: Path = README) -> bool:
    """Replace the table between the README's markers; -> whether the README changed."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"bench/summary.py: {readme} has no summary markers ({BEGIN} ... {END})")
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    new = pattern.sub(lambda _: f"{BEGIN}\n{table(summary)}\n{END}", text)
    if new != text:
        readme.write_text(new)
    return new != text


def refresh(results_dir: Path = RESULTS, readme: Path | None = README) -> dict:
    """Rebuild SUMMARY.json (and the README's table) from the result files; -> the summary."""
    summary = collect(results_dir)
    (results_dir / "SUMMARY.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    if readme is not None:
        write_readme(summary, readme)
    return summary


def main() -> int:
    summary = refresh()
    missing = [k.name for k in KEYS if k.name not in summary]
    print(table(summary))
    if missing:
        print(f"\nnot measured yet: {', '.join(missing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
