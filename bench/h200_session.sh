#!/usr/bin/env bash
# One lent H200 call per part (each ends well inside a 10-minute call), writing JSON and logs under $OUT (or ./out):
#   bash bench/h200_session.sh kernels   # bench/kernel_speed.py, the families untimed in their v2 forms first
#   bash bench/h200_session.sh gdn       # the XLA chunked delta rule at other chunks, and its GPU tests
#   bash bench/h200_session.sh engine-gdn  # engine with the XLA chunked rule at GDN_CHUNK (128)
#   bash bench/h200_session.sh engine48  # engine_speed at all 48 layers, kernels auto (~39 GB of int4 experts)
#   bash bench/h200_session.sh decode-kernels  # the decode expert op (rows, warps) and the routing kernel
#   bash bench/h200_session.sh decode-experts  # the int4 decode expert op against XLA's form (rows, warps)
#   bash bench/h200_session.sh kernel-tests  # the kernel tests compiled on the GPU (STRATA_TEST_DEVICE=gpu)
#   bash bench/h200_session.sh engine    # bench/engine_speed.py at real shapes, int4 experts, kernels auto at 8 and
#                                        # 12 layers (~170 s; the .partial file keeps what ends). Not 4: its 3.4 GB
#                                        # expert pool is read through compacted copies (2^31..2^32 bytes), which
#                                        # slowed its prompt parts by 1 ms a layer and made 4/8-layer fits optimistic
#   bash bench/h200_session.sh engine-nocb # the same with XLA's command buffers off: the prompt figure against
#                                        # engine's (an 8-layer part's kernels took 41 ms, 51 ms in the probe with
#                                        # them off, 61 ms in engine_speed with them on); never a headline (xla_flags)
#   bash bench/h200_session.sh engine-xla  # the same, kernels xla, and bench/transformers_speed.py at 4 and 8 layers
#   bash bench/h200_session.sh probe     # bench/launch_probe.py: where a decode token's time goes (traces, XLA flags)
#   bash bench/h200_session.sh copies    # bench/launch_probe.py's copy probes (device_put, kernel, kernel on stream 1)
#   bash bench/h200_session.sh offload   # bench/offload_speed.py, uniform routing, decode at batch 1 and 4
#   bash bench/h200_session.sh offload-stream  # offload_speed: uniform b1 with 4K and 32K prompts streaming whole
#                                        # layers, then skewed b1 and b4 (EXTRA=--no-stream-parts: misses through loans)
#   bash bench/h200_session.sh probe48   # prompt_probe (with the stream's gaps) at 48 layers
#   bash bench/h200_session.sh routes48  # engine48 with decode_expert_max_routes 320 (16 and 32 rows through the
#                                        # decode expert kernel, not the grouped one): a comparison run
#   bash bench/h200_session.sh serve     # bench/serve_load.py: `strata serve --model random:qwen3-next-80b-a3b`
#                                        # (48 layers, int4), 1, 4 and 16 streaming clients of 256 tokens (TOKENS)
#   bash bench/h200_session.sh spec      # bench/spec_speed.py at 48 layers, int4: verify 4+1 (and 1+1, 2+1 at batch 1)
#                                        # against 1-token windows at batch 1, 4, 16; the JSON rewritten as it goes
#   bash bench/h200_session.sh spec-probe  # prompt_probe --verify 4: a verify window's kernels by part of the layer
#                                        # against a 1-token window's (8 layers, batch 1 and 4)
#   bash bench/h200_session.sh overlap   # bench/overlap_probe.py: copies issued outside a compiled window beside compute
#   bash bench/h200_session.sh split     # bench/split_speed.py at 48 layers, int4, both stages on the one H200
#                                        # (--split 24 --one-device): decode b1/b4 and a 4K part, split vs not
#   bash bench/h200_session.sh long      # bench/long_decode.py: the host KV tier's forms at 128K and 256K (XLA's default
#                                        # allocator), then decode at 32K/128K/256K, batch 1/4/16, all KV on the device,
#                                        # 48 layers, and a 128K prompt read; each JSON rewritten as it goes
#   bash bench/h200_session.sh long-tier # bench/long_decode.py with kv_resident 16384 (XLA's default allocator): decode
#                                        # at 32K/128K (bf16, batch 1/4/16: 58 GB pinned) and 256K (bf16 and int8,
#                                        # batch 1), a 128K prompt read
#   bash bench/h200_session.sh prompt-long  # kernel_speed's prompt attention for a 4K part at 0, 32K and 124K (a long
#                                        # prompt's later parts, a follow-up turn), in block / warp cases
#   bash bench/h200_session.sh splits    # decode attention over n_splits (bf16, 32K and 128K, batch 1/4/16), then
#                                        # long_decode's 128K windows with the module's choice
#   bash bench/h200_session.sh prompts   # the prompt path's kernel tests compiled on the GPU, then bench/prompt_speed.py:
#                                        # 4K, 32K and 128K prompts in 4K parts (48 layers, int4), each part's time and
#                                        # floor, and VARIANTS (KernelConfig comparisons) at 4K and 32K
#   bash bench/h200_session.sh flash     # bench/flash_speed.py: Qwen3.8-Flash-Next at real shapes (random weights)
#   bash bench/h200_session.sh agents    # bench/agents.py: `strata serve --model random:qwen3-next-80b-a3b`, 8 agents on
#                                        # 4 slots sharing an 8K system prompt, 10 turns each (carry .wheels/, as serve)
#   bash bench/h200_session.sh scopes    # bench/prompt_probe.py: a prompt part's and a decode window's kernels by
#                                        # part of the layer, against each part's floor (8 layers, ~40 s warm)
# Copy what comes back into bench/results/ and run python bench/summary.py.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# the commit the results are labelled with: set it here (STRATA_COMMIT=<sha> bash bench/h200_session.sh ...). The
# lent machine's copy answers git rev-parse with the session's first commit, not the tree it was sent (da9d40d ran
# labelled 35253ad), so without it the label says so
export STRATA_COMMIT=${STRATA_COMMIT:-"$(git rev-parse --short HEAD 2>/dev/null || echo unknown)?"}
case "${1:-}" in
  kernels)    # ~340 s covered the expert families and half of decode attention at 6b277c5; the JSON is rewritten
              # after each family, so a run cut off at its limit keeps what it measured
    timeout 560 python3 bench/kernel_speed.py --only decode_attention,expert_decode,expert_grouped \
      --out "$OUT/kernel_speed_h200.json" 2>&1 | grep -E "^(expert|decode|pool|wrote)|FAILED" \
      | tee "$OUT/kernel_speed.log"
    ;;
  gdn)        # the backend's XLA chunked delta rule at other chunks, and its tests compiled
    timeout 300 python3 bench/kernel_speed.py --only gated_delta_chunked --out "$OUT/kernel_speed_gated_delta_h200.json" \
      2>&1 | grep -E "^(gated|wrote)|FAILED" | tee "$OUT/kernel_speed_gated_delta.log"
    STRATA_TEST_DEVICE=gpu timeout 200 python3 -m pytest -q -n 8 tests/kernels/test_gated_delta.py \
      -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/gpu_gated_delta_tests.log" | grep -E "passed|failed|Error" \
      | head -20
    ;;
  decode-kernels) # the decode path's kernels: the expert op (rows and warps a program) and the routing;
              # then their tests and the engine's, compiled on the GPU
    timeout 330 python3 bench/kernel_speed.py --only route,expert_decode \
      --out "$OUT/kernel_speed_decode_h200.json" 2>&1 | grep -E "^(expert|route|wrote)|FAILED" \
      | tee "$OUT/kernel_speed_decode.log"
    STRATA_TEST_DEVICE=gpu timeout 200 python3 -m pytest -q -n 8 \
      tests/kernels/test_expert_decode.py tests/kernels/test_route.py tests/kernels/test_engine_kernels.py \
      -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/gpu_decode_kernel_tests.log" \
      | grep -E "passed|failed|FAILED|Error" | head -20
    ;;
  decode-experts) # the int4 decode expert op alone: XLA's form (blob_matvec) against the kernel over rows and warps,
              # at 1, 2, 4 and 16 tokens, each call of the chain reading other experts (from HBM); then the op's
              # tests and the engine's kernel tests compiled on the GPU
    timeout 300 python3 bench/kernel_speed.py --only expert_decode \
      --out "$OUT/kernel_speed_decode_experts_h200.json" 2>&1 | grep -E "^(expert|wrote)|FAILED" \
      | tee "$OUT/kernel_speed_decode_experts.log"
    STRATA_TEST_DEVICE=gpu timeout 200 python3 -m pytest -q -n 8 tests/kernels/test_expert_decode.py \
      tests/kernels/test_engine_kernels.py -p no:cacheprovider -o addopts="" 2>&1 \
      | tee "$OUT/gpu_decode_expert_tests.log" | grep -E "passed|failed|FAILED|Error" | head -20
    ;;
  trace-experts) # the decode expert op's kernels under the profiler: XLA's form and the kernel (8 rows, 4 warps)
              # at 1, 2, 4 and 16 tokens, each kernel's count and time
    timeout 200 python3 bench/kernel_speed.py --only expert_decode --decode-cases 8:4 \
      --trace-decode 8:4 --out "$OUT/kernel_trace_decode_experts_h200.json" 2>&1 \
      | grep -E "^(expert|wrote|trace|  )|FAILED" | grep -v "0.000 ms" | tee "$OUT/kernel_trace_decode_experts.log"
    ;;
  kernel-tests)
    STRATA_TEST_DEVICE=gpu timeout 400 python3 -m pytest -q -n 8 tests/kernels -p no:cacheprovider -o addopts="" \
      2>&1 | tee "$OUT/gpu_kernel_tests.log" | grep -E "passed|failed|FAILED|Error" | head -40
    ;;
  engine)
    timeout 400 python3 bench/engine_speed.py --real-shapes --experts int4 --layers 8,12 --prompt 4096 --repeat 3 \
      --kernels auto --out "$OUT/engine_speed_real_shapes_int4_auto.json" 2>&1 | grep -E "layers:|\| |wrote|Error"
    ;;
  split)      # the layer split's hand-off and per-stage dispatch cost (every stage on the one GPU); the JSON is
              # rewritten after the unsplit engine's figures, so a run cut off keeps them
    timeout 560 python3 bench/split_speed.py --model random:qwen3-next-80b-a3b --split 24 --one-device \
      --windows 24 --repeat 3 --out "$OUT/split_speed_one_device_h200_48_layers.json" 2>&1 \
      | grep -E "split|layers|wrote|Error|\] " | tail -40
    ;;
  engine48)   # engine_speed at all 48 layers (int4 experts, 39 GB, fit one H200): measured, not fitted. Progress lines
              # carry the clock (compile times); the .partial file is rewritten after each figure
    timeout 560 python3 bench/engine_speed.py --real-shapes --experts int4 --layers 48 --prompt 4096 --repeat 3 \
      --kernels auto --out "$OUT/engine_speed_real_shapes_int4_auto_48_layers.json" 2>&1 \
      | grep -E "layers:|\] |\| |wrote|Error"
    ;;
  serve)      # the lent machine's image lacks the server's packages: carry .wheels/ (py3.12 wheels, installed
              # without their dependencies into .pylib)
    python3 -m pip install -q --no-deps --no-index --target .pylib .wheels/*.whl && export PYTHONPATH="$PWD/.pylib"
    # prefill 64 and short prompts: each prompt-part bucket compiles for ~20 s at 48 layers, and warm-up compiles all
    timeout 560 python3 bench/serve_load.py --model random:qwen3-next-80b-a3b --clients 1,4,16 --tokens "${TOKENS:-256}" \
      --prompt-words 8 --serve-args "--max-context 4096 --prefill 64" --server-log "$OUT/serve_server.log" \
      --out "$OUT/serve_load_h200_random_80b.json" 2>&1 | grep -vE "^INFO|^\s*$" | tail -40
    ;;
  agents)     # the server's packages from .wheels/ (as serve); the agents' prompts need 16K positions
    python3 -m pip install -q --no-deps --no-index --target .pylib .wheels/*.whl && export PYTHONPATH="$PWD/.pylib"
    timeout 560 python3 bench/agents.py --model random:qwen3-next-80b-a3b --out "$OUT/agents_random_80b.json" 2>&1 \
      | grep -vE "^INFO|^W1207|^\s*$" | tee "$OUT/agents.log" | grep -vE "strata serve: (prompt|parked|resumed)" | tail -40
    ;;
  routes48)
    timeout 560 python3 bench/engine_speed.py --real-shapes --experts int4 --layers 48 --prompt 4096 --repeat 3 \
      --kernels auto --decode-expert-max-routes 320 \
      --out "$OUT/engine_speed_real_shapes_int4_auto_48_layers_routes320.json" 2>&1 | grep -E "layers:|\] |\| |wrote|Error"
    ;;
  engine-gdn) # the XLA chunked rule at another chunk, a comparison run: GDN_CHUNK (default 128), LAYERS=8,12
    timeout 400 python3 bench/engine_speed.py --real-shapes --experts int4 --layers "${LAYERS:-8,12}" --prompt 4096 \
      --repeat 3 --kernels auto --gdn-chunk "${GDN_CHUNK:-128}" \
      --out "$OUT/engine_speed_real_shapes_int4_auto_gdn_${GDN_CHUNK:-128}.json" 2>&1 \
      | grep -E "layers:|\| |wrote|Error"
    ;;
  engine-nocb)  # LAYERS=8 for one point (the prompt part's time against engine's at the same layers)
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" timeout 400 python3 bench/engine_speed.py --real-shapes \
      --experts int4 --layers "${LAYERS:-8,12}" --prompt 4096 --repeat 3 --kernels auto \
      --out "$OUT/engine_speed_real_shapes_int4_auto_no_command_buffers.json" 2>&1 | grep -E "layers:|\| |wrote|Error"
    ;;
  engine-xla)
    timeout 300 python3 bench/engine_speed.py --real-shapes --experts int4 --layers 8,12 --prompt 4096 --repeat 3 \
      --kernels xla --out "$OUT/engine_speed_real_shapes_int4_xla.json" 2>&1 | grep -E "layers:|\| |wrote|Error"
    timeout 120 python3 bench/transformers_speed.py --layers 4,8 --out "$OUT/transformers_speed_h200.json" 2>&1 \
      | grep -E "layers|scaled|wrote|Error"
    ;;
  probe)
    timeout 480 python3 bench/launch_probe.py --out "$OUT/launch_probe_h200.json" 2>&1 | grep -vi warning
    ;;
  copies)     # bench/launch_probe.py's copy probes alone: pinned host rows copied beside matmuls in one function, by
              # device_put, by the host-rows kernel, and by that kernel on a second stream (stream annotation)
    timeout 200 python3 bench/launch_probe.py --variants "" --out "$OUT/launch_probe_copies_h200.json" 2>&1 \
      | grep -E "^copy|FAILED|Error|wrote"
    ;;
  overlap)    # bench/overlap_probe.py: host-to-device copies issued outside a compiled window (device_put from pinned or
              # pageable memory, a compiled copy, 8 chunks) beside ~20 ms of matmuls: does either hide the other?
    timeout 200 python3 bench/overlap_probe.py --out "$OUT/overlap_probe_h200.json" 2>&1 | grep -vE "^\s*$|^W1|^I1"
    ;;
  offload)
    timeout 540 python3 bench/offload_speed.py --runs uniform --batches 1,4 --prompts "" \
      --out "$OUT/offload_speed_h200_int4.json" 2>&1 | grep -vi warning | tail -20
    ;;
  offload-stream) # bench/offload_speed.py as issue 32 measures it, in two runs that end inside one call (~310 s):
              # uniform routing, decode at batch 1, prompts of 4K and 32K whose parts stream whole layers
              # (stream_parts); then skewed routing, decode at batch 1 and 4. EXTRA=--no-stream-parts: parts borrow
    timeout 250 python3 bench/offload_speed.py --runs uniform --batches 1 --warm 32 --prompts "${PROMPTS:-4096,32768}" \
      ${EXTRA:-} --out "$OUT/offload_speed_h200_int4_stream.json" 2>&1 | grep -vi warning | tee "$OUT/offload.log" \
      | grep -E "uniform:|\| uniform"
    timeout 270 python3 bench/offload_speed.py --runs skewed --batches 1,4 --warm 32 --prompts "" ${EXTRA:-} \
      --out "$OUT/offload_speed_h200_int4_skewed.json" 2>&1 | grep -vi warning | tee "$OUT/offload_skewed.log" \
      | grep -E "skewed:|\| skewed|host->"
    ;;
  long)
    timeout 150 python3 bench/long_decode.py --part tier --out "$OUT/long_decode_tier_h200.json" 2>&1 \
      | grep -E "\] |Error|error" | tee "$OUT/long_decode_tier.log"
    timeout 400 python3 bench/long_decode.py --part decode --prompt "${PROMPT:-131072}" ${ENGINES:+--engines "$ENGINES"} \
      --out "$OUT/long_decode_h200_48_layers.json" 2>&1 | grep -E "\] |Error|error|Warn|warn" \
      | tee "$OUT/long_decode.log"
    ;;
  long-tier)
    timeout 480 python3 bench/long_decode.py --part decode --prompt "${PROMPT:-131072}" \
      --engines "${ENGINES:-bfloat16:131072:16:32768,131072:1,4,16:16384;bfloat16:262144:1:262144:1:16384;int8:262144:1:262144:1:16384}" \
      --out "$OUT/long_decode_kv16k_h200_48_layers.json" 2>&1 | grep -E "\] |Error|error|Warn|warn|Trace" \
      | tee "$OUT/long_decode_kv16k.log"
    ;;
  prompt-long)
    timeout 300 python3 bench/kernel_speed.py --only prompt_attention --repeat 5 --prompt-offsets 0,32768,126976 \
      --prompt-configs "${CONFIGS:-8:4:3,8:8:3,16:8:3,16:4:3}" --out "$OUT/kernel_speed_prompt_attention_long_h200.json" \
      2>&1 | grep -E "^prompt|FAILED|wrote" | tee "$OUT/kernel_speed_prompt_attention_long.log"
    ;;
  splits)
    timeout 200 python3 bench/kernel_speed.py --only decode_attention --repeat 5 --attention-splits 0,4,8,16,33,64,128 \
      --attention-contexts 32768,131072 --attention-batches 1,4,16 --out "$OUT/kernel_speed_decode_attention_splits_h200.json" \
      2>&1 | grep -E "^decode|FAILED|wrote" | tee "$OUT/kernel_speed_decode_attention_splits.log"
    timeout 240 python3 bench/long_decode.py --part decode --prompt 0 --engines "bfloat16:131072:16:32768,131072:1,4,16" \
      --out "$OUT/long_decode_h200_48_layers.json" 2>&1 | grep -E "\] |Error|error" | tee "$OUT/long_decode.log"
    ;;
  prompts)
    STRATA_TEST_DEVICE=gpu timeout 150 python3 -m pytest -q -n 8 tests/kernels/test_gated_delta.py \
      tests/kernels/test_decode_attention.py tests/kernels/test_expert_grouped.py -p no:cacheprovider -o addopts="" \
      2>&1 | tee "$OUT/gpu_prompt_kernel_tests.log" | grep -E "passed|failed|FAILED|Error" | head -20
    timeout 420 python3 bench/prompt_speed.py --variants "${VARIANTS:-prompt_block_k=32}" --variant-prompts 32768 \
      --stop-after 300 --out "$OUT/prompt_speed_h200_48_layers.json" 2>&1 | grep -E "\] |Error|error|Trace" \
      | tee "$OUT/prompt_speed.log"
    ;;
  scopes)
    timeout 300 python3 bench/prompt_probe.py --layers 8 --out "$OUT/prompt_probe_h200.json" 2>&1 \
      | grep -E "^\||^prompt|^decode|^stream|unmatched|wrote|Error"
    ;;
  spec)
    timeout 570 python3 bench/spec_speed.py --real-shapes --layers 48 --experts int4 --also-k 1,2 \
      --tokens-per-window 2.14 --out "$OUT/spec_speed_h200_48_layers_int4.json" 2>&1 | grep -v "^wrote" \
      | tee "$OUT/spec_speed.log"
    ;;
  spec-probe)
    timeout 400 python3 bench/prompt_probe.py --layers 8 --verify 4 --batches 1,4 \
      --out "$OUT/prompt_probe_verify_h200_8_layers.json" 2>&1 | grep -E "^\||^decode|^verify|wrote|Error" \
      | tee "$OUT/prompt_probe_verify.log"
    ;;
  probe48)    # at all 48 layers: the scopes probe with the compute stream's idle gaps (timeline), for the prompt
              # part and decode windows of 1 and 4 rows
    timeout 330 python3 bench/prompt_probe.py --layers 48 --out "$OUT/prompt_probe_h200_48_layers.json" 2>&1 \
      | grep -E "^\||^prompt|^decode|^stream|unmatched|wrote|Error"
    ;;
  flash)      # bench/flash_speed.py: random:qwen3.8-flash-next, the PLE table in host RAM, a 4K prompt and decode
              # b1/b16 beside their floors. XLA's default command-buffer mode: under skip_temp the load's slot check
              # (pool_read) asked the VMM allocator for a second pool-sized buffer on an H100 (docs/qwen4-exp.md)
    timeout 570 python3 bench/flash_speed.py --command-buffer-update xla_default --out "$OUT/flash_speed.json" 2>&1 \
      | grep -vE "^W1207" | tee "$OUT/flash_speed.log" | tail -30
    ;;
  *)
    echo "usage: bash bench/h200_session.sh kernels|gdn|decode-kernels|decode-experts|trace-experts|kernel-tests|engine|engine48|engine-gdn|engine-nocb|probe48|copies|engine-xla|probe|offload|prompts|scopes|..." >&2
    exit 2
    ;;
esac
