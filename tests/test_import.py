"""``import tightfit`` does no device work, loads no plugin and imports nothing heavy. How
long it takes is measured by benchmarks/import_time.py, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys

#: Modules that only the first use of a feature may import, never ``import tightfit``.
HEAVY = ("numba", "transformers", "safetensors", "matplotlib", "rich", "tightfit.backends.cuda", "torch._dynamo")

PROBE = f"""
import json, sys
import torch
import tightfit
from tightfit.backends import registry
print(json.dumps({{
    "backends_loaded": registry._entries is not None,
    "cuda_initialized": torch.cuda.is_initialized(),
    "heavy_modules": sorted(m for m in {HEAVY!r} if m in sys.modules),
}}))
"""


def test_import_touches_no_device_and_nothing_heavy():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"backends_loaded": False, "cuda_initialized": False, "heavy_modules": []}
