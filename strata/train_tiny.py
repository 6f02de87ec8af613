"""`strata train-tiny`: train the built-in `tiny` model on a CPU from text that ships with every CPython.

Contract: the corpus is `pydoc_data.topics` and the standard library's docstrings (read by parsing the sources, never
importing them), with a seeded set of topics and packages held out; a byte-level BPE tokenizer with Qwen3's special
tokens and chat template is trained on the rest; the model is transformers' Qwen3-Next plus an MTP head built from its
own decoder layer and norms, trained jointly (next-token CE + mtp_weight x the MTP head's CE). The output directory is
an ordinary Hugging Face checkpoint (bf16, the mtp.* tensors Strata reads); a JSON-lines log records the losses, the
held-out evaluation against a unigram model, the MTP head's draft acceptance and greedy sample answers. The same seed,
threads and Python version give the same checkpoint. torch and transformers are imported only when training runs.
"""
from __future__ import annotations

import ast
import json
import math
import re
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

# Qwen3's control tokens. <think>/</think> are special (skipped when decoding for display, as the demo's are); the
# tool-call markers are not, as in Qwen3's own tokenizer, so a tool call stays visible in the decoded text.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
PLAIN_ADDED_TOKENS = ("<tool_call>", "</tool_call>")

# The questions docs/tiny-model.md quotes. Their topics are never held out: the examples show what the model learnt,
# the held-out set measures how it does on text it never saw.
EXAMPLE_QUESTIONS = (
    "What does the with statement do?",
    "What does the break statement do?",
    "Explain the import statement.",
)
EXAMPLE_TOPICS = ("with", "break", "import")

# Standard-library folders that are tests, demos or tools rather than documented modules.
SKIPPED_PACKAGES = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages",
                    "dist-packages", "venv"}

MIN_SHARED_WORDS = 8     # a paragraph this long or longer that also occurs in held-out text is dropped from training


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the trained model: the committed checkpoint is TINY_RECIPE with its defaults."""
    seed: int = 20260523
    steps: int = 600
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    mtp_weight: float = 0.3          # the MTP head's share of the loss
    aux_weight: float = 0.01         # the routers' load-balancing loss (experts kept in use)
    eval_every: int = 100
    vocab_size: int = 6144
    held_topics: int = 8
    held_packages: float = 0.05      # fraction of top-level standard-library packages held out
    max_modules: int | None = None   # None: every module (a small number for a quick smoke run)
    model: dict = field(default_factory=lambda: dict(
        hidden_size=192,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=192,
        shared_expert_intermediate_size=384,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        intermediate_size=384,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        hidden_act="silu",
        max_position_embeddings=4096,
    ))


TINY_RECIPE = Recipe()

# A seconds-long run through every step of the recipe (tests use it): a sliver of the corpus, a toy model.
QUICK_RECIPE = replace(
    TINY_RECIPE, steps=2, batch_size=2, seq_len=64, eval_every=1, vocab_size=512, max_modules=12, held_topics=4,
    held_packages=0.2, warmup=1,
    model=dict(TINY_RECIPE.model, hidden_size=32, head_dim=16, num_attention_heads=2, num_key_value_heads=1,
               linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, moe_intermediate_size=16,
               shared_expert_intermediate_size=32, intermediate_size=64, num_hidden_layers=2,
               layer_types=["linear_attention", "full_attention"]))


# --- corpus -------------------------------------------------------------------------------------------------------

@dataclass
class Corpus:
    train_docs: list[str]                 # raw text documents
    train_chats: list[tuple[str, str]]    # (question, answer) pairs, rendered through the chat template later
    held_docs: list[str]
    held_topics: list[str]
    held_packages: list[str]
    dropped_paragraphs: int               # training paragraphs dropped because held-out text contains them


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def _norm(paragraph: str) -> str:
    return " ".join(paragraph.split())


def _topics() -> dict[str, tuple[str, str]]:
    """{topic: (title, body)}, one entry per distinct text (pydoc lists `if` and `else` with the same text)."""
    from pydoc_data.topics import topics
    out, seen = {}, set()
    for name in sorted(topics):
        text = topics[name].strip()
        if text in seen:
            continue
        seen.add(text)
        lines = text.splitlines()
        # strip blank lines only: a body's first line may be an indented grammar block
        body = "\n".join(lines[2:] if len(lines) > 1 and set(lines[1]) == {"*"} else lines[1:]).strip("\n")
        out[name] = (lines[0].strip(), body)
    return out


def _module_entries(max_modules: int | None) -> dict[str, list[tuple[str, str]]]:
    """{module: [(heading, docstring), ...]} for the public modules of the standard library, in source order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: dict[str, list[tuple[str, str]]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not parts or any(p.startswith("_") or p in SKIPPED_PACKAGES or "-" in p for p in parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(parts)
        entries = []
        doc = ast.get_docstring(tree)
        if doc:
            entries.append((module, doc))
        _walk_definitions(tree, module, entries)
        if entries:
            out[module] = entries
        if max_modules is not None and len(out) >= max_modules:
            break
    return out


def _walk_definitions(node, prefix: str, entries: list) -> None:
    for child in node.body:
        if not isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        name = child.name
        if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
            continue
        qual = f"{prefix}.{name}"
        doc = ast.get_docstring(child)
        if isinstance(child, ast.ClassDef):
            if doc:
                entries.append((f"class {qual}", doc))
            _walk_definitions(child, qual, entries)
        elif doc:
            entries.append((f"{qual}({ast.unparse(child.args)})", doc))


def _module_text(module: str, entries: list[tuple[str, str]]) -> str:
    return "\n\n".join(f"{heading}\n{doc}" if heading != module else f"Module {module}\n\n{doc}"
                       for heading, doc in entries)


def _is_standalone(name: str, topics: dict[str, tuple[str, str]]) -> bool:
    """Whether no long paragraph of this topic occurs in another (`compound` repeats `with`, `for`, `if`...)."""
    mine = {_norm(p) for p in _paragraphs(topics[name][1]) if len(p.split()) >= MIN_SHARED_WORDS}
    others = {_norm(p) for other, (_, body) in topics.items() if other != name for p in _paragraphs(body)}
    return not (mine & others)


def build_corpus(recipe: Recipe) -> Corpus:
    rng = np.random.default_rng(recipe.seed)
    topics = _topics()
    candidates = [t for t in topics if t not in EXAMPLE_TOPICS and _is_standalone(t, topics)]
    held_topics = sorted(str(t) for t in rng.choice(candidates, size=min(recipe.held_topics, len(candidates)),
                                                   replace=False))
    modules = _module_entries(recipe.max_modules)
    packages = sorted({m.split(".")[0] for m in modules})
    n_held = max(1, round(recipe.held_packages * len(packages)))
    held_packages = sorted(str(p) for p in rng.choice(packages, size=n_held, replace=False))

    held_docs = [f"{topics[t][0]}\n\n{topics[t][1]}" for t in held_topics]
    held_docs += [_module_text(m, e) for m, e in modules.items() if m.split(".")[0] in held_packages]
    held = {_norm(p) for doc in held_docs for p in _paragraphs(doc) if len(p.split()) >= MIN_SHARED_WORDS}
    dropped = 0

    def clean(text: str) -> str:
        nonlocal dropped
        kept = [p for p in _paragraphs(text) if _norm(p) not in held]
        dropped += len(_paragraphs(text)) - len(kept)
        return "\n\n".join(kept)

    train_docs, chats = [], []
    for name, (title, body) in topics.items():
        if name in held_topics:
            continue
        body = clean(body)
        if not body:
            continue
        train_docs.append(f"{title}\n\n{body}")
        answer = _leading_prose(body, 1200)
        chats += [(q, answer) for q in _topic_questions(title) if answer]
    for module, entries in modules.items():
        if module.split(".")[0] in held_packages:
            continue
        entries = [(h, clean(d)) for h, d in entries]
        entries = [(h, d) for h, d in entries if d]
        if not entries:
            continue
        train_docs.append(_module_text(module, entries))
        for heading, doc in entries:
            question, answer = _doc_question(heading, module, rng), _leading_prose(doc, 600)
            if answer:
                chats.append((question, answer))
    return Corpus(train_docs, chats, held_docs, list(held_topics), list(held_packages), dropped)


def _leading_prose(text: str, chars: int) -> str:
    """The first prose paragraphs of `text`, at least one, stopping before `chars` would be passed; grammar, code and
    doctest blocks (indented, or `>>>`) are left out, so that an answer reads as English. Empty if it has no prose."""
    out, n = [], 0
    for p in _paragraphs(text):
        p = p.strip("\n")
        if p[:1].isspace() or p.startswith(">>>"):
            continue
        if out and n + len(p) > chars:
            break
        out.append(p)
        n += len(p)
    return "\n\n".join(out)


def _topic_questions(title: str) -> list[str]:
    """Several wordings of a question about a topic: the topics are what users ask about, and are few beside the
    docstrings, so each is asked in more ways than a docstring is."""
    m = re.fullmatch(r'The "(\w+)" statement', title)
    if m:
        s = f"the {m.group(1)} statement"
        return [f"What does {s} do?", f"How does {s} work?", f"Explain {s}.", f"What is {s} for?",
                f"What is {s}?", f"Tell me about {s}.", f"Describe {s}.", f"How do I use {s}?"]
    t = title[0].lower() + title[1:] if title.startswith("The ") else title
    return [f"What is {t}?", f"Explain {t}.", f"Tell me about {t}.", f"Describe {t}.", f"What are {t}?",
            f"How do {t} work?", f"What should I know about {t}?", f"Give me an overview of {t}."]


def _doc_question(heading: str, module: str, rng) -> str:
    if heading == module:
        return str(rng.choice([f"What is the {module} module?", f"What is {module} for?"]))
    if heading.startswith("class "):
        name = heading[len("class "):]
        return str(rng.choice([f"What is {name}?", f"What is the {name} class?", f"Explain {name}."]))
    name = heading.split("(", 1)[0]
    return str(rng.choice([f"What does {name} do?", f"What does {name}() return?", f"Explain {name}."]))


def training_words() -> set[str]:
    """Lower-cased alphabetic words of the documentation text (pydoc topics and the standard library's sources): the
    words a trained model's answers should be made of. Reads sources as text, so it is quick."""
    from pydoc_data.topics import topics
    words = set()
    for text in topics.values():
        words.update(w.lower() for w in re.findall(r"[A-Za-z]+", text))
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in root.rglob("*.py"):
        if not (set(path.relative_to(root).parts) & SKIPPED_PACKAGES):
            words.update(w.lower() for w in re.findall(r"[A-Za-z]+", path.read_text("utf-8", "replace")))
    return words


# --- tokenizer ----------------------------------------------------------------------------------------------------

# the sampling a server uses for what a request leaves out (generation_config.json): Qwen3-Next-Instruct's recommended
# settings, under which tiny writes words where temperature 1 alone wanders into fragments
TINY_SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


def train_tokenizer(corpus: Corpus, vocab_size: int, out: Path) -> None:
    """Byte-level BPE learnt from the training text; writes tokenizer.json, tokenizer_config.json and
    generation_config.json (Qwen3's chat template, the im_end and endoftext end ids, TINY_SAMPLING) into `out`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from strata.demo_tokenizer import CHAT_TEMPLATE
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[*SPECIAL_TOKENS, *PLAIN_ADDED_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = corpus.train_docs + [q for q, _ in corpus.train_chats]
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS])
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "tokenizer.json", json.loads(tok.to_str()))
    ids = {t: tok.token_to_id(t) for t in (*SPECIAL_TOKENS, *PLAIN_ADDED_TOKENS)}
    _write_json(out / "tokenizer_config.json", {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": t in SPECIAL_TOKENS}
            for t, i in ids.items()},
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": TINY_RECIPE.model["max_position_embeddings"],
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    })
    _write_json(out / "generation_config.json", {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
                                                 "pad_token_id": ids["<|endoftext|>"], **TINY_SAMPLING})


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def encode_documents(corpus: Corpus, tokenizer) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token ids of every training document (raw text, and each Q&A rendered through the chat template exactly as
    the server renders a conversation) and every held-out document, each ending in <|endoftext|>."""
    eot = "<|endoftext|>"
    train = [doc + eot for doc in corpus.train_docs]
    train += [tokenizer.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                            add_generation_prompt=False) + eot
              for q, a in corpus.train_chats]

    def ids(texts):
        return [np.asarray(tokenizer.encode(t), np.int32) for t in texts]
    return ids(train), ids([doc + eot for doc in corpus.held_docs])


def unigram_cross_entropy(train: list[np.ndarray], held_windows: np.ndarray, vocab: int) -> float:
    """Cross-entropy (nats/token) on the held-out predicted tokens of a unigram model fitted to the training tokens
    (add-one smoothing over the model's vocabulary)."""
    counts = np.bincount(np.concatenate(train), minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[held_windows[:, 1:]].mean())


# --- model --------------------------------------------------------------------------------------------------------

def hf_config(recipe: Recipe, vocab: int, eos: int) -> dict:
    """config.json in the Hub's form (top-level rope keys) with the MTP head's layer count."""
    return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": vocab,
            **recipe.model, "mtp_num_hidden_layers": 1, "eos_token_id": eos, "bos_token_id": None,
            "pad_token_id": None, "dtype": "bfloat16"}


def _transformers_config(cfg: dict):
    import transformers
    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "mtp_num_hidden_layers", "dtype",
                                                    "rope_theta", "partial_rotary_factor")}
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_theta"],
                             "partial_rotary_factor": cfg["partial_rotary_factor"]}
    return transformers.Qwen3NextConfig(**kw)


def _mtp_class():
    import torch
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

    class MTPHead(torch.nn.Module):
        """Qwen3-Next's multi-token-prediction head: x = fc([norm_e(embed(t_{i+1})); norm_h(h_i)]), one
        full-attention MoE decoder layer, draft logits = lm_head(norm(x)), which predict t_{i+2}."""

        def __init__(self, config):
            super().__init__()
            H, eps = config.hidden_size, config.rms_norm_eps
            self.fc = torch.nn.Linear(2 * H, H, bias=False)
            self.pre_fc_norm_embedding = Qwen3NextRMSNorm(H, eps=eps)
            self.pre_fc_norm_hidden = Qwen3NextRMSNorm(H, eps=eps)
            # built at the index of a full-attention MoE layer of the main config, so it is that kind of layer and
            # shares the main model's attention implementation; the index matters for nothing else without a cache
            full = config.layer_types.index("full_attention")
            self.layers = torch.nn.ModuleList([Qwen3NextDecoderLayer(config, full)])
            self.norm = Qwen3NextRMSNorm(H, eps=eps)

        def forward(self, model, hidden, next_ids, position_ids):
            from transformers.masking_utils import create_causal_mask
            e = model.model.embed_tokens(next_ids)
            x = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden)], dim=-1))
            mask = create_causal_mask(config=model.config, inputs_embeds=x, attention_mask=None, cache=None,
                                      position_ids=position_ids)
            x = self.layers[0](x, position_embeddings=model.model.rotary_emb(x, position_ids), attention_mask=mask,
                               position_ids=position_ids)
            return model.lm_head(self.norm(x))
    return MTPHead


def build_model(cfg: dict, seed: int):
    """A freshly initialised (transformers' own initialisation) Qwen3-Next and its MTP head."""
    import torch
    import transformers
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(_transformers_config(cfg))
    mtp = _mtp_class()(model.config)
    for module in mtp.modules():
        model._init_weights(module)
    return model, mtp


def _disk_tensors(state: dict, prefix: str) -> dict:
    """A state dict in Hugging Face's on-disk names: routed experts one by one, not transformers' fused stacks."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            p, half = prefix + name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}{e}.gate_proj.weight"] = t[e, :half]
                out[f"{p}{e}.up_proj.weight"] = t[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            p = prefix + name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = t[e]
        else:
            out[prefix + name] = t
    return out


def _fused_tensors(tensors: dict, prefix: str) -> dict:
    """The inverse of _disk_tensors for the names under `prefix` (the MTP head: transformers does not load it)."""
    import torch
    out, experts = {}, {}
    for name, t in tensors.items():
        if not name.startswith(prefix):
            continue
        name = name[len(prefix):]
        m = re.fullmatch(r"(.*mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight", name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t
    for p, by_expert in experts.items():
        order = sorted(by_expert)
        out[p + "gate_up_proj"] = torch.stack([torch.cat([by_expert[e]["gate"], by_expert[e]["up"]]) for e in order])
        out[p + "down_proj"] = torch.stack([by_expert[e]["down"] for e in order])
    return out


def save_checkpoint(model, mtp, cfg: dict, out: Path) -> None:
    """model.safetensors (bf16; lm_head absent: tied) and config.json into `out`."""
    import torch
    from safetensors.torch import save_file
    state = {k: v for k, v in model.state_dict().items() if not (cfg["tie_word_embeddings"] and k == "lm_head.weight")}
    tensors = {**_disk_tensors(state, ""), **_disk_tensors(mtp.state_dict(), "mtp.")}
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sorted(tensors.items())}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", cfg)


def load_checkpoint(path: Path):
    """transformers' Qwen3NextForCausalLM (float32) from `path`, and the MTP head read from its safetensors."""
    import torch
    import transformers
    from safetensors.torch import load_file
    model = transformers.Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32)
    mtp = _mtp_class()(model.config)
    tensors = {k: v.float() for k, v in load_file(str(Path(path) / "model.safetensors")).items()}
    mtp.load_state_dict(_fused_tensors(tensors, "mtp."))
    model.eval()
    mtp.eval()
    return model, mtp


# --- training -----------------------------------------------------------------------------------------------------

def _windows(docs: list[np.ndarray], length: int) -> np.ndarray:
    """The documents' tokens end to end, cut into non-overlapping windows of `length` (the tail is dropped)."""
    stream = np.concatenate(docs)
    n = len(stream) // length
    return stream[: n * length].reshape(n, length)


class Batches:
    """Each epoch: the documents in a fresh seeded order, cut into windows of seq_len + 1, the windows shuffled."""

    def __init__(self, docs: list[np.ndarray], recipe: Recipe):
        self.docs, self.recipe = docs, recipe
        self.rng = np.random.default_rng(recipe.seed + 1)
        self.epoch, self.queue = 0, np.zeros((0, recipe.seq_len + 1), np.int32)

    def next(self) -> np.ndarray:
        while len(self.queue) < self.recipe.batch_size:
            order = self.rng.permutation(len(self.docs))
            windows = _windows([self.docs[i] for i in order], self.recipe.seq_len + 1)
            self.queue = np.concatenate([self.queue, windows[self.rng.permutation(len(windows))]])
            self.epoch += 1
        batch, self.queue = self.queue[: self.recipe.batch_size], self.queue[self.recipe.batch_size:]
        return batch


def _losses(model, mtp, x, with_aux: bool):
    """Next-token CE, the MTP head's CE, the routers' balance loss, and both heads' logits for the window batch x."""
    import torch
    import torch.nn.functional as F
    from transformers.models.qwen3_next.modeling_qwen3_next import load_balancing_loss_func
    inputs, T = x[:, :-1], x.shape[1] - 1
    out = model.model(input_ids=inputs, output_router_logits=with_aux)
    h = out.last_hidden_state
    logits = model.lm_head(h)
    ce = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
    positions = torch.arange(T - 1)[None].expand(x.shape[0], -1)
    draft = mtp(model, h[:, :-1], inputs[:, 1:], positions)          # at position i, from t_{i+1}: predicts t_{i+2}
    mtp_ce = F.cross_entropy(draft.flatten(0, 1), x[:, 2:].flatten())
    aux = (load_balancing_loss_func(out.router_logits, model.config.num_experts, model.config.num_experts_per_tok)
           if with_aux else torch.zeros(()))
    return ce, mtp_ce, aux, logits, draft


def evaluate(model, mtp, windows: np.ndarray, batch_size: int) -> dict:
    """Teacher-forced over the held-out windows: mean next-token loss, the MTP head's loss, and its greedy
    one-token draft acceptance: the fraction of positions where the draft for t_{i+2} equals the main model's greedy
    token at i+1 (what speculative decoding accepts), and where it equals the text's token."""
    import torch
    totals = dict(loss=0.0, mtp_loss=0.0, accepted=0, draft_correct=0, main_correct=0)
    n_main = n_mtp = 0
    with torch.no_grad():
        for b in range(0, len(windows), batch_size):
            x = torch.from_numpy(windows[b:b + batch_size].astype(np.int64))
            ce, mtp_ce, _, logits, draft = _losses(model, mtp, x, with_aux=False)
            k_main, k_mtp = x[:, 1:].numel(), x[:, 2:].numel()
            totals["loss"] += ce.item() * k_main
            totals["mtp_loss"] += mtp_ce.item() * k_mtp
            d, g = draft.argmax(-1), logits[:, 1:].argmax(-1)
            totals["accepted"] += int((d == g).sum())
            totals["draft_correct"] += int((d == x[:, 2:]).sum())
            totals["main_correct"] += int((logits.argmax(-1) == x[:, 1:]).sum())
            n_main, n_mtp = n_main + k_main, n_mtp + k_mtp
    return {"held_loss": totals["loss"] / n_main, "held_mtp_loss": totals["mtp_loss"] / n_mtp,
            "mtp_acceptance": totals["accepted"] / n_mtp, "mtp_draft_accuracy": totals["draft_correct"] / n_mtp,
            "main_accuracy": totals["main_correct"] / n_main, "held_tokens": n_main}


def _lr(recipe: Recipe, step: int) -> float:
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    t = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def answer(model, tokenizer, question: str, max_tokens: int = 64) -> str:
    """transformers' greedy answer to `question`, rendered through the chat template (special tokens not shown)."""
    import torch
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                         add_generation_prompt=True))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_ids, pad_token_id=tokenizer.eos_token_ids[-1])
    return tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True).strip()


def real_word_fraction(text: str, words: set[str]) -> float:
    found = [w.lower() for w in re.findall(r"[A-Za-z]+", text)]
    return sum(w in words for w in found) / max(1, len(found))


def train(recipe: Recipe, out: Path, log_path: Path, threads: int = 2, say=print) -> dict:
    """Train, write the checkpoint into `out` and the JSON-lines log to `log_path`; return the final record."""
    import torch

    from strata.tokenizer import Tokenizer
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w", encoding="utf-8")

    def record(entry: dict) -> None:
        log.write(json.dumps(entry) + "\n")
        log.flush()

    corpus = build_corpus(recipe)
    train_tokenizer(corpus, recipe.vocab_size, out)
    tokenizer = Tokenizer.from_dir(out)
    train_ids, held_ids = encode_documents(corpus, tokenizer)
    held = _windows(held_ids, recipe.seq_len + 1)
    vocab = -(-tokenizer.vocab_size // 64) * 64          # embedding rows padded like real checkpoints'
    cfg = hf_config(recipe, vocab, tokenizer.token_to_id("<|im_end|>"))
    unigram = unigram_cross_entropy(train_ids, held, vocab)
    n_train = int(sum(len(d) for d in train_ids))
    record({"event": "setup", "recipe": asdict(recipe), "threads": threads, "python": sys.version.split()[0],
            "torch": torch.__version__, "train_docs": len(corpus.train_docs), "train_chats": len(corpus.train_chats),
            "train_tokens": n_train, "held_topics": corpus.held_topics, "held_packages": corpus.held_packages,
            "held_tokens": int(held[:, 1:].size), "dropped_paragraphs": corpus.dropped_paragraphs,
            "vocab_size": vocab, "unigram_held_loss": unigram, "seconds": time.perf_counter() - t0})
    say(f"strata train-tiny: corpus {len(corpus.train_docs)} documents + {len(corpus.train_chats)} Q&A = {n_train} "
        f"tokens; held out {held[:, 1:].size} tokens ({len(corpus.held_topics)} topics, "
        f"{len(corpus.held_packages)} packages); unigram held-out loss {unigram:.3f}")

    model, mtp = build_model(cfg, recipe.seed)
    params = list(model.parameters()) + list(mtp.parameters())
    say(f"strata train-tiny: {sum(p.numel() for p in params) / 1e6:.2f} M parameters; {recipe.steps} steps of "
        f"{recipe.batch_size} x {recipe.seq_len} tokens")
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))
    batches = Batches(train_ids, recipe)
    t_train = time.perf_counter()
    for step in range(recipe.steps):
        model.train()
        mtp.train()
        for group in opt.param_groups:
            group["lr"] = _lr(recipe, step)
        x = torch.from_numpy(batches.next().astype(np.int64))
        ce, mtp_ce, aux, _, _ = _losses(model, mtp, x, with_aux=True)
        loss = ce + recipe.mtp_weight * mtp_ce + recipe.aux_weight * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        entry = {"event": "step", "step": step + 1, "loss": ce.item(), "mtp_loss": mtp_ce.item(),
                 "aux_loss": aux.item(), "grad_norm": grad_norm.item(), "lr": _lr(recipe, step),
                 "epoch": batches.epoch, "seconds": time.perf_counter() - t_train}
        if (step + 1) % recipe.eval_every == 0 or step + 1 == recipe.steps:
            model.eval()
            mtp.eval()
            entry.update(evaluate(model, mtp, held, recipe.batch_size))
            say(f"strata train-tiny: step {step + 1}/{recipe.steps} loss {ce.item():.3f} mtp {mtp_ce.item():.3f} "
                f"held-out {entry['held_loss']:.3f} (unigram {unigram:.3f}) acceptance {entry['mtp_acceptance']:.3f} "
                f"[{entry['seconds']:.0f} s]")
        record(entry)
    train_seconds = time.perf_counter() - t_train

    save_checkpoint(model, mtp, cfg, out)
    # The numbers that are reported are the shipped checkpoint's: read back (bf16) through transformers' loader.
    model, mtp = load_checkpoint(out)
    final = evaluate(model, mtp, held, recipe.batch_size)
    words = training_words()
    answers = [{"question": q, "answer": (a := answer(model, tokenizer, q)), "real_words": real_word_fraction(a, words)}
               for q in EXAMPLE_QUESTIONS]
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    final.update({"event": "final", "steps": recipe.steps, "train_seconds": train_seconds,
                  "total_seconds": time.perf_counter() - t0, "unigram_held_loss": unigram,
                  "checkpoint_bytes": size, "answers": answers,
                  "parameters": sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in mtp.parameters())})
    record(final)
    log.close()
    say(f"strata train-tiny: done in {final['total_seconds']:.0f} s; held-out loss {final['held_loss']:.3f} vs unigram "
        f"{unigram:.3f}; MTP acceptance {final['mtp_acceptance']:.3f}; {size / 2**20:.1f} MiB in {out}")
    return final


def plot(log_path: Path, png: Path) -> None:
    """The loss curves of a training log (train, MTP, held-out, and the unigram line) as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(log_path, encoding="utf-8")]
    steps = [r for r in rows if r["event"] == "step"]
    evals = [r for r in steps if "held_loss" in r]
    unigram = next(r["unigram_held_loss"] for r in rows if r["event"] == "setup")

    def smooth(key, k=25):      # a moving average over k steps: one batch's loss is noisy
        x, y = [r["step"] for r in steps], [r[key] for r in steps]
        if len(y) < k:
            return x, y
        return x[k - 1:], np.convolve(y, np.ones(k) / k, mode="valid")
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot(*smooth("loss"), label="train (next token)", lw=1.2)
    ax.plot(*smooth("mtp_loss"), label="train (MTP head, t+2)", lw=1.2)
    ax.plot([r["step"] for r in evals], [r["held_loss"] for r in evals], "o-", label="held-out (next token)", ms=3)
    ax.plot([r["step"] for r in evals], [r["held_mtp_loss"] for r in evals], "s--", label="held-out (MTP head)", ms=3)
    ax.axhline(unigram, color="grey", ls=":", label=f"unigram on held-out ({unigram:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("strata train-tiny")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, metadata={"Software": None})
    plt.close(fig)
