"""A packed demo model with a partial expert cache on a GPU under the server's XLA flags (or --xla-default): it
loads (its host mirror, pinned only where XLA's allocator allows) and generates; prints the path and the tokens.
    python bench/pinned_check.py [--xla-default]
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from strata.jax_backend.xla_flags import command_buffer_update  # noqa: E402

print(command_buffer_update("xla_default" if "--xla-default" in sys.argv else "skip_temp"), flush=True)
from strata import Engine  # noqa: E402
from strata.experts.pack import write_pack  # noqa: E402

pack = write_pack("demo", Path(tempfile.mkdtemp()) / "pack", "int4")
e = Engine.load(pack, expert_cache=8, max_context=256, prefill=16)
print("path:", e.path.describe(), "| host fetch:", e.backend.host_fetch is not None, flush=True)
print("tokens:", e.generate(list(range(1, 40)), 12, stop_token_ids=[]), flush=True)
