"""Device kernels of the JAX backend: ops over packed expert blobs (XLA today; Pallas kernels join them here)."""
