"""bench/summary.py: the headline figures come from the recorded result files (newest measurement of each key,
only from files that can hold it), and the README's performance table is exactly what it generates from them."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_summary", ROOT / "bench" / "summary.py")
summary = importlib.util.module_from_spec(spec)
sys.modules["bench_summary"] = summary            # dataclasses look their module up by name
spec.loader.exec_module(summary)


def _engine(date, commit, prompt, decode, tok_s, layers=("4", "8")):
    return {"bench": "engine_speed_real_shapes", "machine": "gpu:test", "date": date, "commit": commit,
            "layers": {n: {"prompt_tokens": prompt} for n in layers}, "decode_tok_s_b1_48_layers": decode,
            "prompt_tok_s_48_layers": tok_s}


def _write(d: Path, name: str, result: dict):
    (d / name).write_text(json.dumps(result))


def test_newest_measurement_wins_and_files_that_cannot_hold_a_key_are_ignored(tmp_path):
    _write(tmp_path, "old_4k.json", _engine("2026-11-01T00:00:00", "aaa", 4096, 100.0, 5000.0))
    _write(tmp_path, "new_4k.json", _engine("2026-11-02T00:00:00", "bbb", 4096, 120.0, 6000.0))
    _write(tmp_path, "k32.json", _engine("2026-11-03T00:00:00", "ccc", 32768, 90.0, 4000.0))
    _write(tmp_path, "x_smoke.json", _engine("2026-11-09T00:00:00", "ddd", 4096, 1.0, 1.0))
    # one layer count short of 48, scaled in proportion: a spot check, never a headline
    _write(tmp_path, "spot_8.json", _engine("2026-11-09T00:00:00", "fff", 4096, 2.0, 2.0, layers=("8",)))
    # a run under other compiler flags: a comparison, never a headline
    _write(tmp_path, "flags.json", dict(_engine("2026-11-09T00:00:00", "ggg", 4096, 3.0, 3.0),
                                        xla_flags="--xla_gpu_enable_command_buffer="))
    # nor one under another engine option (engine_speed --gdn-chunk)
    _write(tmp_path, "option.json", dict(_engine("2026-11-09T00:00:00", "hhh", 4096, 4.0, 4.0),
                                         comparison="gdn_chunk 128"))
    offload = {"bench": "offload_speed", "machine": "gpu:test", "commit": "eee",
               "runs": {"uniform": {"decode": {"b1": {"tok_s": 4.9}}}}}
    _write(tmp_path, "layer_by_layer.json", dict(offload, date="2026-11-05T00:00:00", window_fetch=False))
    _write(tmp_path, "old_no_flag.json", dict(offload, date="2026-11-06T00:00:00"))
    _write(tmp_path, "window.json", dict(offload, date="2026-11-04T00:00:00", window_fetch=True,
                                          runs={"uniform": {"decode": {"b1": {"tok_s": 17.0}}}}))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{summary.BEGIN}\nstale\n{summary.END}\n\nafter\n")
    s = summary.refresh(tmp_path, readme)
    assert s["decode_tok_s_b1"]["value"] == 120.0 and s["decode_tok_s_b1"]["commit"] == "bbb"
    assert s["prompt_tok_s_4k"]["value"] == 6000.0 and s["prompt_tok_s_4k"]["source"] == "new_4k.json"
    assert s["prompt_tok_s_32k"]["value"] == 4000.0                  # only the 32K-prompt file holds it
    assert s["offload_decode_tok_s_b1"]["value"] == 17.0             # layer-by-layer and unflagged runs are not it
    assert "decode_tok_s_b4" not in s and "followup_ttft_ms_64k" not in s
    assert json.loads((tmp_path / "SUMMARY.json").read_text()) == s
    text = readme.read_text()
    assert "stale" not in text and text.endswith("after\n")
    assert "| `decode_tok_s_b4` | not measured yet |" in text.replace("decode, batch 4, every expert on the GPU ", "")
    assert "120.0 tok/s" in text and "6,000 tok/s" in text


def test_a_readme_without_markers_is_refused_by_name(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# no table here\n")
    with pytest.raises(SystemExit, match="no summary markers"):
        summary.write_readme({}, readme)


def test_the_committed_summary_and_readme_table_match_the_committed_results():
    """SUMMARY.json and the README's table are current: rebuilt from bench/results/, they do not change."""
    s = summary.collect(summary.RESULTS)
    assert json.loads((summary.RESULTS / "SUMMARY.json").read_text()) == s
    assert f"{summary.BEGIN}\n{summary.table(s)}\n{summary.END}" in summary.README.read_text()


def test_decode_headlines_prefer_windows_dispatched_ahead(tmp_path):
    """A run that timed windows dispatched ahead (the scheduler's lookahead, the server's steady decoding) gives the
    decode headline; a run without that figure gives its windows run one by one."""
    _write(tmp_path, "old.json", _engine("2026-11-01T00:00:00", "aaa", 4096, 100.0, 5000.0))
    s = summary.collect(tmp_path)
    assert s["decode_tok_s_b1"]["value"] == 100.0
    _write(tmp_path, "new.json", dict(_engine("2026-11-02T00:00:00", "bbb", 4096, 110.0, 5000.0),
                                      decode_ahead_tok_s_b1_48_layers=140.0))
    s = summary.collect(tmp_path)
    assert s["decode_tok_s_b1"]["value"] == 140.0 and s["decode_tok_s_b1"]["commit"] == "bbb"


def test_a_bench_script_finds_the_package_with_only_bench_on_its_path(tmp_path):
    """A script run as `python bench/x.py` from anywhere has only bench/ on its path (the lent GPU has no installed
    strata): importing results_file puts the project root there, so stamp() (which reads strata's own names) works."""
    import os
    import subprocess
    root = str(ROOT)
    code = (f"import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.', {root!r})]; "
            f"sys.path.insert(0, {str(ROOT / 'bench')!r}); import results_file; "
            f"assert {root!r} in sys.path, sys.path; print(results_file.stamp()['commit'])")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**env, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
