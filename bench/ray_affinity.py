"""Follow-up turn latency on Ray Serve with conversation affinity vs round-robin: two engine replicas of the demo model
on the CPU (a local Ray instance), three conversations of six turns interleaved turn by turn, the first message about
1.7K tokens so the history reaches about 2K by the last turn. Per follow-up turn: time to the first token (the prompt
read: what affinity saves), the whole reply's time, and the replica that served it. Round-robin is the same deployment
with the ingress's routing setting changed (the engine replicas are not restarted).

    python bench/ray_affinity.py [--turns 6] [--out bench/results/ray_affinity_cpu.json]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import openai

from results_file import stamp, write

SETTINGS = dict(parallel=2, prefill=64, max_context=4096, queue_limit=8, cpus_per_replica=0.5, checkpoint_every=512)
WORDS = ("river lake stone bridge meadow forest harbour lantern valley orchard mountain glacier canyon delta marsh "
         "prairie tundra reef island summit").split()


def text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3 + i // 5) % len(WORDS)] for i in range(words))


def run(client, tag: str, turns: int, first_words: int) -> list[dict]:
    histories = [[{"role": "user", "content": f"{tag} {c}: " + text(c, first_words)}] for c in range(3)]
    rows = []
    for turn in range(turns):
        for c, h in enumerate(histories):
            t0 = time.perf_counter()
            raw = client.chat.completions.with_raw_response.create(model="demo", messages=h, temperature=0,
                                                                   max_tokens=16, stream=True,
                                                                   stream_options={"include_usage": True})
            first, reply, usage = None, [], None
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter()
                    reply.append(chunk.choices[0].delta.content)
                if chunk.usage:
                    usage = chunk.usage
            end = time.perf_counter()
            rows.append({"conversation": c, "turn": turn + 1, "replica": raw.headers.get("x-strata-replica"),
                         "prompt_tokens": usage.prompt_tokens, "ttft_ms": ((first or end) - t0) * 1000,
                         "total_ms": (end - t0) * 1000})
            h += [{"role": "assistant", "content": "".join(reply)},
                  {"role": "user", "content": f"Turn {turn + 1}: " + text(turn + 10 * c, 20)}]
    return rows


def summary(rows: list[dict]) -> dict:
    follow = [r for r in rows if r["turn"] > 1]
    moved = sum(1 for a in rows for b in rows if b["conversation"] == a["conversation"] and b["turn"] == a["turn"] + 1
                and b["replica"] != a["replica"])
    return {"follow_up_ttft_ms_median": statistics.median(r["ttft_ms"] for r in follow),
            "follow_up_total_ms_median": statistics.median(r["total_ms"] for r in follow),
            "first_turn_ttft_ms_median": statistics.median(r["ttft_ms"] for r in rows if r["turn"] == 1),
            "turns_on_another_replica_than_the_previous": moved, "follow_up_turns": len(follow)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first-words", type=int, default=450, help="words of each conversation's first message")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import ray
    from ray import serve

    from strata.config import Settings
    from strata.serve.ray_app import application

    cache = tempfile.mkdtemp(prefix="strata-ray-bench-")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 << 20, log_to_driver=False,
             runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    result = {**stamp(), "settings": SETTINGS, "turns": args.turns, "conversations": 3, "replicas": 2}
    try:
        for routing in ("affinity", "round_robin"):
            serve.run(application(Settings.build(**SETTINGS, replicas=2, routing=routing, compile_cache=cache)),
                      name="strata", route_prefix="/")
            rows = run(client, routing, args.turns, args.first_words)
            result[routing] = {"summary": summary(rows), "turns": rows}
            print(routing, result[routing]["summary"], flush=True)
        a, r = result["affinity"]["summary"], result["round_robin"]["summary"]
        result["round_robin_over_affinity_follow_up_ttft"] = r["follow_up_ttft_ms_median"] / a["follow_up_ttft_ms_median"]
        result["round_robin_over_affinity_follow_up_total"] = (r["follow_up_total_ms_median"]
                                                               / a["follow_up_total_ms_median"])
    finally:
        serve.shutdown()
        ray.shutdown()
    write(result, args.out, "ray_affinity_cpu")


if __name__ == "__main__":
    main()
