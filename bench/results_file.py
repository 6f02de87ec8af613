"""What every bench result carries (machine, date, commit) and where it is written: one place for all bench scripts."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = str(RESULTS.parents[1])
if ROOT not in sys.path:              # stamp() reads strata's own names: every bench script finds the package
    sys.path.insert(0, ROOT)


def commit() -> str:
    """STRATA_COMMIT when set (the lent GPU gets a copy of the tree, whose .git may be another commit's), else the
    checkout's short commit."""
    if os.environ.get("STRATA_COMMIT"):
        return os.environ["STRATA_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=Path(__file__).parent, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def server_xla_flags(mode: str | None = None) -> str:
    """The XLA flags the server sets (its command_buffer_update: the default, or `mode` as a config file sets it),
    applied before JAX starts: an engine bench measures the server's path, not XLA's defaults. Returns the line to
    log."""
    from strata.config import Settings
    from strata.jax_backend.xla_flags import command_buffer_update
    return command_buffer_update(mode or Settings().backend.command_buffer_update)


def stamp() -> dict:
    import jax

    from strata.jax_backend.xla_flags import SET_BY_STRATA
    d = jax.devices()[0]
    xla_flags, ours = os.environ.get("XLA_FLAGS", ""), os.environ.get(SET_BY_STRATA, "")
    return {"machine": f"{d.platform}:{getattr(d, 'device_kind', '')} ({platform.node()}, jax {jax.__version__})",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
            # compiler flags change timings: a result names them (the ones Strata sets by default apart)
            "xla_flags": xla_flags.replace(ours, "").strip() if ours else xla_flags, "default_xla_flags": ours}


def write(result: dict, out: str | None, default_name: str) -> Path:
    path = Path(out) if out else RESULTS / f"{default_name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path
