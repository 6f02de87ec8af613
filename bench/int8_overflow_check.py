"""GPU check of decode_attention's plane form: an int8 cache [16, 262208, 2, 256] (2^31 .. 2^32 bytes, int8 offsets
overflow int32) read at position 262000 by 16 rows; rows 0 and 15 (15 reads past 2^31 bytes) against _reference.
Prints each row's relative error against the bound the kernel tests use, and whether the int32 view of the caches is
free: the compiled call's temporaries (a copy would add 2 x 2.1 GB), its copies and bitcast-converts left in the
optimized HLO (0 when the view became a bitcast); and the call's time against the HBM floor (its K, V and scale
bytes read once at 3.6 TB/s). Usage: python bench/int8_overflow_check.py"""
import time

import jax
import jax.numpy as jnp
import numpy as np

from strata.jax_backend.kernels import decode_attention as K

S, CAP, HKV, HD, HQ, POS = 16, 262208, 2, 256, 16, 262000
BOUND = 2.0 ** -8 * (1 + 1e-5) + 1e-5          # tests/kernels/test_decode_attention.py LIMIT["bfloat16"]
keys = jax.random.split(jax.random.key(0), 5)
kc, vc = (jax.random.randint(k, (S, CAP, HKV, HD), -127, 128, jnp.int8) for k in keys[:2])
ks, vs = (jax.random.uniform(k, (S, CAP, HKV), jnp.float32, 0.01, 0.03) for k in keys[2:4])
q = jax.random.normal(keys[4], (S, 1, HQ, HD), jnp.bfloat16)
pos = jnp.full((S,), POS, jnp.int32)
assert K.int8_planes_needed(kc.shape)
call = K.decode_attention.lower(q, kc, vc, ks, vs, pos, scale=HD ** -0.5).compile()
hlo = call.as_text()
print("temp bytes", call.memory_analysis().temp_size_in_bytes, "copies", hlo.count(" copy("), "bitcast-converts",
      hlo.count("bitcast-convert("))
out = np.asarray(call(q, kc, vc, ks, vs, pos).astype(jnp.float32))
for i in (0, S - 1):
    r = slice(i, i + 1)
    want = K._reference(q[r], kc[r, :POS + 1], vc[r, :POS + 1], ks[r, :POS + 1], vs[r, :POS + 1], pos[r], HD ** -0.5)
    err = np.linalg.norm(out[r] - want) / np.linalg.norm(want)
    print(f"row {i}: relative error {err:.2e}, within {BOUND:.2e}: {err <= BOUND}, finite: {np.isfinite(out[r]).all()}")
call(q, kc, vc, ks, vs, pos).block_until_ready()
t0 = time.perf_counter()
for _ in range(10):
    call(q, kc, vc, ks, vs, pos).block_until_ready()
took, floor = (time.perf_counter() - t0) / 10, S * (POS + 1) * HKV * (2 * HD + 8) / 3.6e12
print(f"decode_attention {took * 1e3:.3f} ms, HBM floor {floor * 1e3:.3f} ms ({floor / took:.0%} of it)")
