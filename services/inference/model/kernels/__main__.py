"""Build (or find cached) Keel's CPU kernels and print the paths this host runs.

    python -m services.inference.model.kernels     # exit status 1, with the reason, when unavailable
"""
import sys
import time

from services.inference.model.kernels import KernelUnavailable, load

t0 = time.perf_counter()
try:
    k = load()
except KernelUnavailable as e:
    print(f"keel kernels unavailable: {e.reason}", file=sys.stderr)
    sys.exit(1)
print(f"keel kernels: isa {k.isa} (this host runs {', '.join(k.isas)}); {k.path}; "
      f"ready in {time.perf_counter() - t0:.2f} s")
