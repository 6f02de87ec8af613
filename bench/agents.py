"""Coding agents sharing a prompt: N agents start from one long system prompt with tool definitions, each runs a
conversation of T turns (a forced tool call, then its result; every third turn a user message) on fewer slots than
agents, all at once, through `strata serve` and the openai client. Reports the prompt tokens reused
(usage.prompt_tokens_details.cached_tokens) against the most that could be (each prompt's longest prefix shared
with an earlier request's prompt, and up to its reply's length more where it continues that prompt whole), TTFT by
turn, the total time, and a follow-up turn's TTFT alone against a cold prompt of its new tokens alone.

    python bench/agents.py                                   # tiny on the CPU: 8 agents, 4 slots, 8K system, 10 turns
    python bench/agents.py --model random:qwen3-next-80b-a3b --serve-args "--experts int4"       # a GPU

Writes JSON (machine, date, commit, figures) to --out; agents_reuse_fraction and agents_followup_ttft_ratio are
SUMMARY.json's keys.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import results_file  # noqa: E402  (bench/, beside this script)
from serve_load import free_port, wait_healthy  # noqa: E402

from strata.builtin import builtin_dir  # noqa: E402
from strata.sched.prompt_cache import common_prefix  # noqa: E402
from strata.serve import openai_api as oa  # noqa: E402
from strata.tokenizer import Tokenizer  # noqa: E402

FILES = ["src/app.py", "src/db.py", "src/api.py", "src/auth.py", "tests/test_app.py", "tests/test_db.py",
         "README.md", "setup.cfg", "src/util.py", "src/cli.py", "docs/index.md", "Makefile"]
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string", "enum": FILES}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run a test suite.",
                                      "parameters": {"type": "object", "properties": {
                                          "suite": {"type": "string", "enum": ["unit", "integration", "all"]}},
                                                     "required": ["suite"]}}},
    {"type": "function", "function": {"name": "list_dir", "description": "List a directory.",
                                      "parameters": {"type": "object", "properties": {
                                          "dir": {"type": "string", "enum": ["src", "tests", "docs", "."]}},
                                                     "required": ["dir"]}}},
]
RULE = ("Rule {i}: before changing {f}, read it and the tests that cover it; keep each change small, run the unit "
        "suite after it, and report what failed with the file and line. Never edit generated files. ")


def say(line: str) -> None:
    print(line, flush=True)


def system_prompt(tok: Tokenizer, target: int) -> str:
    """Rules until the system message with the tools renders to about `target` tokens."""
    rules = []
    while True:
        rules.append(RULE.format(i=len(rules) + 1, f=FILES[len(rules) % len(FILES)]))
        if len(rules) % 8 == 0:
            n = len(tok.encode_chat([{"role": "system", "content": "".join(rules)}], tools=TOOLS)[1])
            if n >= target:
                return "".join(rules)


def tool_result(agent: int, turn: int, name: str, words: int) -> str:
    rng = np.random.default_rng(1000 * agent + turn)
    lines = [f"{name} output, agent {agent}, step {turn}:"]
    lines += [f"line {i}: " + " ".join(rng.choice(["ok", "value", "def", "return", "self", "None", "x", "import",
                                                  "error", "assert", "=", "(", ")"], 8)) for i in range(words // 10)]
    return "\n".join(lines)


class Agents:
    def __init__(self, base: str, tok: Tokenizer, args):
        self.client = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=3600)
        self.tok, self.args = tok, args
        self.seen: list[list] = []               # what earlier requests showed the server: [prompt ids, reply tokens]
        self.rows: list[dict] = []

    def render(self, messages: list[dict], prompt: bool = True) -> list[int]:
        body = oa.ChatRequest.model_validate({"model": "default", "messages": messages, "tools": TOOLS})
        return self.tok.encode_chat(body.message_dicts, add_generation_prompt=prompt, tools=TOOLS)[1]

    async def ask(self, messages: list[dict], agent: int, turn: int, record: bool = True, tools=True,
                  **kw) -> tuple[dict, dict]:
        ids = self.render(messages)
        reusable = min(max([self._shared(s, ids) for s in self.seen], default=0), len(ids) - 1)
        seen = [ids, 0]
        if record:                               # the server sees the prompt from now on, its reply later
            self.seen.append(seen)
        t0 = time.perf_counter()
        ttft, content, calls, usage = None, "", {}, None
        stream = await self.client.chat.completions.create(
            model="default", messages=messages, stream=True, max_tokens=self.args.reply,
            stream_options={"include_usage": True}, temperature=0, **(dict(tools=TOOLS) if tools else {}), **kw)
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                d = ch.delta
                if ttft is None and (d.content or d.tool_calls):
                    ttft = time.perf_counter() - t0
                content += d.content or ""
                for c in d.tool_calls or []:
                    x = calls.setdefault(c.index, {"id": "", "name": "", "arguments": ""})
                    x["id"] = c.id or x["id"]
                    x["name"] += (c.function.name or "") if c.function else ""
                    x["arguments"] += (c.function.arguments or "") if c.function else ""
        total = time.perf_counter() - t0
        reply = {"role": "assistant", "content": content or None}
        if calls:
            reply["tool_calls"] = [{"id": x["id"], "type": "function",
                                    "function": {"name": x["name"], "arguments": x["arguments"]}}
                                   for _, x in sorted(calls.items())]
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        row = dict(agent=agent, turn=turn, prompt_tokens=usage.prompt_tokens, rendered=len(ids), reusable=reusable,
                   cached=cached, completion_tokens=usage.completion_tokens, ttft_s=ttft or total, total_s=total)
        if record:
            self.rows.append(row)
            seen[1] = usage.completion_tokens
        return reply, row

    @staticmethod
    def _shared(seen: list, ids: list[int]) -> int:
        """The most of ids a server that saw a prompt and its reply of n tokens can hold: their shared prefix, and
        when ids continue the whole prompt, up to n tokens more (the reply's tokens, where ids repeat them)."""
        prompt, n = seen
        shared = common_prefix(prompt, ids)
        return shared + n if shared == len(prompt) else shared

    async def agent(self, a: int, system: str, turns: int) -> list[dict]:
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": f"Task {a}: the unit suite fails in module {FILES[a % len(FILES)]}; "
                                                f"find out why and fix it."}]
        for k in range(turns):
            reply, _ = await self.ask(messages, a, k, tool_choice="required")
            messages.append(reply)
            for call in reply.get("tool_calls", []):
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": tool_result(a, k, call["function"]["name"], self.args.result_words)})
            if k % 3 == 2 or not reply.get("tool_calls"):
                messages.append({"role": "user", "content": f"Step {k} of task {a}: go on, and keep it small."})
        return messages


async def run(base: str, tok: Tokenizer, args) -> dict:
    agents = Agents(base, tok, args)
    system = system_prompt(tok, args.system_tokens)
    t0 = time.perf_counter()
    convs = await asyncio.gather(*(agents.agent(a, system, args.turns) for a in range(args.agents)))
    total = time.perf_counter() - t0
    rows = agents.rows
    reused, reusable = sum(r["cached"] for r in rows), sum(r["reusable"] for r in rows)
    say(f"{args.agents} agents x {args.turns} turns in {total:.1f} s: {reused} of {reusable} reusable prompt tokens "
        f"reused ({reused / max(reusable, 1):.3f}), {sum(r['prompt_tokens'] for r in rows)} prompt tokens in all")
    by_turn = {k: float(np.median([r["ttft_s"] for r in rows if r["turn"] == k]) * 1000) for k in range(args.turns)}
    # a follow-up turn alone against a cold prompt of its new tokens alone (nothing else running)
    ratios, samples = [], []
    for a in range(min(args.followups, args.agents)):
        follow = convs[a] + [{"role": "user", "content": f"Last step of task {a}: summarise the fix."}]
        _, row = await agents.ask(follow, a, args.turns, record=False)
        new = row["prompt_tokens"] - row["cached"]
        cold_text = " ".join(f"w{(a * 7919 + i) % 997}" for i in range(new * 2))
        cold_ids = tok.encode(cold_text)[:max(new - 5, 1)]             # (the template's markers: about 5)
        _, cold = await agents.ask([{"role": "user", "content": tok.decode(cold_ids)}], a, -1, record=False,
                                   tools=False, extra_body={"cache_prompt": False})
        ratios.append(row["ttft_s"] / cold["ttft_s"])
        samples.append(dict(followup=row, cold=cold))
        say(f"follow-up of agent {a}: {row['prompt_tokens']} prompt tokens, {row['cached']} reused, {new} read: TTFT "
            f"{row['ttft_s'] * 1000:.0f} ms; a cold prompt of {cold['prompt_tokens']} tokens alone "
            f"{cold['ttft_s'] * 1000:.0f} ms: ratio {ratios[-1]:.2f}")
    async with httpx.AsyncClient() as c:
        metrics = (await c.get(base + "/metrics")).text
    cache = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
             if line.startswith(("strata_prompt_cache", "strata_checkpoints", "strata_conversations"))
             and len(line.split()) == 2}
    return dict(agents=args.agents, slots=args.slots, turns=args.turns, system_tokens=len(agents.render(
        [{"role": "system", "content": system}], prompt=False)), total_s=total,
        reused_tokens=reused, reusable_tokens=reusable, agents_reuse_fraction=reused / max(reusable, 1),
        ttft_ms_by_turn=by_turn, first_turn_ttft_ms=[r["ttft_s"] * 1000 for r in rows if r["turn"] == 0],
        agents_followup_ttft_ratio=float(np.median(ratios)) if ratios else None, followups=samples, rows=rows,
        cache_metrics=cache)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system-tokens", type=int, default=8192)
    ap.add_argument("--result-words", type=int, default=120, help="words of each tool result")
    ap.add_argument("--reply", type=int, default=48, help="max_tokens of each reply")
    ap.add_argument("--followups", type=int, default=3, help="follow-up turns timed alone at the end")
    ap.add_argument("--max-context", type=int, default=16384)
    ap.add_argument("--serve-args", default="", help="more `strata serve` flags")
    ap.add_argument("--base", default=None, help="an already running server (else one is started)")
    ap.add_argument("--out", default=None, help="JSON file to write (default bench/results/agents.json)")
    args = ap.parse_args()
    tok = Tokenizer.from_dir(builtin_dir(args.model) or args.model)
    proc, base = None, args.base
    if base is None:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "strata.cli", "serve", "--model", args.model, "--parallel", str(args.slots),
               "--max-context", str(args.max_context), "--port", str(port), *shlex.split(args.serve_args)]
        say("starting: " + " ".join(cmd))
        proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr, env=dict(os.environ))
        if not wait_healthy(base, proc, 1800):
            raise SystemExit(f"the server exited with {proc.returncode}")
    stamp = results_file.stamp()
    try:
        out = asyncio.run(run(base, tok, args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    results_file.write(dict(bench="agents", **stamp, model=args.model, serve_args=args.serve_args, **out),
                       args.out, "agents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
