"""The SYCL backend (dpnp + dpctl): Intel GPUs, and the OpenCL CPU device for tests.

Importing this package prepares the SYCL runtime's environment (runtime.prepare_environment: OCL_ICD_FILENAMES for
the OpenCL CPU runtime of the intel-opencl-rt wheel) and imports nothing else, so it is safe to import before dpctl.
`strata.sycl_backend.backend.SyclBackend` is the Backend; the registry imports it only when "sycl" is chosen.
"""
from strata.sycl_backend.runtime import prepare_environment

prepare_environment()

__all__ = ["prepare_environment"]
