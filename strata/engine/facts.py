"""What a front end needs of a model without loading its weights: the parsed config, the tokenizer and the end
tokens. The Ray Serve ingress validates and tokenizes requests with it while the engine replicas hold the weights.

    facts = model_facts(settings)     # .cfg (ModelConfig), .tokenizer, .eos_token_ids
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from strata.config import Settings
from strata.model.config import ModelConfig


@dataclass(frozen=True)
class ModelFacts:
    cfg: ModelConfig
    tokenizer: object | None
    images: None = None          # a front end encodes no images (Engine.images: the replicas' own, not yet reached)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The same ids Engine.eos_token_ids gives: the tokenizer's, else the config's."""
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return tuple(self.tokenizer.eos_token_ids)
        return self.cfg.eos_token_ids


def model_facts(settings: Settings) -> ModelFacts:
    """The config and tokenizer of settings.model.model (a checkpoint directory, a .gguf file, a pack or a built-in
    name); tensors are opened lazily by the readers and never read here."""
    from strata.engine.core import _is_pack
    from strata.weights.source import load_source
    path = settings.model.model
    if _is_pack(path):
        from strata.experts.pack import PackReader
        pack = PackReader(path)
        config, tok_dir = pack.config, pack.dir
    else:
        config, _, tok_dir = load_source(path, settings.model.parts)
    tokenizer = None
    if tok_dir is not None and (Path(tok_dir) / "tokenizer.json").exists():
        from strata.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_dir(Path(tok_dir))
    return ModelFacts(ModelConfig.from_hf(config, source=f"{path} config"), tokenizer)
