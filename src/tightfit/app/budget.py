"""What ``tightfit run --budget`` adds to a run (private): the ``--allow`` names, the plan
made for the run's own inputs, and what its prediction covers.

A plan is made for one forward. An encoder's run is that forward (plus pooling), so the
plan's peak is the prediction. A causal LM's run is a generation: the prefill forward over
the prompt, then one-token forwards whose KV cache grows by a fixed number of bytes per
token; the plan is made for the prefill, and the cache's growth is added on top of it and
taken off the budget the planner sees, so that the whole generation stays within it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from tightfit._format import human_bytes
from tightfit.fitting import PLACEMENTS, STORAGES, Allow, FitError, Plan, fit

__all__: list[str] = []

_ALLOW_ACCEPTED = (f"comma-separated names, storages ({', '.join(STORAGES)}) and/or placements ({', '.join(PLACEMENTS)}), "
                   f"e.g. 'keep,float8,disk'")


def parse_allow(text: str) -> Allow:
    """The :class:`Allow` that ``--allow`` names: storages and placements in one list.

    Only the sets named are restricted: ``int8,nf4`` restricts storages and leaves every
    placement allowed; ``device`` rules out offloading and leaves every storage allowed.
    ``keep`` and ``device`` are always added (the planner must be able to leave a unit alone).
    """
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError(f"allow={text!r} names nothing; accepted: {_ALLOW_ACCEPTED}")
    unknown = [name for name in names if name not in STORAGES and name not in PLACEMENTS]
    if unknown:
        raise ValueError(f"allow={text!r} has {', '.join(map(repr, unknown))}, which is not accepted; accepted: {_ALLOW_ACCEPTED}")
    storages = {name for name in names if name in STORAGES}
    placements = {name for name in names if name in PLACEMENTS}
    return Allow(storage=frozenset(storages | {"keep"}) if storages else frozenset(STORAGES),
                 placement=frozenset(placements | {"device"}) if placements else frozenset(PLACEMENTS))


def coerce_allow(value: Allow | Mapping[str, Any] | str | None) -> Allow | None:
    """``RunOptions.allow`` as an :class:`Allow`: a ``--allow`` string, a mapping, an Allow, or None."""
    if value is None or isinstance(value, Allow):
        return value
    if isinstance(value, str):
        return parse_allow(value)
    if isinstance(value, Mapping):
        return Allow.coerce(value)
    raise TypeError(f"allow must be None, a str such as 'keep,float8,disk', an Allow or a dict with keys storage and placement, "
                    f"got {type(value).__name__}: {value!r}")


def kv_cache_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes a causal LM's KV cache grows by per token: keys and values of every layer."""
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * layers * kv_heads * head_dim * dtype.itemsize


@dataclass(frozen=True)
class Budgeted:
    """A plan for a run and what its prediction covers.

    ``kv_cache_bytes``: a causal LM's KV cache growth while decoding, added to the plan's
    peak for the whole generation (0 for an encoder); ``covers``: what is predicted, in words.
    """

    plan: Plan
    kv_cache_bytes: int
    covers: str

    @property
    def predicted_peak_bytes(self) -> int:
        return self.plan.predicted_peak_bytes + self.kv_cache_bytes


def plan_run(model: Any, example_inputs: dict, budget_bytes: int, *, device: torch.device, allow: Allow | None,
             kv_cache_bytes: int, covers: str) -> Budgeted:
    """Fit ``model`` for ``example_inputs`` (the forward the run makes, a causal LM's
    prefill) into ``budget_bytes`` less ``kv_cache_bytes`` (the cache's growth while
    decoding); ``fit`` raises FitError when nothing fits. The run is eager, where region
    hints save nothing, so the planner may not add them."""
    planned_budget = budget_bytes - kv_cache_bytes
    if planned_budget <= 0:
        raise ValueError(f"budget={human_bytes(budget_bytes)} ({budget_bytes} B) leaves nothing for the model: the KV cache's growth "
                         f"while decoding alone needs {human_bytes(kv_cache_bytes)} ({kv_cache_bytes} B); generate fewer tokens")
    try:
        plan = fit(model, example_inputs, planned_budget, backend=device, allow=replace(allow or Allow(), hints=False))
    except FitError as error:
        if not kv_cache_bytes:
            raise
        raise FitError(f"budget={human_bytes(budget_bytes)} ({budget_bytes} B) less {human_bytes(kv_cache_bytes)} ({kv_cache_bytes} B) "
                       f"of KV cache growth while decoding leaves the prefill forward {planned_budget} B. {error}",
                       budget_bytes=budget_bytes, smallest_peak_bytes=error.smallest_peak_bytes + kv_cache_bytes,
                       parts=error.parts) from None
    return Budgeted(plan, kv_cache_bytes, covers)
