#!/usr/bin/env bash
# Create the virtual environment (once) and install tightfit with the given extras.
# A torch that is already importable (system-wide, or in the venv) is kept. Without one,
# a machine with no GPU gets the CPU build pinned below instead of a multi-GB CUDA build;
# a machine with an NVIDIA or AMD GPU gets pip's default torch.
set -euo pipefail
extras="${1:-hf}"
venv="${TIGHTFIT_VENV:-.venv}"
python="${PYTHON:-python3}"
cpu_torch="${TIGHTFIT_CPU_TORCH:-torch==2.13.0}"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv --system-site-packages "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet)
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 || command -v rocm-smi >/dev/null 2>&1; then
        "${pip[@]}" install torch
    else
        # TORCH_INDEX_URL (e.g. PyTorch's CPU wheel index) where the default index serves CUDA builds.
        "${pip[@]}" install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$cpu_torch"
    fi
fi
"${pip[@]}" install -e ".[$extras]"
# The command is not on PATH until the venv is activated: say where it is.
echo "tightfit is installed in $venv: run $venv/bin/tightfit, or 'source $venv/bin/activate' to put it on PATH"
