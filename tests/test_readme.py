"""The README's commands run as written. Its fenced blocks are tagged by what they need:
`sh` runs in a fresh directory (with the venv's `.venv` linked in); `sh server` is started, answered by the README's
client example and a long prompt, and stopped; `sh checkpoint` needs a real model, so only its flags are checked
against the CLI and the settings; `sh ci` is `make test` itself; `text` blocks of log lines must match what the
server logs. The README stays a manual: at most 250 lines."""
from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy      # minutes on 2 CPU cores: started first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = [(m.group(1), m.group(2).strip(), m.group(3))
          for m in re.finditer(r"^```(\w+)([^\n]*)\n(.*?)^```", README, re.S | re.M)]
VENV = Path(sys.executable).parent.parent


def blocks(lang: str, tag: str = "") -> list[str]:
    return [body for la, t, body in BLOCKS if la == lang and t == tag]


def commands(body: str) -> list[str]:
    return [line.split("  #")[0].strip() for line in body.splitlines() if line.strip()]


def env() -> dict:
    return {**os.environ, "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ['PATH']}"}


def test_the_readme_is_a_manual_of_at_most_250_lines():
    assert len(README.splitlines()) <= 250
    tags = {(la, t) for la, t, _ in BLOCKS}
    assert tags <= {("sh", ""), ("sh", "server"), ("sh", "checkpoint"), ("sh", "ci"), ("python", ""), ("text", "")}, tags


def test_the_ci_blocks_are_the_command_ci_runs():
    assert blocks("sh", "ci") and all(commands(b) == ["make test"] for b in blocks("sh", "ci"))
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("body", blocks("sh"), ids=lambda b: commands(b)[-1][:40])
def test_each_shell_block_runs_as_written(body, tmp_path):
    (tmp_path / ".venv").symlink_to(VENV)
    r = subprocess.run(["bash", "-e", "-c", body], cwd=tmp_path, env=env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"{body}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("line", [c for b in blocks("sh", "checkpoint") for c in commands(b)])
def test_checkpoint_commands_have_flags_the_cli_takes(line):
    from strata.cli import build_parser
    from strata.config import SPECS, Settings
    argv = shlex.split(line)
    assert argv[0] == "strata"
    args = build_parser().parse_args(argv[1:])              # argparse exits on an unknown flag
    flags = {k: getattr(args, k) for k in SPECS if getattr(args, k, None) is not None}
    Settings.build().with_values(flags, as_flag=True)       # the one validation, as the command runs it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_pattern(log_line: str) -> str:
    """A README log line as a regex: its numbers and the request id may differ."""
    text = re.escape(log_line.strip()).replace(r"\.\.\.", ".*")
    return re.sub(r"\d+(?:\\\.\d+)?", r"\\d+(?:\\.\\d+)?", text)


def test_the_server_block_serves_the_client_example_and_logs_what_the_readme_shows(tmp_path):
    (command,) = [c for b in blocks("sh", "server") for c in commands(b)]
    assert command == "make serve"
    port = _free_port()
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(["make", "-s", "serve", f"ARGS=--port {port}"], cwd=ROOT, env=env(), stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "ready:" not in (tmp_path / "serve.log").read_text():
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "no `ready:` line within 300 s"
            time.sleep(0.2)
        (client,) = [b for b in blocks("python") if "openai.OpenAI(" in b]
        client = client.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
        long_prompt = ("client.chat.completions.create(model='tiny', max_tokens=4, messages=[{'role': 'user', "
                       "'content': 'hello world ' * 400}])")
        r = subprocess.run([sys.executable, "-c", client + "\n" + long_prompt], env=env(), capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0 and r.stdout, r.stderr
    finally:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(timeout=60)
        log.close()
    logged = (tmp_path / "serve.log").read_text()
    for body in blocks("text"):
        for line in body.splitlines():
            assert re.search(_as_pattern(line), logged), f"the README shows {line!r}; the server logged:\n{logged}"


def test_the_python_engine_example_runs():
    (example,) = [b for b in blocks("python") if "Engine.load" in b]
    r = subprocess.run([sys.executable, "-c", example], env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert re.match(r"\(\d+, \d+\)\n\[", r.stdout), r.stdout
