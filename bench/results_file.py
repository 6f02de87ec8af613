"""What every bench result carries (machine, date, commit) and where it is written: one place for all bench scripts."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


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


def stamp() -> dict:
    import jax
    d = jax.devices()[0]
    return {"machine": f"{d.platform}:{getattr(d, 'device_kind', '')} ({platform.node()}, jax {jax.__version__})",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}     # compiler flags change timings: a result names them


def write(result: dict, out: str | None, default_name: str) -> Path:
    path = Path(out) if out else RESULTS / f"{default_name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path
