"""Loading a model folder into a plan (D8): the plan is made from the config before any
weight is read, then the safetensors checkpoint streams in unit by unit, each unit
converted and placed as planned, so the budget holds from the first byte. See docs/load.md."""

from tightfit.loading.folder import CAUSAL_LM, ENCODER, checkpoint_dtype, folder_kind, model_kind, skeleton
from tightfit.loading.safetensors import Checkpoint
from tightfit.loading.save import save
from tightfit.loading.stream import default_inputs, load, plan_folder, stored_dtypes

__all__ = [
    "CAUSAL_LM",
    "ENCODER",
    "Checkpoint",
    "checkpoint_dtype",
    "default_inputs",
    "folder_kind",
    "load",
    "model_kind",
    "plan_folder",
    "save",
    "skeleton",
    "stored_dtypes",
]
