"""The deviceless compile tier (`make test-deviceless`, its own environment).

The CUDA plugin and libtpu provide compile-only topologies; the default backend stays the CPU
and the CUDA plugin skips its runtime checks (there is no GPU or CUDA runtime here).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
# Compile-only: no TPU is opened, so several processes (a test run beside the script) may load
# libtpu at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
