"""The command line, run as a user runs it (a subprocess of `python -m strata.cli`): help, generate on the demo
model (text on stdout, logs on stderr), seeded reproducibility, and one-line errors for bad arguments."""
from __future__ import annotations

import os
from pathlib import Path
import re
import subprocess
import sys

from strata.demo import DEMO_NOTE

ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def strata(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def test_help_lists_generate():
    r = strata("--help")
    assert r.returncode == 0, r.stderr
    assert "usage: strata" in r.stdout
    assert re.search(r"^\s+generate\s+\S", r.stdout, re.M), r.stdout      # the command, with its one-line help
    g = strata("generate", "--help")
    assert g.returncode == 0
    for flag in ("--model", "--prompt", "--max-tokens", "--temperature", "--seed", "--top-k", "--top-p", "--min-p"):
        assert flag in g.stdout


def test_no_command_prints_help_and_fails():
    r = strata()
    assert r.returncode == 2
    assert "generate" in r.stdout and "Traceback" not in r.stderr


def test_generate_demo():
    r = strata("generate", "--model", "demo", "--prompt", "hi", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout.endswith("\n") and len(r.stdout.strip()) > 0           # the generated text, then a newline
    assert "strata generate:" not in r.stdout                              # logs stay on stderr
    assert DEMO_NOTE in r.stderr and "random weights" in r.stderr
    rate = re.search(r"(\d+) generated in \d+ ms \((\d+(?:\.\d+)?) tok/s\)", r.stderr)
    assert rate, r.stderr
    assert 1 <= int(rate.group(1)) <= 8 and float(rate.group(2)) >= 0
    assert re.search(r"prompt \d+ tokens read in \d+ ms incl. compilation \(\d+(?:\.\d+)? tok/s\)", r.stderr), r.stderr


def test_seeded_generate_is_reproducible():
    args = ("generate", "--model", "demo", "--prompt", "hi", "--max-tokens", "12", "--seed", "3",
            "--temperature", "0.9")
    a, b = strata(*args), strata(*args)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout.strip() and a.stdout == b.stdout


def test_bad_sampling_argument_is_one_line_error():
    r = strata("generate", "--model", "demo", "--prompt", "hi", "--top-p", "0")
    assert r.returncode == 2
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert errors == [errors[0]] and errors[0].startswith("strata generate: error:") and "top_p" in errors[0]
    assert "Traceback" not in r.stderr


def test_unknown_flag_is_an_argparse_error():
    r = strata("generate", "--prompt", "hi", "--no-such-flag")
    assert r.returncode == 2
    assert "--no-such-flag" in r.stderr and "Traceback" not in r.stderr


def test_serve_help_is_generated_from_the_settings():
    from strata.config import SPECS
    from strata.cli import ENGINE_FLAGS
    r = strata("serve", "--help")
    assert r.returncode == 0, r.stderr
    squeezed = "".join(r.stdout.split())                 # argparse rewraps (and may split words at hyphens)
    for spec in SPECS.values():
        assert spec.flag in r.stdout and "".join(spec.flag_help.split()) in squeezed, spec.key
    g = strata("generate", "--help")
    assert all(SPECS[key].flag in g.stdout for key in ENGINE_FLAGS) and "--parallel" not in g.stdout


def test_a_bad_setting_flag_names_the_flag_in_its_own_words():
    r = strata("generate", "--prompt", "hi", "--max-context", "lots")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == ('strata generate: error: --max-context lots is not allowed; max_context must be "auto" '
                                "or an integer in [16, 4194304]"), r.stderr
    r = strata("serve", "--expert-cache", "lots")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == ('strata serve: error: --expert-cache lots is not allowed; expert_cache must be "auto" '
                                'or a number of experts in [1, 16777216]'), r.stderr


def test_every_flag_of_every_command_is_in_the_configuration_docs():
    """`strata <command> --help` and docs/configuration.md come from the same parser and fields: none is missing."""
    import argparse
    from strata.cli import build_parser
    docs = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        assert f"### strata {name}" in docs
        for action in p._actions:
            for option in action.option_strings:
                assert option in ("-h", "--help") or f"`{option}`" in docs, (name, option)
                assert option in ("-h", "--help") or action.help, f"strata {name} {option} has no help"
