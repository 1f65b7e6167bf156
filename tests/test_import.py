"""``import tightfit`` does no device work, loads no plugin and stays fast."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys, time
import torch
start = time.perf_counter()
import tightfit
elapsed = time.perf_counter() - start
from tightfit.backends import registry
print(json.dumps({
    "seconds": elapsed,
    "backends_loaded": registry._entries is not None,
    "cuda_initialized": torch.cuda.is_initialized(),
    "heavy_modules": sorted(m for m in ("numba", "transformers", "rich", "tightfit.backends.cuda", "torch._dynamo") if m in sys.modules),
}))
"""


def test_import_touches_no_device_and_is_fast():
    timings = []
    for _ in range(2):  # the first run may pay for cold caches
        done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        facts = json.loads(done.stdout)
        assert facts["backends_loaded"] is False
        assert facts["cuda_initialized"] is False
        assert facts["heavy_modules"] == []
        timings.append(facts["seconds"])
    assert min(timings) < 0.5, timings
