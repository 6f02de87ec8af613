"""`strata doctor`: the devices each backend sees, and why one is missing.

    from strata.doctor import doctor; print(doctor())
"""
from __future__ import annotations

import importlib.util
import os


def doctor() -> str:
    lines = ["strata doctor"]
    lines += _jax()
    lines += _sycl()
    lines.append(f"backend auto: {_auto()}")
    return "\n".join(lines)


def _jax() -> list[str]:
    if importlib.util.find_spec("jax") is None:
        return ["jax: not installed"]
    try:
        import jax
        out = [f"jax {jax.__version__}: default backend {jax.default_backend()}"]
        for d in jax.devices():
            out.append(f"  jax device {d.id}: {d.platform} {d.device_kind}")
        try:
            jax.devices("gpu")
        except RuntimeError as exc:
            out.append(f"  no JAX GPU: {str(exc).splitlines()[0]}")
        return out
    except Exception as exc:          # noqa: BLE001 - doctor reports, never raises
        return [f"jax: cannot list devices: {exc}"]


def _sycl() -> list[str]:
    from strata.sycl_backend import runtime
    s = runtime.prepare_environment()
    out = []
    if s.found:
        out.append(f"sycl OpenCL CPU runtime: {s.found} "
                   f"(OCL_ICD_FILENAMES={s.icd}{', set by strata' if s.icd_set_by_us else ', set before strata'})")
    else:
        out.append(f"sycl OpenCL CPU runtime: not found (looked for {s.looked_for})")
    for note in s.notes:
        out.append(f"  note: {note}")
    if not runtime.dpctl_installed():
        out.append("sycl: dpctl/dpnp not installed (pip install 'strata[sycl]'): no SYCL devices")
        return out
    try:
        import dpctl
        import dpnp
        out.append(f"sycl: dpctl {dpctl.__version__}, dpnp {dpnp.__version__}")
    except Exception as exc:          # noqa: BLE001
        out.append(f"sycl: dpctl/dpnp fail to import: {exc}")
        return out
    devices = runtime.list_devices()
    if not devices:
        out.append(f"sycl: no devices: {runtime.why_no_devices()}")
    for d in devices:
        out.append(f"  sycl device {runtime.describe(d)}")
    if not any(d.device_type.name == "gpu" for d in devices):
        why = "no GPU render node in /dev/dri" if not _render_nodes() else \
            f"render nodes {', '.join(_render_nodes())} exist but no SYCL GPU runtime (Level Zero / OpenCL GPU " \
            f"driver) reports a device; check the user's render/video groups"
        out.append(f"  no SYCL GPU: {why}")
    sel = os.environ.get("ONEAPI_DEVICE_SELECTOR")
    if sel:
        out.append(f"  ONEAPI_DEVICE_SELECTOR={sel} filters the devices above")
    return out


def _render_nodes() -> list[str]:
    try:
        return sorted(n for n in os.listdir("/dev/dri") if n.startswith("renderD"))
    except OSError:
        return []


def _auto() -> str:
    try:
        from strata.backend import _auto
        return _auto()
    except Exception as exc:          # noqa: BLE001
        return f"cannot decide: {exc}"


if __name__ == "__main__":
    print(doctor())
