"""strata: the command line. `strata --help` lists every command."""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from strata.builtin import builtin_note
from strata.config import GROUPS, KEYS, SPECS, Settings, load_settings, markdown
from strata.errors import StrataError
from strata.train_tiny import TINY_RECIPE


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _flag_settings(args: argparse.Namespace, keys) -> dict:
    """The settings among `keys` given on the command line (a flag left out is None)."""
    return {key: getattr(args, key) for key in keys if getattr(args, key) is not None}


# generate and profile run one sequence: the memory plan makes no room for the server's parallel slots
ONE_SEQUENCE = {"parallel": 1}


def cmd_generate(args: argparse.Namespace) -> int:
    from strata import Engine
    settings = Settings.build(**ONE_SEQUENCE).with_values(_flag_settings(args, GENERATE_FLAGS), as_flag=True)
    if note := builtin_note(settings.model.model):
        _log(f"strata generate: {note}")
    _check_device(settings)
    t0 = time.perf_counter()
    engine = Engine.load(settings=settings)
    if engine.tokenizer is None:
        raise StrataError(f"{settings.model.model} has no tokenizer.json beside it; generate needs one to encode the "
                          f"prompt")
    tok = engine.tokenizer
    text = args.prompt
    if not args.raw:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    ids = tok.encode(text)
    _log(f"strata generate: model loaded in {(time.perf_counter() - t0) * 1000:.0f} ms "
         f"({engine.cfg.model_type}, {engine.cfg.num_layers} layers, {engine.cfg.num_experts} experts)")
    decoder = tok.decode_stream(skip_special_tokens=True, prompt_ids=ids)
    t1 = time.perf_counter()
    n = 0
    t_first = None
    # a chat reply's leading blank lines (what is left of an empty <think></think> block once the special tokens are
    # dropped) say nothing, so the reply is printed from its first visible character; a raw continuation as it is
    started = args.raw
    for token in engine.stream(ids, args.max_tokens, temperature=args.temperature, seed=args.seed,
                               top_k=args.top_k, top_p=args.top_p, min_p=args.min_p):
        if t_first is None:
            t_first = time.perf_counter()
        n += 1
        piece = decoder.push(token)
        if not started:
            piece = piece.lstrip()
            started = bool(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    tail = decoder.flush()
    sys.stdout.write((tail if started else tail.lstrip()) + "\n")
    t2 = time.perf_counter()
    t_first = t_first or t2
    read_ms = (t_first - t1) * 1000
    gen_ms = (t2 - t_first) * 1000
    _log(f"strata generate: prompt {len(ids)} tokens read in {read_ms:.0f} ms incl. compilation "
         f"({len(ids) / max(read_ms / 1000, 1e-9):.1f} tok/s), {n} generated in {gen_ms:.0f} ms "
         f"({max(n - 1, 0) / max(gen_ms / 1000, 1e-9):.1f} tok/s)")
    return 0


def _check_device(settings: Settings) -> None:
    """--device names a device this machine has (StrataError in the flag's words otherwise)."""
    from strata.serve.server import check_device
    check_device(settings)


def cmd_serve(args: argparse.Namespace) -> int:
    settings = load_settings(args.config, {key: getattr(args, key) for key in KEYS})
    if settings.ray.replicas > 0 or settings.ray.ray_address:
        try:
            from strata.serve.ray_app import serve_ray
        except ImportError as e:
            raise StrataError(f"--replicas needs Ray Serve ({e}); install it with pip install 'strata[ray]'") from None
        return serve_ray(settings)
    from strata.serve.server import serve_forever
    return serve_forever(settings)


# The settings flags of generate and profile: the model and backend groups
ENGINE_FLAGS = ("model", "dtype", "kv", "max_context", "rope_scaling", "rope_scale", "control_vector", "backend", "device",
                "kernels")
# generate also takes the expert settings, so a pack can be tried with a small cache before it is served
GENERATE_FLAGS = ENGINE_FLAGS + tuple(k for k in KEYS if SPECS[k].group == "experts")


def _add_setting_flags(parser: argparse.ArgumentParser, keys, required=()) -> None:
    """A flag per setting, made from its field in strata/config.py: the name from the key, the type and help from
    the field; every flag defaults to None (unset), so a config file or the field's default applies. A value the
    field's type does not take is kept as text, for the one validation to refuse naming the flag."""
    for group, cls in GROUPS.items():
        specs = [SPECS[k] for k in keys if SPECS[k].group == group]
        if not specs:
            continue
        g = parser.add_argument_group(f"{group} settings", cls.__doc__)
        for spec in specs:
            help_text = spec.flag_help.replace("%", "%%")
            if spec.types == (bool,):
                g.add_argument(spec.flag, dest=spec.key, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
            else:
                g.add_argument(spec.flag, dest=spec.key, type=spec.from_text, default=None,
                               required=spec.key in required, help=help_text,
                               metavar="N" if set(spec.types) & {int, float} else spec.key.upper())


def cmd_profile(args: argparse.Namespace) -> int:
    """Run prompts through the model with every expert resident and record how often each expert is routed to."""
    from strata import Engine
    from strata.experts.profile import save_profile
    try:
        lines = [ln for ln in open(args.prompts, encoding="utf-8").read().splitlines() if ln.strip()]
    except OSError as e:
        raise StrataError(f"cannot read prompts file {args.prompts}: {e.strerror or e}") from None
    if not lines:
        raise StrataError(f"prompts file {args.prompts} has no prompts (one prompt per non-empty line)")
    t0 = time.perf_counter()
    settings = Settings.build(**ONE_SEQUENCE).with_values(_flag_settings(args, ENGINE_FLAGS), as_flag=True)
    _check_device(settings)
    engine = Engine.load(settings=settings, say=_log)
    if engine.experts is None:
        raise StrataError(f"{args.model} has no routed experts to profile")
    if engine.tokenizer is None:
        raise StrataError(f"{args.model} has no tokenizer.json beside it; profile needs one to encode the prompts")
    engine.record_routing = True
    tok, tokens = engine.tokenizer, 0
    for text in lines:
        text = text.replace("\\n", "\n")
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
        ids = ids[:max(1, engine.settings.model.max_context - args.max_tokens)]
        out = engine.generate(ids, args.max_tokens)
        tokens += len(ids) + len(out) - 1                  # the last generated token is not read back
    counts = engine.experts.cache.routed
    save_profile(args.out, counts, str(args.model), tokens)
    share = np.sort(counts, axis=1)[:, ::-1]
    top = int(np.ceil(0.2 * counts.shape[1]))
    frac = share[:, :top].sum() / max(share.sum(), 1)
    _log(f"strata profile: {len(lines)} prompts, {tokens} tokens, {int(counts.sum())} routes over "
         f"{counts.shape[0]} layers x {counts.shape[1]} experts in {time.perf_counter() - t0:.1f} s; the top 20% of "
         f"each layer's experts took {100 * frac:.0f}% of its routes; written to {args.out}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from strata.doctor import doctor
    print(doctor())
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    from strata.experts.pack import write_pack
    t0 = time.perf_counter()
    bar = _ProgressBar("strata pack", sys.stderr)
    try:
        out = write_pack(args.model, args.out, args.experts, progress=bar, force=args.force)
    finally:
        bar.close()
    elapsed = time.perf_counter() - t0
    from strata.experts.pack import PackReader
    with PackReader(out) as pack:
        size = pack.n_blobs * pack.blob_bytes
        n_experts, n_layers, fmt = pack.n_experts, len(pack.expert_layers), pack.format
    mib = size / 2**20
    resumed = f" (resumed after {bar.first} of {bar.total} blobs)" if bar.first else ""
    _log(f"strata pack: {n_experts} experts x {n_layers} layers in {fmt} = {mib:.2f} MiB, written and verified in "
         f"{elapsed:.1f} s ({mib / max(elapsed, 1e-9):.0f} MiB/s){resumed} to {out}")
    return 0


class _ProgressBar:
    """progress(done, total) -> a bar on stderr: one line redrawn with \\r on a terminal, else a line per 10%."""

    def __init__(self, name: str, stream, width: int = 30):
        self.name, self.stream, self.width = name, stream, width
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.first = None
        self.total = 0
        self.last_tenth = -1
        self.drawn = False
        self.drawn_at = 0.0

    def __call__(self, done: int, total: int) -> None:
        if self.first is None:
            self.first = done
        self.total = total
        frac = done / total if total else 1.0
        if self.tty:
            now = time.monotonic()
            if done not in (self.first, total) and now - self.drawn_at < 0.1:
                return
            self.drawn_at = now
            filled = int(frac * self.width)
            self.stream.write(f"\r{self.name}: [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} "
                              f"blobs ({frac * 100:.0f}%)")
            self.stream.flush()
            self.drawn = True
        else:
            tenth = int(frac * 10)
            if tenth > self.last_tenth:
                self.last_tenth = tenth
                print(f"{self.name}: {done}/{total} blobs ({tenth * 10}%)", file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty and self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def cmd_train_tiny(args: argparse.Namespace) -> int:
    from dataclasses import replace
    from pathlib import Path

    from strata import train_tiny
    # OpenMP threads that spin while they wait at barriers multiply a run's time when other work shares the cores;
    # waiting passively costs little when nothing does (it changes no result: the work is split the same way)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise StrataError(f"train-tiny needs torch and transformers ({e}); install them with "
                          f"pip install -e '.[train]'") from None
    recipe = train_tiny.QUICK_RECIPE if args.quick else train_tiny.TINY_RECIPE
    recipe = replace(recipe, **{k: v for k, v in (("steps", args.steps), ("seed", args.seed)) if v is not None})
    if recipe.steps < 1:
        raise StrataError(f"--steps must be at least 1, found {recipe.steps}")
    out = Path(args.out)
    log_path = Path(args.log) if args.log else out / "training_log.jsonl"
    train_tiny.train(recipe, out, log_path, threads=args.threads, say=_log)
    if args.plot:
        train_tiny.plot(log_path, Path(args.plot))
        _log(f"strata train-tiny: loss curves drawn in {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata", description="Serve Mixture-of-Experts models larger than the GPU.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    g = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout",
                       description="Generate text from a prompt and stream it to stdout (logs go to stderr).")
    g.add_argument("--prompt", required=True, help="the user message (rendered with the model's chat template)")
    g.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")
    g.add_argument("--max-tokens", type=int, default=64, metavar="N", help="tokens to generate at most (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K likeliest tokens; 0 = off (default)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="keep the likeliest tokens up to probability P; 1 = off (default)")
    g.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="drop tokens below P times the likeliest one's probability; 0 = off (default)")
    g.add_argument("--seed", type=int, default=None, metavar="N", help="a seeded request is reproducible")
    _add_setting_flags(g, GENERATE_FLAGS)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model over an OpenAI-compatible HTTP API (chat and text completions, "
                                   "streamed or not, /v1/models, /health, /slots, /metrics). Every flag has a "
                                   "config-file key of the same name (--max-context -> max_context); flags override "
                                   "the file. With no arguments it serves the demo model (random weights) on "
                                   "127.0.0.1:8080; --model tiny serves the small model trained on Python's "
                                   "documentation.")
    s.add_argument("--config", default=None, metavar="FILE.toml", help="TOML file of settings (see configs/demo.toml)")
    _add_setting_flags(s, KEYS)
    s.set_defaults(func=cmd_serve)

    k = sub.add_parser("pack", help="write a model's pack: experts as aligned, checksummed blobs for SSD streaming",
                       description="Write a model as a Strata pack directory: every routed expert quantised into one "
                                   "4096-aligned blob of experts.bin (with a crc32 each in checksums.bin), the other "
                                   "tensors in dense.safetensors, the tokenizer files copied, pack.json last. An "
                                   "interrupted run continues where it stopped when rerun with the same arguments.")
    k.add_argument("--model", required=True, help="checkpoint directory, .gguf file, 'demo' or 'tiny'")
    k.add_argument("--out", required=True, metavar="DIR", help="the pack directory to write")
    k.add_argument("--experts", default="int4", metavar="FORMAT",
                   help="expert format: int4 (default) | int8 | nvfp4 | bf16 | f32")
    k.add_argument("--force", action="store_true", help="overwrite an existing, unfinished or mismatched pack")
    k.set_defaults(func=cmd_pack)

    f = sub.add_parser("profile", help="record how often each expert is routed to, for the initial placement",
                       description="Run the prompts (one per line of FILE; \\n inside a line is a newline) through "
                                   "the model with every expert resident, generating --max-tokens after each, and "
                                   "write the routing counts per (layer, expert) to a profile file that "
                                   "`strata serve --profile` places experts by.")
    f.add_argument("--prompts", required=True, metavar="FILE", help="text file, one prompt per line")
    f.add_argument("--out", required=True, metavar="FILE.json", help="the profile to write")
    f.add_argument("--max-tokens", type=int, default=32, metavar="N",
                   help="tokens generated after each prompt (default 32)")
    _add_setting_flags(f, ENGINE_FLAGS, required=("model",))
    f.set_defaults(func=cmd_profile)

    t = sub.add_parser("train-tiny", help="train the built-in `tiny` model on this CPU (about an hour; needs torch)",
                       description="Train the built-in `tiny` model (the one `--model tiny` serves) from scratch on "
                                   "the CPU: a Qwen3-Next-architecture MoE with an MTP head, and its byte-level BPE "
                                   "tokenizer, learnt from Python's documentation topics (pydoc_data) and the "
                                   "standard library's docstrings, with a seeded part held out. Writes a Hugging "
                                   "Face checkpoint directory (config.json, model.safetensors, tokenizer files) and "
                                   "a JSON-lines log: losses per step, held-out loss against a unigram model's, "
                                   "the MTP head's draft acceptance, greedy sample answers. The same seed, thread "
                                   "count and Python version reproduce the committed checkpoint. Needs torch and "
                                   "transformers (pip install -e '.[train]'); --plot also needs matplotlib.")
    t.add_argument("--out", required=True, metavar="DIR", help="the checkpoint directory to write")
    t.add_argument("--log", default=None, metavar="FILE.jsonl",
                   help="the training log (default: DIR/training_log.jsonl)")
    t.add_argument("--plot", default=None, metavar="FILE.png", help="draw the loss curves of the log into this PNG")
    t.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps of {TINY_RECIPE.batch_size} x {TINY_RECIPE.seq_len} tokens "
                        f"(default {TINY_RECIPE.steps}, the committed model's)")
    t.add_argument("--seed", type=int, default=None, help=f"default {TINY_RECIPE.seed}, the committed model's")
    t.add_argument("--threads", type=int, default=2,
                   help="torch threads (default 2, as the committed model was trained; another count sums in "
                        "another order, so the weights differ within noise)")
    t.add_argument("--quick", action="store_true",
                   help="a seconds-long smoke run: a toy model, 2 steps, a sliver of the corpus (for tests)")
    t.set_defaults(func=cmd_train_tiny)

    d = sub.add_parser("doctor", help="list the devices each backend sees, and why one is missing",
                       description="List the JAX and SYCL devices this machine has, and for a missing one what was "
                                   "looked for.")
    d.set_defaults(func=cmd_doctor)
    return p


def commands_markdown(parser: argparse.ArgumentParser) -> str:
    """docs/configuration.md's commands section: each command's own flags, from the parser that --help prints."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    lines = ["", "## Commands", ""]
    for name, p in sub.choices.items():
        lines += [f"### strata {name}", "", p.description, ""]
        settings = [g for g in p._action_groups if g.title.endswith(" settings") and g._group_actions]
        in_settings = {id(a) for g in settings for a in g._group_actions}
        own = [a for a in p._actions if a.option_strings and id(a) not in in_settings and a.dest != "help"]
        if own:
            lines += ["| flag | help |", "|---|---|"]
            for a in own:
                flag = ", ".join(f"`{o}`" for o in a.option_strings) + (" (required)" if a.required else "")
                lines.append(f"| {flag} | {(a.help or '').replace('|', chr(92) + '|')} |")
        if settings:
            names = [g.title.removesuffix(" settings") for g in settings]
            lines += ["", "And the flags of the settings groups " + ", ".join(f"[{n}](#{n})" for n in names) + "."]
        lines.append("")
    return "\n".join(lines)


def configuration_markdown() -> str:
    """docs/configuration.md (`make docs` writes it; a test keeps it equal): every setting, then every command."""
    return markdown() + commands_markdown(build_parser())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except StrataError as e:
        print(f"strata {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
