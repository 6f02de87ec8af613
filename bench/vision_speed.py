"""The vision tower's time for one image (default 1024 x 1024: 4,096 patches, 1,024 tokens), beside its floor: random
weights at the released tower's shapes (Qwen3.5 / Qwen3.8-Flash-Next: 27 blocks of 1152, 16-pixel patches, merged
2 x 2) or at a demo model's size, in the weights' dtype (bf16 on a GPU, f32 on a CPU). Times decode + preprocess of a
PNG data URL (strata/vision/image.py) and the tower (strata/engine/images.py, compiled once per grid).

    python bench/vision_speed.py --shape demo          # CPU: a tower sized like the demo model's layers
    python bench/vision_speed.py --shape release       # GPU (or a patient CPU)

Floor: the tower's FLOPs (2 x parameters a patch for the linear maps, plus attention's 4 x patches^2 x width a
block) over the measured bf16/f32 matmul rate. Writes JSON to bench/results/ (or --out).
"""
from __future__ import annotations

import argparse
import base64
import io
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_speed  # noqa: E402  (bench/, beside this script)
import flash_speed  # noqa: E402
import results_file  # noqa: E402

SHAPES = {
    "release": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048,
                    patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304),
    "demo": dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=256, patch_size=16,
                 temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304),
}


class _Reader:
    """TensorReader's get for random weights of the asked shape (fan-in scaled)."""

    def __init__(self, dtype, seed: int = 0):
        self.dtype, self.rng = dtype, np.random.default_rng(seed)

    def get(self, name, shape, dtype=None):
        a = self.rng.standard_normal(shape, dtype=np.float32)
        a = a / np.sqrt(shape[-1]) if len(shape) > 1 else a * 0.1 + ("norm" in name and name.endswith("weight"))
        return a.astype(dtype or self.dtype)


def tower_flops(v: dict, patches: int) -> float:
    h, f, m = v["hidden_size"], v["intermediate_size"], v["spatial_merge_size"] ** 2
    per_patch = 2 * (3 * v["patch_size"] ** 2 * v["temporal_patch_size"] * h
                     + v["depth"] * (4 * h * h + 2 * h * f))
    merger = 2 * (patches // m) * (h * m * h * m + h * m * v["out_hidden_size"])
    return per_patch * patches + merger + v["depth"] * 4 * patches ** 2 * h


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="demo", choices=sorted(SHAPES))
    ap.add_argument("--size", type=int, default=1024, help="the image's width and height in pixels")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from PIL import Image as PILImage

    from strata.backend import get_backend
    from strata.engine.images import Image, ImageEncoder
    from strata.model.vision import VisionConfig, vision_params
    from strata.vision.image import ImageSettings, decode_data_url, image_hash, preprocess
    say = engine_speed.say
    ops = get_backend("jax")
    gpu = ops.device.platform == "gpu"
    dtype = "bfloat16" if gpu else "float32"
    out = {"bench": "vision_speed", **results_file.stamp(), "shape": args.shape, "image_pixels": args.size ** 2,
           "dtype": dtype, "tower": SHAPES[args.shape]}
    name = f"vision_speed_{args.shape}_{'gpu' if gpu else 'cpu'}"
    v = SHAPES[args.shape]
    vc = VisionConfig.from_config({"model_type": "qwen3_5_moe", "vision_config": v}, "bench")
    import ml_dtypes
    params = ops.to_device(vision_params(vc, _Reader(ml_dtypes.bfloat16 if gpu else np.float32)))
    rgb = np.random.default_rng(0).integers(0, 256, (args.size, args.size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PILImage.fromarray(rgb).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    settings = ImageSettings()
    t = time.perf_counter()
    for _ in range(args.repeat):
        patches, grid = preprocess(decode_data_url(url, settings.max_pixels), settings)
    out["preprocess_s"] = (time.perf_counter() - t) / args.repeat
    say(f"decode + preprocess of a {args.size} x {args.size} PNG: {out['preprocess_s'] * 1e3:.0f} ms, grid {grid}")
    enc = ImageEncoder(ops, vc, params, keep=0)
    image = Image(patches, grid)
    t = time.perf_counter()
    enc.encode(image)
    out["first_encode_s"] = time.perf_counter() - t              # compiles the tower for this grid
    out["tower_s"] = engine_speed.timed(lambda: enc.encode(image), args.repeat)
    out["tokens"] = int(np.prod(grid)) // vc.merge ** 2
    rate = flash_speed.matmul_rate()
    out["matmul_flop_per_s"] = rate
    out["tower_flops"] = tower_flops(v, int(np.prod(grid)))
    out["tower_floor_s"] = out["tower_flops"] / rate
    out["fraction_of_floor"] = out["tower_floor_s"] / out["tower_s"]
    hit = Image(patches, grid, key=image_hash(rgb))
    cached = ImageEncoder(ops, vc, params)
    cached.encode(hit)
    out["cached_encode_s"] = engine_speed.timed(lambda: cached.encode(hit), args.repeat)
    say(f"tower ({args.shape}): first {out['first_encode_s']:.2f} s (compiles), then {out['tower_s'] * 1e3:.1f} ms for "
        f"{out['tokens']} tokens; floor {out['tower_floor_s'] * 1e3:.1f} ms ({out['tower_flops'] / 1e12:.2f} TFLOP at "
        f"{rate / 1e12:.1f} TFLOP/s: {100 * out['fraction_of_floor']:.0f}%); the same image again "
        f"{out['cached_encode_s'] * 1e6:.0f} us (cached)")
    results_file.write(out, args.out, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
