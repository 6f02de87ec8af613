"""XLA flags Strata sets for itself, before JAX creates its GPU client (XLA reads XLA_FLAGS once, then).

command_buffer_update(mode, env): on an NVIDIA GPU, windows dispatched ahead run at the device's pace only when XLA
keeps a command buffer's temporaries at fixed addresses (its update mode SKIP_TEMP; TEMP_NEVER_UPDATE in newer XLA);
otherwise every window re-records its buffer and waits for the one running. The value's name differs between XLA
versions and a jaxlib aborts on one it does not know, so each candidate is tried in a child process first. A
command-buffer mode already in XLA_FLAGS is left alone. Returns the line to log. Imports no JAX itself.
pinned_host_usable: under any such mode XLA's allocator leaves no usable pinned host memory (window fetch is off).
"""
from __future__ import annotations

import os
import subprocess
import sys

FLAG = "--xla_gpu_command_buffer_update_mode"
CANDIDATES = ("SKIP_TEMP", "TEMP_NEVER_UPDATE")        # the names of the mode in XLA versions, newest last
NVIDIA_DRIVER = "/proc/driver/nvidia/version"
SET_BY_STRATA = "STRATA_XLA_FLAGS_SET"                 # the environment variable naming what was added


def pinned_host_usable(platform: str, xla_flags: str) -> bool:
    """Whether JAX's pinned host memory may be used: on a GPU, a command-buffer update mode in XLA_FLAGS switches XLA
    to its VMM allocator, under which putting an array in pinned host memory kills the process (a segmentation
    fault, jaxlib 0.11.2 on the H200); elsewhere it may."""
    return platform != "gpu" or FLAG not in xla_flags


def accepts(flag: str) -> bool:
    """Whether this Python's jaxlib starts with `flag` in XLA_FLAGS (a child process on the CPU: an unknown value
    aborts it, not us)."""
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip(), "JAX_PLATFORMS": "cpu"}
    code = "import jax, jax.numpy as jnp; jax.jit(lambda x: x + 1)(jnp.zeros(1)).block_until_ready()"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120).returncode == 0


def command_buffer_update(mode: str, env=os.environ, accepts=accepts, gpu: bool | None = None) -> str:
    """mode "skip_temp": set FLAG to the first candidate this jaxlib accepts, on a machine with an NVIDIA driver;
    "xla_default": leave XLA's own. env: the environment to set XLA_FLAGS in."""
    flags = env.get("XLA_FLAGS", "")
    if mode == "xla_default":
        return "command buffers: XLA's default update mode (command_buffer_update = xla_default)"
    if FLAG in flags:
        return f"command buffers: XLA_FLAGS already sets {FLAG}; left as given"
    if not (os.path.exists(NVIDIA_DRIVER) if gpu is None else gpu):
        return "command buffers: no NVIDIA driver here; XLA's default update mode"
    for name in CANDIDATES:
        if accepts(f"{FLAG}={name}"):
            env["XLA_FLAGS"] = f"{flags} {FLAG}={name}".strip()
            env[SET_BY_STRATA] = f"{FLAG}={name}"         # so a bench result can tell its default from a user's
            return (f"command buffers: {FLAG}={name} (windows dispatched ahead run at the device's pace; XLA's VMM "
                    f"allocator then leaves no pinned host memory, so offloaded experts are copied between layers, "
                    f"not fetched by the windows; command_buffer_update = xla_default turns it off)")
    return (f"command buffers: this jaxlib knows none of {', '.join(CANDIDATES)} for {FLAG}; XLA's default update mode "
            f"(windows dispatched ahead may wait for the one running)")
