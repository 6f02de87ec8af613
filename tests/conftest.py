import os
import sys

# test utilities (oracle.py, gguf_writer.py) live beside the tests
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
