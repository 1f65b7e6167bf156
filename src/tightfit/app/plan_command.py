"""``tightfit plan``: the memory plan of the built-in model or a local Hugging Face folder.

Only the folder's config.json is read: the model is built on the meta device and
planned with fake tensors, so a model larger than this machine plans as fast as a
small one.
"""

from __future__ import annotations

from typing import Any

import torch

from tightfit.memory.plan import MemoryPlan, plan_memory

__all__ = ["plan_model"]


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def plan_model(*, model: str | None = None, batch: int = 8, seq: int = 128, backend: Any = None,
               training: bool = False, runtime: str = "compiled", order: str = "best") -> tuple[MemoryPlan, str]:
    """(plan, description of the model) for token ids of shape (batch, seq)."""
    from tightfit.app.models import default_model_dir, model_skeleton

    _positive("batch", batch)
    _positive("seq", seq)
    folder = default_model_dir() if model is None else model
    described = "all-MiniLM-L6-v2 (built-in default)" if model is None else str(model)
    skeleton, config = model_skeleton(folder)
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq > limit:
        raise ValueError(f"seq={seq} is longer than the model's max_position_embeddings ({limit})")
    skeleton.train(training)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    kwargs = {"use_cache": False} if getattr(config, "use_cache", None) is not None else {}
    if training:
        for parameter in skeleton.parameters():
            parameter.requires_grad_(True)
    plan = plan_memory(skeleton, ids, kwargs=kwargs, backend=backend, training=training, runtime=runtime, order=order)
    return plan, described
