"""The peer a user could pick: Hugging Face transformers' Qwen3-Next on the same GPU and shapes.

    python bench/transformers_speed.py --layers 4,8 --out OUT.json    # GPU: Qwen3-Next-80B-A3B shapes, bf16
    python bench/transformers_speed.py --smoke                        # tiny shapes on a CPU: checks the script

Random weights at Qwen3-Next-80B-A3B shapes (bf16, every expert on the GPU), with fewer layers than 48 (the 3:1
linear:full pattern kept); as in engine_speed, the 48-layer figures are the least-squares line over the layer counts
(fixed part + 48 x the time per layer). Prompt: one forward over the prompt with the cache on; decode: one token at
a time after it, greedy, through the model's own cache (time per token with a device sync per token, as a
generate loop does). Whatever kernels transformers picks on this machine (without flash-linear-attention installed
it runs its PyTorch fallback of the gated delta rule) is what a user gets.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file  # noqa: E402
from engine_speed import REAL_LAYERS  # noqa: E402
from strata.demo import QWEN3_NEXT_80B  # noqa: E402


def hf_config(n_layers: int, smoke: bool):
    from transformers import Qwen3NextConfig
    c = dict(QWEN3_NEXT_80B, num_hidden_layers=n_layers)
    if smoke:
        c.update(num_experts=8, vocab_size=512, hidden_size=128, moe_intermediate_size=64, intermediate_size=128,
                 shared_expert_intermediate_size=64, num_attention_heads=2, head_dim=64, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, num_experts_per_tok=2)
    c.pop("model_type")
    interval = c.pop("full_attention_interval")
    c["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    return Qwen3NextConfig(**c)


def measure(n_layers: int, prompt_len: int, decode_tokens: int, smoke: bool) -> dict:
    import torch
    from transformers import Qwen3NextForCausalLM
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = hf_config(n_layers, smoke)
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen3NextForCausalLM(cfg).to(dtype).eval()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), device=dev)
    with torch.inference_mode():
        out = model(ids[:, :64], use_cache=True)             # warm-up: kernels load, caches allocate
        sync()
        t = time.perf_counter()
        out = model(ids, use_cache=True)
        sync()
        prompt_s = time.perf_counter() - t
        cache = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        for i in range(3):                                   # warm-up of the one-token shapes
            out = model(tok, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        sync()
        t = time.perf_counter()
        for i in range(decode_tokens):
            out = model(tok, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            int(tok[0, 0])                                   # the token reaches the host, as a server's would
        decode_s = (time.perf_counter() - t) / decode_tokens
    del model, cache, out
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"prompt_tokens": prompt_len, "prompt_s": prompt_s, "prompt_tok_s": prompt_len / prompt_s,
            "decode_s_per_token": decode_s, "decode_tok_s_b1": 1.0 / decode_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="4,8", help="layer counts (each with a full-attention layer: 4 or more)")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    import transformers
    prompt = 64 if args.smoke else args.prompt
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"bench": "transformers_speed", "date": results_file.stamp()["date"], "commit": results_file.commit(),
              "machine": f"{dev} (torch {torch.__version__}, transformers {transformers.__version__})",
              "model": "Qwen3NextForCausalLM, random weights at Qwen3-Next-80B-A3B shapes" +
                       (" (smoke: tiny shapes)" if args.smoke else ""),
              "dtype": "bfloat16" if torch.cuda.is_available() else "float32", "layers": {}}
    counts = [int(x) for x in args.layers.split(",")]
    # an untimed first run: the first model in a process pays for library set-up (cuBLAS handles, the allocator's
    # growth, first-call kernel choices); on the H200 it made 4 layers read slower than 8 (3,836 against 49,512 tok/s)
    measure(counts[0], prompt, 2, args.smoke)
    for n in counts:
        r = measure(n, prompt, args.decode, args.smoke)
        result["layers"][n] = r
        print(f"  {n} layers: prompt {prompt} tokens {r['prompt_tok_s']:.0f} tok/s, decode "
              f"{r['decode_tok_s_b1']:.2f} tok/s", flush=True)
    ns = np.array(sorted(result["layers"]), float)
    for key, per in (("prompt_s", "prompt"), ("decode_s_per_token", "decode")):
        ts = np.array([result["layers"][int(n)][key] for n in ns])
        slope, fixed = np.polyfit(ns, ts, 1) if len(ns) > 1 else (ts[0] / ns[0], 0.0)
        result[f"{per}_s_per_layer"], result[f"{per}_s_fixed"] = float(slope), float(fixed)
        result[f"{per}_s_48_layers"] = float(fixed + REAL_LAYERS * slope)
    result["prompt_tok_s_48_layers"] = prompt / result["prompt_s_48_layers"]
    result["decode_tok_s_b1_48_layers"] = 1.0 / result["decode_s_48_layers"]
    print(f"transformers, 48 layers (scaled): prompt {result['prompt_tok_s_48_layers']:.0f} tok/s, decode b1 "
          f"{result['decode_tok_s_b1_48_layers']:.2f} tok/s")
    results_file.write(result, args.out, "transformers_speed" + ("_smoke" if args.smoke else "_h200"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
