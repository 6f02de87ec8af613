"""Engine: load a model, own the backend and the sequence state, read prompts in parts, decode.

The facade tests and the CLI use:
    engine = Engine.load("demo" | "tiny" | checkpoint_dir | file.gguf | pack_dir, settings=None, **flat_settings)
    engine.logits(token_ids) -> np.float32 [T, vocab]
    engine.generate(token_ids, max_tokens, temperature=0.0, seed=None) -> list[int]
    engine.tokenizer
"""
from __future__ import annotations

import json
import logging
import os
import secrets
from functools import partial
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

from strata.backend import HOST, TIER_BASE, get_backend
from strata.builtin import builtin_dir, is_builtin, is_random
from strata.config import AUTO_CONTEXT_CAP, AUTO_DRAFTS, KV_DTYPES, Settings, bucket_for
from strata.errors import ConfigError, StrataError
from strata.plan import PromptRows
from strata.model.config import ModelConfig
from strata.model.control import ControlVector, load_control_vector, with_control
from strata.experts.path import ExpertPath
from strata.engine.images import Image, prompt_rows, text_rows
from strata.engine.stages import LayerSlice, Stage, split_points, stage_config, stage_params
from strata.model.forward import LayerByLayer, Taps, forward, forward_hidden, head, init_state
from strata.model.params import build_params, params_from_reader
from strata.model.ple_table import PleTablePlace
from strata.weights.source import check_parts, load_source

log = logging.getLogger("strata")


class Engine:
    def __init__(self, cfg: ModelConfig, params: dict, backend, settings: Settings, tokenizer=None,
                 control: ControlVector | None = None):
        self.cfg, self.params, self.backend, self.settings = cfg, params, backend, settings
        # the control vector in params (each layer's CONTROL; strata/model/control.py), or None: every window then
        # takes its rows' scales (cv)
        self.control = control
        self.tokenizer = tokenizer
        self.dtype = params["embed"].dtype
        self.kv_dtype = np.dtype(KV_DTYPES[settings.model.kv] or self.dtype)
        if settings.model.max_context == "auto":
            raise ConfigError("an Engine built directly needs max_context as a number of tokens; Engine.load "
                              "chooses it for auto")
        # KV rows beyond max_context absorb the padding of the last part, so a write never runs off the cache; a
        # multiple of 64, so the attention kernels' key blocks divide it (else they leave the rows to XLA's form)
        rows = settings.model.max_context + bucket_for(min(settings.sched.prefill, settings.model.max_context))
        self.capacity = -(-rows // 64) * 64
        self.kv_resident = _kv_window(settings, backend)     # the device window's rows per slot (0: one tier)
        ops = backend
        self._compiled: dict = {}
        self.experts = None          # an ExpertSet once attach_experts ran (models with routed experts)
        self.path = ExpertPath.no_experts(ops)          # chosen again by attach_experts
        # the layer loop's debug hooks (strata/model/forward.py Taps): fixed here, compiled into every window
        self.taps = Taps(debug_nan=settings.backend.debug_nan, nonfinite=settings.faults.nonfinite,
                         report=_report_nan)
        self.by_layer = LayerByLayer(ops, cfg, self.compiled, self.taps)
        # the layer split's stages (strata/engine/stages.py); unsplit, one stage holding everything
        self.stages = (Stage(0, 0, ops, cfg, params, self.path, by_layer=self.by_layer),)
        self.record_routing = False  # compiled windows report routing counts to the cache (strata profile)
        self.mtp = None              # (MtpHead, its expert pool) once loaded (mtp setting; strata/engine/spec.py)
        self.images = None           # an ImageEncoder when the vision tower is loaded (strata/engine/images.py)
        self._sample = ops.compile(partial(_sample, ops), static_argnames=("greedy",))

    @property
    def layout(self):
        return self.experts.layout if self.experts is not None else None

    def _compile(self, name: str, fn, ops=None, path=None, stage: Stage | None = None, **kw):
        """fn(ops, cfg, path, layout, ..., taps=) compiled once per engine, stage and layout: a stage's over its own
        layers, backend and path (default: the whole model's, unsplit); ops, path: another backend's and its path
        (a numerics path's, strata/engine/numerics.py), under a name of its own."""
        st = stage or self.stages[0]
        ops, path = ops or st.ops, path or st.path
        return self.compiled((name, st.index, st.layout), lambda: ops.compile(
            partial(fn, ops, st.cfg, path, st.layout, taps=self.taps), **kw))

    def compile_on(self, stage: Stage, name: str, fn, **kw):
        """fn(ops, ...) compiled once per engine and stage, on that stage's backend."""
        return (stage.compiled or self.compiled)(name, lambda: stage.ops.compile(partial(fn, stage.ops), **kw))

    @property
    def split(self) -> bool:
        return len(self.stages) > 1

    def zeros_state(self, template: list) -> list:
        """A whole-model state list (per layer {name: array}, e.g. init_state's, or a bank) as zeros, each stage's
        layers on its device."""
        out = []
        for st in self.stages:
            layers = st.of(template)
            dev = st.ops.zeros_like([{k: v for k, v in x.items() if not k.endswith(HOST)} for x in layers])
            host = [{k: v for k, v in x.items() if k.endswith(HOST)} for x in layers]
            if any(host):             # a two-tier KV's host arrays (kv_resident), in host memory
                host = st.ops.host_kv.host_zeros_like(host)
            out += [{**d, **h} for d, h in zip(dev, host)]
        return out

    def hidden(self, stages, x, call):
        """Hidden rows x through `stages` in turn: x = call(stage, x) on each, handed to each stage's device first
        (x None: the first stage embeds its tokens). -> x on the last stage's device."""
        for st in stages:
            if x is not None and st.index > 0:
                x = st.ops.to_device(x)
            x = call(st, x)
        return x

    def cv(self, scales, args: "DeviceArgs | None" = None) -> dict:
        """The keyword a pass takes for its rows' control vector scales (cv=, float32; scales: one a row, or [1] for
        a part's rows alike): none when the model has no control vector. On the host for a compiled backend (each
        stage's call places it on its device), else on the device; args: its device copy kept there (DeviceArgs)."""
        if self.control is None:
            return {}
        value = np.asarray(scales, np.float32).reshape(-1)
        if args is not None:
            return {"cv": args.get("cv", value, device=True)}
        return {"cv": self.backend.to_device(value) if self.backend.eager else value}

    def read_part(self, state, tokens, start: int, n_valid: int, all_logits: bool, control_scale: float = 1.0,
                  rows: PromptRows | None = None):
        """One part of one sequence -> (logits, new state): one compiled function when every expert is resident, a
        window-fetch row for one decoded token on that path, else layer by layer; stage by stage when split.
        control_scale: the control vector's scale for its rows (ignored without one). rows: the part's rotary
        positions and image rows (strata/engine/images.py), padded like tokens; None: plain text at its cache
        positions."""
        cv = self.cv([control_scale])
        if rows is not None:
            if self.split:
                raise StrataError("images are not supported on a layer split yet: load the model unsplit")
            images = None if rows.images is None else (rows.images.astype(self.dtype), rows.is_image)
            rope = rows.rope
            if self.backend.eager:           # a compiled backend places its arguments itself
                images, rope = self.backend.to_device((images, rope))
            if not self.path.compiled_parts:        # experts not all resident: layer by layer
                experts = self.path.on_host(np.arange(len(tokens)) < n_valid, part=len(tokens) > 1, owner="sequence")
                return self.by_layer.sequence(self.params, state, tokens, start, n_valid, all_logits, experts,
                                              images=images, rope_pos=rope, **cv)
            f = self._compile("read_rows", _read, donate_argnums=(2,), static_argnames=("all_logits",))
            logits, state, _ = f(self.params, self.path.args(), state, tokens, np.int32(start), np.int32(n_valid),
                                 all_logits=all_logits, images=images, rope_pos=rope, **cv)
            return logits, state
        if self.split:
            return self._read_staged(state, tokens, start, n_valid, all_logits, cv)
        if self.path.compiled_parts:
            f = self._compile("read", _read, donate_argnums=(2,), static_argnames=("all_logits", "with_counts"))
            record = self.record_routing and self.experts is not None
            logits, state, counts = f(self.params, self.path.args(), state, tokens, np.int32(start),
                                      np.int32(n_valid), all_logits=all_logits, with_counts=record, **cv)
            if record:
                self.experts.cache.observe_all(np.asarray(self.backend.to_host(counts)))
            return logits, state
        if self.path.compiled_rows and len(tokens) == 1 and not all_logits:
            return self._read_one_fetching(state, tokens, start, cv)
        experts = self.path.on_host(np.arange(len(tokens)) < n_valid, part=len(tokens) > 1, owner="sequence")
        return self.by_layer.sequence(self.params, state, tokens, start, n_valid, all_logits, experts, **cv)

    def _read_staged(self, state, tokens, start: int, n_valid: int, all_logits: bool, cv: dict):
        """read_part over the stages: each stage's layers compiled as one function when its experts are all
        resident, else layer by layer; the last stage's head on its output."""
        state = list(state)
        valid = np.arange(len(tokens)) < n_valid

        def through(st, x):
            a, b = st.layers.start, st.layers.stop
            if st.path.compiled_parts:
                f = self._compile("read_hidden", _read_hidden, stage=st, donate_argnums=(2,))
                x, state[a:b] = f(st.params, st.path.args(), state[a:b], tokens, np.int32(start), np.int32(n_valid),
                                  x, **cv)
            else:
                experts = st.path.on_host(valid, part=len(tokens) > 1, owner="sequence")
                x, state[a:b], _ = st.by_layer.sequence_hidden(st.params, state[a:b], tokens, start, n_valid,
                                                               experts, x, **cv)
            return x
        x = self.hidden(self.stages, None, through)
        last = self.stages[-1]
        f = self._compile("read_head", _read_head, stage=last, static_argnames=("all_logits",))
        return f(last.params, x, np.int32(n_valid), all_logits=all_logits), state

    def _read_one_fetching(self, state, tokens, start: int, cv: dict):
        """One decoded token of one sequence as a window-fetch decode row over a bank of one: the path a runner's
        decode window takes."""
        f = self._compile("read_one_fetching", _read_one_fetching, donate_argnums=(2,))
        args, table = self.experts.fetch_args()
        logits, state, counts, copied = f(self.params, args, state, np.asarray(tokens, np.int32), np.int32(start),
                                          **cv)
        self.experts.record_window(table, np.asarray(self.backend.to_host(counts)),
                                   np.asarray(self.backend.to_host(copied)))
        return logits, state

    def compiled(self, name: str, make):
        """One compiled function per engine and name (its shapes are cached inside), so every runner over this
        engine shares its compilations."""
        if name not in self._compiled:
            self._compiled[name] = make()
        return self._compiled[name]

    @classmethod
    def load(cls, path_or_name: str | os.PathLike | None = None, settings: Settings | None = None, say=None,
             **flat) -> "Engine":
        """path_or_name: the model (default: settings.model.model); flat: settings by key on top of `settings`
        (max_context=2048, backend="jax"), checked by strata.config; say(line): where the load's log lines go
        (default: the "strata" logger at info)."""
        if path_or_name is not None:
            flat = {"model": os.fspath(path_or_name), **flat}
        settings = (settings or Settings()).with_values(flat)
        path_or_name = settings.model.model
        opts = settings.backend
        say = say or (lambda line: log.info(line))
        ops = get_backend(opts.backend, **({"device": opts.device} if opts.device else {}),
                          **({"kernels": opts.kernels} if opts.kernels != "auto" else {}))
        pack, random = None, is_random(path_or_name)
        check_parts(path_or_name, settings.model.parts)
        if _is_pack(path_or_name):
            from strata.experts.pack import PackReader
            pack = PackReader(path_or_name)
            config, tensors, tok_dir = pack.config, pack.dense(), pack.dir
        elif random:                         # weights drawn on the device below; the directory holds the rest
            if ops.name != "jax":
                raise ConfigError(f"model {path_or_name} draws its weights with JAX: use backend = \"jax\", not "
                                  f"{ops.name!r}")
            tok_dir = builtin_dir(path_or_name)
            config, tensors = json.loads((tok_dir / "config.json").read_text()), None
        else:
            config, tensors, tok_dir = load_source(path_or_name, settings.model.parts)
        cfg = ModelConfig.from_hf(config, source=f"{path_or_name} config").with_rope_settings(
            settings.model.rope_scaling, settings.model.rope_scale)
        _refuse_unsupported(cfg, settings)
        dtype = settings.model.dtype
        if dtype == "auto":
            dtype = "float32" if ops.device.platform == "cpu" else "bfloat16"
        np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
        max_context = _max_context(cfg, settings, ops, np_dtype, say)
        settings = settings.with_values({"max_context": max_context})
        cfg = cfg.for_context(max_context)
        split = opts.layer_split is not None
        if opts.prefill_help and not split:
            raise ConfigError("prefill_help needs layer_split: the peer that helps is the second stage's device")
        ple = _place_ple(cfg, settings, ops, tensors, np_dtype, say) if cfg.ple is not None else None
        control = load_control_vector(settings.model.control_vector, cfg.num_layers, cfg.hidden_size)
        if control is not None:
            say(f"strata model: control vector {control.describe()}; a request's control_vector_scale multiplies "
                f"it (default 1, 0 = off)")
        if random:
            from strata.jax_backend.random_weights import RandomDeviceReader
            params = ops.to_device(with_control(params_from_reader(cfg, RandomDeviceReader(np_dtype),
                                                                   ops.joins_projections, ple), control))
        else:
            params = with_control(build_params(cfg, tensors, np_dtype, ops.joins_projections, ple), control)
            params = params if split else ops.to_device(params)      # split: each stage places its own share
        if settings.sched.spec == "auto":         # the head's parameters are placed with the rest (stage_params)
            settings = settings.with_values({"mtp": "mtp" in params and (pack is None or pack.mtp_layer is not None)})
        tokenizer = None
        if tok_dir is not None and (Path(tok_dir) / "tokenizer.json").exists():
            from strata.tokenizer import Tokenizer
            tokenizer = Tokenizer.from_dir(Path(tok_dir))
        engine = cls(cfg, params, ops, settings, tokenizer, control)
        engine.images = _load_vision(config, tensors, settings, ops, np_dtype, path_or_name, say)
        if pack is not None:
            from strata.experts.tiers import PackStore
            store = PackStore(pack, stream=settings.experts.stream_experts)
        elif random:
            from strata.experts.synthetic import SyntheticStore
            store = SyntheticStore("int4", cfg.hidden_size, cfg.moe_intermediate_size,
                                   sum(cfg.is_sparse_layer(i) for i in range(cfg.num_layers)), cfg.num_experts)
        else:
            from strata.experts.tiers import MemoryStore
            from strata.model.params import read_experts
            from strata.weights.quant import layout
            lay = layout("f32" if dtype == "float32" else "bf16", cfg.hidden_size, cfg.moe_intermediate_size)
            sparse = any(cfg.is_sparse_layer(i) for i in range(cfg.num_layers))
            store = MemoryStore(lay, read_experts(cfg, tensors, np_dtype)) if sparse else None
        if split:
            engine.split_layers(store, say)
        engine.attach_experts(store, say)
        if settings.sched.spec == "auto":
            engine.settings = settings = settings.with_values(engine.auto_spec(say))
        if settings.sched.mtp:
            from strata.engine.spec import load_mtp
            engine.mtp = load_mtp(engine, tensors, pack)
        if settings.faults.corrupt_slot is not None:
            engine._corrupt(settings.faults.corrupt_slot, say)
        return engine

    def auto_spec(self, say) -> dict:
        """spec = "auto" made a number: AUTO_DRAFTS with the MTP head where the model has one (its parameters
        loaded: settings.sched.mtp) and the decode windows are compiled, else 0 (and the head's parameters dropped)."""
        why = ("the model has no MTP head" if not self.settings.sched.mtp else
               f"decode windows are not compiled here ({self.backend.name} backend, experts {self.path.describe()})"
               if self.backend.eager or not all(st.path.compiled_rows for st in self.stages) else None)
        if why is None:
            say(f"strata spec: auto: each slot drafts up to {AUTO_DRAFTS} tokens with the MTP head, and windows "
                f"verify while they measure faster than plain ones")
            return {"spec": AUTO_DRAFTS, "mtp": True}
        say(f"strata spec: auto: off ({why})")
        if isinstance(self.params, dict):
            self.params.pop("mtp", None)
        return {"spec": 0, "mtp": False}

    def _corrupt(self, slot: int, say) -> None:
        """Test-only fault injection: overwrite a device expert slot (the host tier and the pack stay good)."""
        if self.experts is None or not 0 <= slot < self.experts.cache.n_slots:
            raise StrataError(f"fault_corrupt_slot {slot}: this engine has "
                              f"{0 if self.experts is None else self.experts.cache.n_slots} expert slots")
        s = self.experts.cache.corrupt(slot)
        say(f"strata experts: test fault: slot {slot} (layer {s.layer}, expert {s.expert}) overwritten on the device")

    def split_layers(self, store, say=print) -> None:
        """Cut the model into the stages `layer_split` asks for, each on its own device with its share of the
        parameters (placed there now); the experts are attached per stage after (attach_experts)."""
        ops, cfg, setting = self.backend, self.cfg, self.settings.backend.layer_split
        if ops.peers is None:
            raise ConfigError(f"layer_split: the {ops.name} backend runs on one device only here (the layer split "
                              f"runs on the jax backend)")
        n_dev = ops.peers.device_count()
        backends = [ops.peers.on_device(i) for i in range(n_dev)]
        layer_bytes = free = None
        if setting == "auto":            # balanced by the layers' bytes and each device's free memory
            per_state = self.settings.sched.parallel + 1
            one = self.init_state()
            layer_bytes = [sum(int(a.nbytes) for a in _leaves(self.params["layers"][i]))
                           + per_state * sum(a.nbytes for a in one[i].values())
                           + (store.layout.nbytes * store.n_experts if store is not None and cfg.is_sparse_layer(i)
                              else 0)
                           for i in range(cfg.num_layers)]
            free = [b.free_memory_bytes() for b in backends]
        points = split_points(str(setting), cfg, n_dev, layer_bytes, free)
        bounds = [0, *points, cfg.num_layers]
        stages, moe = [], 0
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            st_ops, st_cfg = backends[i], stage_config(cfg, a, b)
            compiled = partial(self._stage_compiled, i)
            share = stage_params(self.params, a, b, i == 0, i == len(bounds) - 2, self.settings.sched.mtp)
            params = st_ops.to_device(share)
            stages.append(Stage(i, a, st_ops, st_cfg, params, ExpertPath.no_experts(st_ops), moe_first=moe,
                                by_layer=LayerByLayer(st_ops, st_cfg, compiled, self.taps), compiled=compiled))
            moe += sum(cfg.is_sparse_layer(j) for j in range(a, b))
        self.stages = tuple(stages)
        # the whole tree, each stage's arrays on its device; the sampler and the logits live on the last stage's
        self.params = {**{k: v for k, v in stages[-1].params.items() if k not in ("layers", "embed")},
                       "embed": stages[0].params["embed"],
                       "layers": [lp for st in stages for lp in st.params["layers"]]}
        self.backend, self.by_layer, self.path = stages[-1].ops, None, stages[0].path
        self._sample = self.backend.compile(partial(_sample, self.backend), static_argnames=("greedy",))
        say(f"strata split: {len(stages)} stages: {', '.join(st.describe() for st in stages)}; one hand-off of the "
            f"hidden rows per window per boundary")

    def _stage_compiled(self, index: int, name, make):
        return self.compiled((index, name), make)

    def attach_experts(self, store, say=print) -> None:
        """Plan memory for the experts in `store` (an expert source), open the cache and place them; split, each
        stage its own layers' experts, planned from its own device's numbers."""
        if store is None:
            return
        from strata.experts.setup import build_experts
        # misses computed on the CPU run through a CPU backend's expert op (XLA's, the reference form)
        cpu = self.settings.experts.miss_policy == "cpu" or "cpu_experts" in self.settings.sched.ladder
        cpu_ops = get_backend("jax", device="cpu", kernels="xla") if cpu else None
        for st in self.stages:
            n_moe = sum(st.cfg.is_sparse_layer(i) for i in range(st.cfg.num_layers))
            if n_moe == 0:
                continue
            source = LayerSlice(store, st.moe_first, n_moe) if self.split else store
            # prefill_help: the second stage's device computes a share of the first stage's prompt parts' experts
            peer = self.stages[1].ops if self.settings.backend.prefill_help and st.index == 0 else None
            st.path = build_experts(st.ops, st.cfg, source, self.settings, self.state_bytes(st), self.work_bytes(),
                                    st.compiled or self.compiled, cpu_ops=cpu_ops, peer_ops=peer, say=say)
        self.path = self.stages[0].path
        self.experts = next((st.experts for st in self.stages if st.experts is not None), None)

    def state_bytes(self, stage: Stage | None = None) -> int:
        """Device bytes of the sequence state of `settings.sched.parallel` sequences (plus one for Engine
        sequences), of one stage's layers when given."""
        one = self.init_state(tiers=True)
        if stage is not None:
            one = stage.of(one)
        return (self.settings.sched.parallel + 1) * device_bytes(one)

    def init_state(self, tiers: bool = False) -> list[dict]:
        """A fresh sequence state on the host, with this engine's capacity, dtype and KV format; tiers: with the
        host tier kv_resident asks for (the runner's slots; an Engine sequence keeps every position on the
        device)."""
        return init_state(self.cfg, self.capacity, self.dtype, self.kv_dtype,
                          resident=self.kv_resident if tiers else 0)

    def work_bytes(self) -> int:
        """Working buffers: the largest prompt part's activations, and with a host tier the one layer's KV a part
        stages on the device (its slot's host part with the window over it)."""
        staged = 0
        if self.kv_resident:
            layer = next(x for x in self.init_state(tiers=True) if TIER_BASE in x)
            staged = sum(a.nbytes for k, a in layer.items() if k.endswith(HOST))
        return _work_bytes(self.cfg, self.settings.sched.prefill, self.settings.model.max_context) + staged

    def host_kv_bytes(self, slots: int) -> int:
        """Pinned host RAM the KV's host tier takes for `slots` slots (0 without one)."""
        if not self.kv_resident:
            return 0
        return slots * sum(a.nbytes for layer in self.init_state(tiers=True) for k, a in layer.items()
                           if k.endswith(HOST))

    # --- sequences
    def sequence(self, control_scale: float = 1.0) -> "Sequence":
        return Sequence(self, control_scale)

    def logits(self, token_ids, part_size: int | None = None, control_scale: float = 1.0,
               images: list[Image] = ()) -> np.ndarray:
        """Logits at every prompt position, [T, vocab] float32, for a fresh sequence (control_scale: its control
        vector's scale, when the model has one; images: those of the prompt's image tokens, in order)."""
        return self.sequence(control_scale).read(token_ids, part_size=part_size, all_logits=True, images=images)

    def stream(self, token_ids, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
               top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
               stop_token_ids=None, control_scale: float = 1.0, images: list[Image] = ()) -> Iterator[int]:
        """Yields generated token ids one at a time; stops after max_tokens or at a stop token (which is yielded).
        images: logits'."""
        _check_sampling(max_tokens, temperature, top_k, top_p, min_p, seed)
        if max_tokens == 0:
            return
        stops = set(self.eos_token_ids if stop_token_ids is None else stop_token_ids)
        seq = self.sequence(control_scale)
        if len(token_ids) + max_tokens > self.settings.model.max_context:
            raise StrataError(f"prompt of {len(token_ids)} tokens plus max_tokens {max_tokens} exceeds "
                              f"max_context {self.settings.model.max_context}")
        seed = secrets.randbits(63) if seed is None else seed
        sp = _sampling_arrays(temperature, top_k, top_p, min_p)
        seed_arr = np.array([seed & 0xFFFFFFFF, (seed >> 32) & 0x7FFFFFFF], np.uint32)
        logits = seq.read(token_ids, all_logits=False, as_numpy=False, images=images)
        token = int(self._sample(logits, *sp, seed_arr, np.int32(0), greedy=all_greedy(sp[0]))[0])
        for step in range(1, max_tokens + 1):
            yield token
            if token in stops or step == max_tokens:
                return
            token = seq.decode(token, sp, seed_arr, step)

    def generate(self, token_ids, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                 **sampling) -> list[int]:
        return list(self.stream(token_ids, max_tokens, temperature=temperature, seed=seed, **sampling))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return tuple(self.tokenizer.eos_token_ids)
        return self.cfg.eos_token_ids


class Sequence:
    """One sequence's state on the device and its position, and its control vector's scale. rope_offset: a text
    token's rotary position minus its cache position (images take fewer rotary positions than tokens)."""

    def __init__(self, engine: Engine, control_scale: float = 1.0):
        self.engine, self.control_scale = engine, float(control_scale)
        self.pos = 0
        self.rope_offset = 0
        self.state = engine.zeros_state(engine.init_state())     # init_state is zeros (tested)
        self._args = DeviceArgs(engine.backend)

    def read(self, token_ids, part_size: int | None = None, all_logits: bool = False, as_numpy: bool = True,
             images: list[Image] = ()):
        """Read prompt tokens in parts; -> logits of every token read [n, V], or of the last one [1, V]. images:
        those of its image tokens, in order (a model with a vision tower)."""
        e = self.engine
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        n = len(ids)
        if n == 0:
            raise StrataError("a prompt needs at least one token")
        if ids.min() < 0 or ids.max() >= e.cfg.vocab_size:
            bad = int(ids[(ids < 0) | (ids >= e.cfg.vocab_size)][0])
            raise StrataError(f"token id {bad} is outside the vocabulary 0..{e.cfg.vocab_size - 1}")
        if self.pos + n > e.settings.model.max_context:
            raise StrataError(f"{self.pos + n} tokens exceed max_context {e.settings.model.max_context}")
        part = min(part_size or e.settings.sched.prefill, e.settings.sched.prefill)
        if part < 1:
            raise StrataError(f"part_size must be >= 1, found {part_size}")
        rows = self._rows(ids, list(images))
        out = []
        for s in range(0, n, part):
            chunk = ids[s:s + part]
            b = bucket_for(len(chunk))
            padded = np.zeros(b, np.int32)
            padded[:len(chunk)] = chunk
            logits, self.state = e.read_part(self.state, padded, self.pos, len(chunk), all_logits, self.control_scale,
                                             None if rows is None else rows.part(s, len(chunk), b))
            self.pos += len(chunk)
            if all_logits:
                out.append(e.backend.to_host(logits)[:len(chunk)])
        if all_logits:
            return np.concatenate(out, axis=0)
        return e.backend.to_host(logits) if as_numpy else logits

    def _rows(self, ids: np.ndarray, images: list[Image]) -> PromptRows | None:
        """The rotary positions and image rows of a prompt read next, or None for text at its cache positions; sets
        rope_offset for what follows it."""
        e = self.engine
        rows = prompt_rows(e.images, ids, images, self.pos + self.rope_offset, self.pos, e.cfg.hidden_size)
        if rows is not None:
            self.rope_offset = rows.following - (self.pos + len(ids))
        return rows

    def decode(self, token: int, sp, seed_arr, step: int) -> int:
        """Feed one token, sample the next (on the device); -> the sampled token id."""
        e = self.engine
        if self.pos + 1 > e.settings.model.max_context:
            raise StrataError(f"{self.pos + 1} tokens exceed max_context {e.settings.model.max_context}")
        if self.rope_offset:         # the text after images: its rotary position is not its cache position
            logits, self.state = e.read_part(self.state, np.array([token], np.int32), self.pos, 1, False,
                                             self.control_scale, text_rows(1, self.pos + self.rope_offset))
            self.pos += 1
            return int(e._sample(logits, *sp, seed_arr, np.int32(step), greedy=all_greedy(sp[0]))[0])
        if e.path.compiled_parts and not e.record_routing and not e.split:
            # one compiled call per token, with one small transfer in (token, position, step) and one out (strata
            # profile records routing counts through read_part instead)
            f = e._compile("decode_step", _decode_step, donate_argnums=(2,), static_argnames=("greedy",))
            a = self._args
            stable = [a.get(name, v) for name, v in zip(SAMPLING, sp)]
            nxt, self.state = f(e.params, e.path.args(), self.state, np.array([token, self.pos, step], np.int32),
                                *stable, a.get("seed", seed_arr), greedy=all_greedy(sp[0]),
                                **e.cv([self.control_scale], a))
            self.pos += 1
            return int(nxt)
        logits, self.state = e.read_part(self.state, np.array([token], np.int32), self.pos, 1, False,
                                         self.control_scale)
        nxt = e._sample(logits, *sp, seed_arr, np.int32(step), greedy=all_greedy(sp[0]))
        self.pos += 1
        return int(nxt[0])


def _read(ops, cfg, path, layout, params, args, state, tokens, start, n_valid, all_logits: bool,
          with_counts: bool = False, taps=None, cv=None, images=None, rope_pos=None):
    """One part of one sequence, every expert resident -> (logits, state, routing counts [Lp, E] or None). cv: its
    rows' control vector scale [1] (None without one); images, rope_pos: forward's."""
    counts = [] if with_counts else None
    logits, state = forward(ops, cfg, params, state, tokens, start, n_valid, path.traced(layout, args, n_valid, counts),
                            all_logits, taps, cv=cv, images=images, rope_pos=rope_pos)
    if with_counts:
        counts = ops.xp.stack(counts) if counts else ops.xp.zeros((0, path.n_experts), ops.xp.int32)
    return logits, state, counts


def _leaves(tree):
    """The arrays of a nested dict/list tree."""
    if isinstance(tree, dict):
        return [a for v in tree.values() for a in _leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [a for v in tree for a in _leaves(v)]
    return [tree]


def _read_hidden(ops, cfg, path, layout, params, args, state, tokens, start, n_valid, x, taps=None, cv=None):
    """One part of one sequence through one stage's layers, every expert resident: x [T, H] from the stage before
    (None: the first stage, which embeds tokens) -> (x after its layers, its layers' state)."""
    return forward_hidden(ops, cfg, params, state, tokens, start, n_valid, path.traced(layout, args, n_valid), x=x,
                          taps=taps, cv=cv)


def _read_head(ops, cfg, path, layout, params, x, n_valid, all_logits: bool, taps=None):
    """The last stage's head on its output x: logits [T, V] or [1, V] (row n_valid - 1)."""
    return head(ops, cfg, params, x, n_valid, all_logits)


def _read_one_fetching(ops, cfg, path, layout, params, args, state, tokens, start, taps=None, cv=None):
    """tokens [1] at position start, as a window-fetch decode row over a bank of one -> (logits [1, V], state,
    routing counts [Lp, E], experts copied [Lp])."""
    bank = [{k: v[None] for k, v in layer.items()} for layer in state]
    active = ops.xp.ones((1,), ops.xp.int32)
    counts, copied = [], []
    logits, bank = forward(ops, cfg, params, bank, tokens, start[None], active,
                           path.traced(layout, args, active, counts, copied), all_logits=True, taps=taps, cv=cv)
    return logits, [{k: v[0] for k, v in layer.items()} for layer in bank], ops.xp.stack(counts), ops.xp.stack(copied)


SAMPLING = ("temperature", "top_k", "top_p", "min_p")      # the per-row sampling settings, in the samplers' order


class DeviceArgs:
    """Device copies of per-call arguments that rarely change (sampling settings, seeds, a window's active mask):
    each is sent again only when its value differs from the last one sent, because every separate argument transfer
    costs host time before a call can start (docs/performance.md)."""

    def __init__(self, ops):
        self.ops = ops
        self._sent: dict = {}

    def get(self, name: str, value, device: bool = False):
        """value's device copy; with device=False an eager backend gets the host array (below); device=True: an
        argument that array arithmetic reads (shaped sampling), a device array on every backend."""
        value = np.asarray(value)
        if self.ops.eager and not device:
            # an eager backend takes host arrays as they are, and its rows-mode kernels need some on the host (a
            # window's active mask: SYCL's attention and delta-rule rows kernels; a device copy sent it down the
            # per-row composition, 4-11x the launches of a window)
            return value
        last = self._sent.get(name)
        if last is None or last[0].dtype != value.dtype or not np.array_equal(last[0], value):
            last = self._sent[name] = (value.copy(), self.ops.to_device(value))
        return last[1]

    def take(self, name: str, value):
        """get() for an argument the call donates: the device copy is handed over and forgotten (a failed call
        leaves nothing stale behind); known() records the call's successor."""
        got = self.get(name, value)
        self._sent.pop(name, None)                  # (an eager backend's host values are never kept)
        return got

    def known(self, name: str, value, device_value) -> None:
        """device_value (computed on the device) holds value: a later get(name, value) uses it, sending nothing."""
        self._sent[name] = (np.array(value), device_value)


def _decode_step(ops, cfg, path, layout, params, args, state, ints, temperature, top_k, top_p, min_p, seed,
                 greedy: bool = False, taps=None, cv=None):
    """One decoded token of one sequence, every expert resident: ints int32 [3] = (token, position, sampling step)
    -> (the sampled token, int32 scalar; the new state)."""
    n_valid = np.int32(1)
    logits, state = forward(ops, cfg, params, state, ints[0:1], ints[1], n_valid,
                            path.traced(layout, args, n_valid), all_logits=False, taps=taps, cv=cv)
    nxt = _sample(ops, logits, temperature, top_k, top_p, min_p, seed, ints[2], greedy)
    return nxt[0].astype(ops.xp.int32), state


def _sample(ops, logits, temperature, top_k, top_p, min_p, seed, step, greedy: bool = False):
    """One sequence's sampling step: seed uint32 [2], step int32 scalar. greedy (static): temperature is 0, the
    argmax alone (ops.sample's all_greedy)."""
    keys = ops.prng_keys(seed[None], step[None])
    return ops.sample(logits, temperature, top_k, top_p, min_p, keys, all_greedy=greedy)


def _report_nan(names: tuple, flags) -> None:
    """debug_nan's report of one pass: the first check that found a non-finite value, if any."""
    bad = np.flatnonzero(~np.asarray(flags, bool))
    if len(bad):
        log.warning(f"strata debug_nan: the first non-finite value of a pass came from {names[bad[0]]} "
                    f"({len(bad)} of its {len(names)} checks found one)")


def all_greedy(temperature, active=None) -> bool:
    """Whether every row (every active row, with active [B] bool) has temperature 0: its sampling compiles as the
    argmax alone, without the sort of the vocabulary (ops.sample's all_greedy)."""
    t = np.asarray(temperature)
    return not bool(np.any((t if active is None else t[np.asarray(active, bool)]) > 0))


def _sampling_arrays(temperature, top_k, top_p, min_p):
    return (np.array([temperature], np.float32), np.array([top_k], np.int32),
            np.array([top_p], np.float32), np.array([min_p], np.float32))


def _check_sampling(max_tokens, temperature, top_k, top_p, min_p, seed):
    def need(ok, msg):
        if not ok:
            raise StrataError(msg)
    need(isinstance(max_tokens, int) and max_tokens >= 0, f"max_tokens must be an integer >= 0, found {max_tokens!r}")
    need(0.0 <= temperature <= 100.0, f"temperature must be in [0, 100], found {temperature}")
    need(isinstance(top_k, int) and top_k >= 0, f"top_k must be an integer >= 0 (0 = off), found {top_k!r}")
    need(0.0 < top_p <= 1.0, f"top_p must be in (0, 1], found {top_p}")
    need(0.0 <= min_p <= 1.0, f"min_p must be in [0, 1], found {min_p}")
    need(seed is None or (isinstance(seed, int) and 0 <= seed < 2 ** 63),
         f"seed must be an integer in [0, 2^63), found {seed!r}")


def _work_bytes(cfg: ModelConfig, prefill: int, max_context: int) -> int:
    """Activations of the largest prompt part, estimated: per token the residual stream and its temporaries
    (8 x hidden), the routed experts' intermediate (2 x k x moe_intermediate), and the logits."""
    t = bucket_for(min(prefill, max_context))
    per_token = 8 * cfg.hidden_size + 2 * cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.vocab_size
    return t * per_token * 4


def device_bytes(state: list[dict]) -> int:
    """Device bytes of a state list (a two-tier KV's host arrays left out)."""
    return sum(a.nbytes for layer in state for k, a in layer.items() if not k.endswith(HOST))


def _kv_window(settings: Settings, ops) -> int:
    """kv_resident as the rows of each slot's device window (a multiple of 64, as the kernels' key blocks need; 0:
    one tier), or a ConfigError naming what is wrong with it and what is allowed."""
    n, m = settings.model.kv_resident, settings.model.max_context
    if not n:
        return 0
    if n > m:
        raise ConfigError(f"kv_resident {n} is larger than max_context {m}: set kv_resident to at most {m} (or 0 to "
                          f"keep every position on the device)")
    part = bucket_for(min(settings.sched.prefill, m))
    rows = -(-n // 64) * 64
    if rows <= part:
        raise ConfigError(f"kv_resident {n} is smaller than a prompt part: parts are padded to {part} tokens (prefill "
                          f"{settings.sched.prefill}) and the device window holds one beside a scratch row; set "
                          f"kv_resident to at least {part + 1}, or lower prefill")
    if ops.host_kv is None:
        why = ("XLA's allocator under command_buffer_update = skip_temp leaves no pinned host memory: set "
               "command_buffer_update = xla_default" if ops.name == "jax" else
               f"the {ops.name} backend has no host tier: use the jax backend")
        raise ConfigError(f"kv_resident {n} needs host memory that compiled windows read: {why} (or kv_resident = 0)")
    return rows


def _refuse_unsupported(cfg: ModelConfig, settings: Settings) -> None:
    """Settings a qwen4_exp model cannot run with yet (docs/qwen4-exp.md), refused before anything is loaded."""
    if not cfg.hyper:
        return
    if settings.model.kv_resident:
        raise ConfigError(f"{cfg.model_type} models do not support kv_resident (QSA's index keys have no host tier) "
                          f"yet (docs/qwen4-exp.md); leave it unset")


def _place_ple(cfg: ModelConfig, settings: Settings, ops, tensors, dtype, say) -> PleTablePlace:
    """Where the PLE tables live and in which format (settings ple_table, ple_format; strata/model/ple_table.py),
    said in one plan line. tensors: the checkpoint (None: weights drawn at load, their table float8)."""
    from strata.experts.planner import GIB, available_ram_bytes, place_ple_table
    from strata.model.params import TensorReader, ngram_spec_for, ple_table_blocks
    from strata.model.ple_table import source_format, table_bytes
    p = cfg.ple
    dim = p.embed_dim // p.heads
    rows = sum(ngram_spec_for(cfg, i).table_rows for i in range(len(p.layers)))
    fmt = settings.model.ple_format
    if fmt == "auto":            # as stored (weights drawn at load: float8, as shipped)
        fmt = "float8" if tensors is None else \
            source_format(ple_table_blocks(cfg, TensorReader(tensors, dtype), 0)[0][0].dtype)
    nbytes = table_bytes(rows, dim, fmt, dtype)
    place, why = place_ple_table(nbytes, settings.model.ple_table, ops.free_memory_bytes(), available_ram_bytes(),
                                 from_file=tensors is not None)
    shown = np.dtype(dtype).name if fmt == "float" else fmt
    where = {"device": str(ops.device), "host": "host RAM", "disk": "the checkpoint's files (page cache)"}[place]
    say(f"strata plan: PLE table{'s' if len(p.layers) > 1 else ''} {rows:,} rows of {dim} {shown} = "
        f"{nbytes / GIB:.2f} GiB in {where} ({why}); a token reads {p.heads * len(p.layers)} rows")
    return PleTablePlace(place, settings.model.ple_format)


def _max_context(cfg: ModelConfig, settings: Settings, ops, dtype, say) -> int:
    """max_context as set, checked against the positions the model supports (with rope scaling), or auto's choice
    (strata/experts/planner.py auto_context), said in one plan line."""
    positions, n = cfg.max_positions, settings.model.max_context
    if n != "auto":
        if n > positions:
            scaled = (f" with rope scaling {cfg.rope_scaling.describe()}" if cfg.rope_scaling is not None else
                      "; rope scaling (--rope-scaling yarn --rope-scale F) extends it F times")
            raise ConfigError(f"max_context {n} is beyond the {positions} positions this model supports{scaled}: "
                              f"set max_context to at most {positions}")
        return n
    from strata.experts.planner import auto_context
    kv = np.dtype(KV_DTYPES[settings.model.kv] or dtype)
    sequences = settings.sched.parallel + 1          # as state_bytes counts them
    resident = settings.model.kv_resident            # a two-tier KV's device bytes do not grow with max_context
    one, two = (device_bytes(init_state(cfg, c, dtype, kv, resident=-(-resident // 64) * 64)) for c in (0, 1))
    pad = bucket_for(min(settings.sched.prefill, positions)) + 63        # the capacity's rows past n, at most
    n, line = auto_context(positions, ops.free_memory_bytes(), cap=AUTO_CONTEXT_CAP,
                           reserve_mib=settings.experts.vram_reserve_mib,
                           work_bytes=_work_bytes(cfg, settings.sched.prefill, positions),
                           fixed_state_bytes=sequences * one, token_state_bytes=sequences * (two - one), pad=pad,
                           sequences=sequences)
    say(line)
    return n


def _load_vision(config: dict, tensors, settings: Settings, ops, dtype, source, say):
    """The vision tower as the vision setting asks (auto: when the checkpoint has one) -> an ImageEncoder or None."""
    from strata.model.vision import VisionConfig, vision_params
    want = settings.model.vision
    vc = VisionConfig.from_config(config, f"{source} config") if want != "off" else None
    has = vc is not None and tensors is not None and "model.visual.patch_embed.proj.weight" in set(tensors.names())
    if not has:
        if want == "on":
            raise ConfigError(f"vision = on, but {source} has no vision tower (a {config.get('model_type')!r} "
                              f"checkpoint with model.visual.* tensors and a vision_config): set vision = auto or off")
        return None
    from strata.engine.images import ImageEncoder
    from strata.model.params import TensorReader
    params = ops.to_device(vision_params(vc, TensorReader(tensors, dtype)))
    say(f"strata model: vision tower {vc.depth} blocks of {vc.hidden_size}, {vc.patch_size}-pixel patches merged "
        f"{vc.merge} x {vc.merge} into one token")
    return ImageEncoder(ops, vc, params)


def _is_pack(path_or_name) -> bool:
    if is_builtin(path_or_name):
        return False
    from strata.experts.pack import is_pack
    return is_pack(Path(path_or_name))
