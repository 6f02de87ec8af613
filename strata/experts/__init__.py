"""Experts off the GPU: the pack format that stores every routed expert as one aligned blob on disk, and the device
cache that holds the experts in use."""
