"""The JAX backend's kernel settings: one frozen value given when the backend is made
(`JaxBackend(kernel_config=...)`, `strata.backend.get_backend("jax", kernel_config=...)`) and never changed after.
The defaults are what the backend runs; other values are for comparison runs (bench/engine_speed.py,
bench/kernel_speed.py), whose results are then marked as comparisons. Which kernels run at all is the `kernels`
option (auto | xla | pallas), not this."""
from __future__ import annotations

from dataclasses import dataclass, fields

from strata.errors import ConfigError
from strata.jax_backend.kernels import expert_decode, gated_delta


def _pow2(n) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class KernelConfig:
    # the XLA chunked gated delta rule (prompt parts): tokens a chunk, a power of two from 16 to 256 (its exponent
    # mask holds chunk^3 floats)
    gdn_chunk: int = gated_delta.CHUNK
    # keys a loop step of the prompt parts' attention kernel (kernels/decode_attention.py prompt_attention): a power
    # of two from 16, or 0 for the kernel's own (BLOCK_K); fewer keys take less shared memory a program
    prompt_block_k: int = 0
    # the int4 decode expert kernel (kernels/expert_decode.py): gate/up rows a program and Triton warps a program
    # (powers of two), and the tokens a window from which it replaces XLA's decode form (at least 1)
    decode_expert_rows: int = expert_decode.BLOCK_ROWS
    decode_expert_warps: int = expert_decode.WARPS
    decode_expert_min_tokens: int = 1
    # routes (tokens x k) up to which a window's experts go through the decode kernel rather than the grouped
    # prompt-part kernel (whose blocks of EXPERT_BLOCK rows idle at a few rows an expert): 16 decode rows of top-10
    # measured faster through the decode kernel (docs/performance.md)
    decode_expert_max_routes: int = 256

    def __post_init__(self):
        if not (_pow2(self.gdn_chunk) and 16 <= self.gdn_chunk <= 256):
            raise ConfigError(f"gdn_chunk {self.gdn_chunk!r} must be a power of two from 16 to 256")
        if not (self.prompt_block_k == 0 or (_pow2(self.prompt_block_k) and self.prompt_block_k >= 16)):
            raise ConfigError(f"prompt_block_k {self.prompt_block_k!r} must be 0 (the kernel's) or a power of two "
                              f">= 16")
        for name in ("decode_expert_rows", "decode_expert_warps"):
            if not _pow2(getattr(self, name)):
                raise ConfigError(f"{name} {getattr(self, name)!r} must be a power of two")
        if not (isinstance(self.decode_expert_min_tokens, int) and self.decode_expert_min_tokens >= 1):
            raise ConfigError(f"decode_expert_min_tokens {self.decode_expert_min_tokens!r} must be an integer >= 1")
        if not (isinstance(self.decode_expert_max_routes, int) and self.decode_expert_max_routes >= 1):
            raise ConfigError(f"decode_expert_max_routes {self.decode_expert_max_routes!r} must be an integer >= 1")

    def changed(self) -> dict:
        """The fields that differ from their defaults, by name (what makes a run a comparison)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}
