"""The optimizer every rule of :mod:`tightfit.optim` is: a ``torch.optim.Optimizer`` whose
step is one op call per parameter (:mod:`tightfit.ops.optimizer`, dispatched on the
parameter's device), with 8-bit blockwise or 32-bit state in bitsandbytes' layout
(:mod:`tightfit.optim.state`).

Param groups hold bitsandbytes' keys (``lr``, ``betas``, ``eps``, ``weight_decay``, and
AdEMAMix's ``alpha``, ``t_alpha``, ``t_beta3``) so that state dicts load both ways, and
tightfit's own: ``optim_bits`` and ``min_8bit_size``, per group (an embedding's group in
32 bits, the rest in 8, as bitsandbytes users do with its global manager).

Paged state (``paged=True``) lives in host memory, page-locked where the parameter's
backend copies asynchronously, and is brought to the parameter's device for its update, the next
parameter's copy started on a side stream while this one updates (where the backend copies
asynchronously), then written back: the device holds at most two parameters' states at a
time. No managed memory is needed, so it works on any backend. For a parameter in host
memory, or on a backend that declares unified memory (Apple silicon), the state is already
where its update runs, so paged and resident state are the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from tightfit._validate import check_type
from tightfit.backends.registry import copy_streams, shares_host_memory
from tightfit.ops.optimizer import optimizer_update_8bit_blockwise, optimizer_update_32bit
from tightfit.optim.state import check_state, is_8bit, new_state, shared_maps, state_bytes

__all__ = ["BlockwiseOptimizer"]

_BITS = (8, 32)


def _check_hyper(name: str, value: Any, low: float, high: float | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low or (high is not None and value >= high):
        accepted = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name}={value!r} is not accepted; accepted: {accepted}")
    return float(value)


def check_group(group: dict[str, Any], rule: str) -> None:
    """A param group's settings, or a clear error naming the setting (D7)."""
    _check_hyper("lr", group["lr"], 0.0, None)
    _check_hyper("eps", group["eps"], 0.0, None)
    _check_hyper("weight_decay", group["weight_decay"], 0.0, None)
    betas = group["betas"]
    wanted = 3 if rule == "ademamix" else 2
    if not isinstance(betas, (tuple, list)) or len(betas) < wanted:
        raise ValueError(f"betas must be a tuple of {wanted} floats, got {betas!r}")
    for index, beta in enumerate(betas[:wanted]):
        _check_hyper(f"betas[{index}]", beta, 0.0, 1.0)
    if rule == "ademamix":
        _check_hyper("alpha", group.get("alpha", 0.0), 0.0, None)
        for key in ("t_alpha", "t_beta3"):
            value = group.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{key} must be None or an int >= 1 (steps), got {value!r}")
    bits = group.get("optim_bits", 8)
    if bits not in _BITS or isinstance(bits, bool):
        raise ValueError(f"optim_bits={bits!r} is not accepted; accepted: 8, 32")
    _check_hyper("max_unorm", group.get("max_unorm", 0.0), 0.0, None)
    if group.get("max_unorm", 0.0) and rule not in ("adam", "momentum"):
        raise ValueError(f"max_unorm bounds Adam's (LAMB) and SGD's (LARS) update norms, not {rule}'s")
    size = group.get("min_8bit_size", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"min_8bit_size must be an int >= 0, got {size!r}")


def scheduled(config: dict[str, Any], step: int) -> tuple[float, float]:
    """AdEMAMix's (alpha, beta3) at ``step``: warmed up over ``t_alpha`` / ``t_beta3`` steps
    where given (the AdEMAMix paper's schedulers, as bitsandbytes computes them)."""
    beta1, _, beta3 = config["betas"][:3]
    alpha = config.get("alpha", 0.0)
    t_alpha, t_beta3 = config.get("t_alpha"), config.get("t_beta3")
    if t_alpha:
        alpha = min(step * alpha / t_alpha, alpha)
    if t_beta3:
        log1, log3 = math.log(beta1), math.log(beta3)
        scale = step / t_beta3
        beta3 = min(math.exp((log1 * log3) / ((1 - scale) * log3 + scale * log1)), beta3)
    return alpha, beta3


def _update_scale(
    rule: str, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], config: dict[str, Any], step: int
) -> float | None:
    """Where ``max_unorm`` bounds a 32-bit state's update (LAMB, LARS): the factor that brings
    the update's norm within ``max_unorm`` times the parameter's, as bitsandbytes computes
    it (the update from the new moments, bias-corrected; SGD's without weight decay), else
    None. 8-bit state takes no bound (bitsandbytes' blockwise update has none)."""
    bound = config.get("max_unorm", 0.0)
    if not bound or state["state1"].dtype == torch.uint8:
        return None
    g = grad.float()
    beta1, beta2 = config["betas"][0], config["betas"][1]
    if rule == "adam":
        first = (state["state1"] * beta1 + g * (1 - beta1)) / (1 - beta1**step)
        second = (state["state2"] * beta2 + g * g * (1 - beta2)) / (1 - beta2**step)
        update = first / (second.sqrt() + config["eps"])
        slack = 0.0
    else:  # momentum
        update = g if step == 1 else state["state1"] * beta1 + g
        slack = config["eps"]
    norm, limit = float(update.pow(2).sum().sqrt()), bound * float(p.float().norm())
    return (limit + slack) / norm if norm > limit + slack else 1.0


class BlockwiseOptimizer(torch.optim.Optimizer):
    """One update ``rule`` (:data:`tightfit.ops.optimizer.OPTIMIZERS`) over ``params``.

    ``defaults``: the group settings (bitsandbytes' keys, plus ``optim_bits`` and
    ``min_8bit_size``); ``paged``: state in host memory, brought in per update (module doc).
    """

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], *, rule: str, paged: bool = False) -> None:
        check_type("paged", paged, bool)
        self.rule = rule
        self.paged = paged
        super().__init__(params, defaults)
        for group in self.param_groups:
            check_group(group, rule)
        self._side_streams: dict[torch.device, Any] = {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        check_group(self.param_groups[-1], self.rule)
        for p in self.param_groups[-1]["params"]:
            if p.is_sparse:
                raise TypeError(f"{type(self).__name__} does not take sparse parameters")

    # -- configuration --------------------------------------------------------------------
    def config(self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int) -> dict[str, Any]:
        """The settings ``p`` steps with: its group's (a subclass may override some per
        parameter, as bitsandbytes' global manager does)."""
        return group

    # -- stepping -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [
            (p, self.config(group, p, gindex, pindex))
            for gindex, group in enumerate(self.param_groups)
            for pindex, p in enumerate(group["params"])
            if p.grad is not None
        ]
        for p, config in work:
            if p.grad.is_sparse:
                raise TypeError(f"{type(self).__name__} does not take sparse gradients")
            if not self.state[p]:
                self.state[p] = self._new_state(p, config)
        for index, (p, config) in enumerate(work):
            if index + 1 < len(work):
                self._prefetch(work[index + 1][0])
            self._update(p, config)
        return loss

    def _new_state(self, p: torch.Tensor, config: dict[str, Any]) -> dict[str, Any]:
        host = self.paged and not shares_host_memory(p.device)
        eight_bit = is_8bit(config.get("optim_bits", 8), config.get("min_8bit_size", 0), p)
        pin = host and self._streams(p.device) is not None  # page-locked where the copies run asynchronously
        return new_state(self.rule, p, eight_bit, torch.device("cpu") if host else p.device, pin=pin)

    def _update(self, p: torch.Tensor, config: dict[str, Any]) -> None:
        """One step of ``p``: nothing is changed (the step count included) before the
        gradient is known to fit the parameter."""
        if p.grad.dtype != p.dtype or p.grad.shape != p.shape:
            raise ValueError(
                f"a parameter's gradient must match it: got gradient {p.grad.dtype} {tuple(p.grad.shape)} for "
                f"parameter {p.dtype} {tuple(p.shape)}"
            )
        if not p.is_contiguous():
            p.data = p.data.contiguous()
        grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
        state = self.state[p]
        step = state["step"] + 1
        working = self._bring_in(p, state)
        beta1, beta2 = config["betas"][0], config["betas"][1]
        alpha, beta3 = scheduled(config, step) if self.rule == "ademamix" else (0.0, 0.0)
        lr, decay = config["lr"], config["weight_decay"]
        scale = _update_scale(self.rule, p, grad, working, config, step)
        if scale is not None:  # a bounded update norm: the decay applied here, the update scaled through lr
            if decay > 0 and self.rule == "adam":
                p.mul_(1.0 - lr * decay)
            elif decay > 0:
                grad = grad + p * decay
            lr, decay = lr * scale, 0.0
        hyper = dict(
            beta1=beta1,
            beta2=beta2,
            beta3=beta3,
            alpha=alpha,
            eps=config["eps"],
            weight_decay=decay,
            step=step,
            lr=lr,
        )
        if working["state1"].dtype == torch.uint8:
            optimizer_update_8bit_blockwise(
                self.rule,
                grad,
                p,
                working["state1"],
                working["absmax1"],
                working["qmap1"],
                working.get("state2"),
                working.get("absmax2"),
                working.get("qmap2"),
                **hyper,
            )
        else:
            optimizer_update_32bit(self.rule, grad, p, working["state1"], working.get("state2"), **hyper)
        self._write_back(state, working)
        state["step"] = step

    # -- paged state ----------------------------------------------------------------------
    def _streams(self, device: torch.device) -> tuple[Any, Any] | None:
        """(device module, this optimizer's side stream) where the device's backend copies
        asynchronously (:func:`~tightfit.backends.registry.copy_streams`), else None."""
        if device not in self._side_streams:
            module = copy_streams(device)
            self._side_streams[device] = (module, module.Stream(device)) if module is not None else None
        return self._side_streams[device]

    def _prefetch(self, p: torch.Tensor) -> None:
        """Start copying ``p``'s paged state to its device on the side stream."""
        state = self.state[p]
        streams = self._streams(p.device) if self.paged else None
        if streams is None or "_prefetched" in state or _on(state, p.device):
            return
        module, side = streams
        with module.stream(side):
            copies = {key: t.to(p.device, non_blocking=True) for key, t in _tensors(state).items()}
            state["_prefetched"] = (copies, side.record_event())

    def _bring_in(self, p: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """The state tensors on ``p``'s device: the prefetched copies, a copy, or the state."""
        if _on(state, p.device):
            return state
        prefetched = state.pop("_prefetched", None)
        if prefetched is None:
            return {key: t.to(p.device, non_blocking=True) for key, t in _tensors(state).items()}
        copies, event = prefetched
        module, _ = self._streams(p.device)
        current = module.current_stream(p.device)
        current.wait_event(event)
        for copy in copies.values():
            copy.record_stream(current)
        return copies

    def _write_back(self, state: dict[str, Any], working: dict[str, Any]) -> None:
        if working is state:
            return
        for key, copy in working.items():
            if copy is not state[key]:  # the maps stay where they are
                state[key].copy_(copy, non_blocking=True)

    # -- state dicts ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, each parameter's quantization tensors nested under
        bitsandbytes' key (so FSDP's gather skips them), as bitsandbytes writes it."""
        data = super().state_dict()
        wrapped = {}
        for index, state in data["state"].items():
            state = {k: v for k, v in state.items() if not k.startswith("_")}
            quant = {k: state.pop(k) for k in list(state) if k in _QUANT_KEYS}
            wrapped[index] = {**state, **({_WRAPPED: quant} if quant else {})}
        data["state"] = wrapped
        return data

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A state dict this class or bitsandbytes' optimizer of the same rule wrote, every
        parameter's state checked before any is used (D9) and left in its dtypes (torch's
        own load would cast codes and scales to the parameter's dtype); tensors go to the
        parameter's device (paged: host memory), copied: the optimizer never shares a tensor
        with the dict it was given (two optimizers loaded from one dict step apart)."""
        check_type("state_dict", state_dict, dict)
        if "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError(f"state_dict must have 'state' and 'param_groups', got keys {sorted(state_dict)}")
        saved_state, saved_groups = state_dict["state"], state_dict["param_groups"]
        check_type("state_dict['state']", saved_state, dict)
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict['param_groups'] must be a list of {len(self.param_groups)} groups, as this optimizer has"
            )
        ids: dict[Any, torch.Tensor] = {}
        groups = []
        for index, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            check_type(f"state_dict['param_groups'][{index}]", saved, dict)
            saved_ids = saved.get("params")
            if not isinstance(saved_ids, list) or len(saved_ids) != len(group["params"]):
                raise ValueError(
                    f"state_dict['param_groups'][{index}]['params'] must list {len(group['params'])} parameter ids, "
                    f"as this optimizer's group {index} has"
                )
            merged = {**group, **saved, "params": group["params"]}
            check_group(merged, self.rule)
            groups.append(merged)
            ids.update(zip(saved_ids, group["params"]))
        loaded: dict[torch.Tensor, dict[str, Any]] = {}
        for key, state in saved_state.items():
            if key not in ids:
                raise ValueError(f"state_dict['state'] has key {key!r}, which no param group lists")
            where = f"state_dict['state'][{key!r}]"
            check_type(where, state, dict)
            state = dict(state)
            state.update(state.pop(_WRAPPED, {}))
            p = ids[key]
            check_state(where, self.rule, p, state)
            target = torch.device("cpu") if self.paged and p.device.type != "cpu" else p.device
            loaded[p] = shared_maps(
                {
                    k: (int(v) if k == "step" else v.to(target, copy=True)) if isinstance(v, torch.Tensor) else v
                    for k, v in state.items()
                },
                p.device,
            )
        self.state.clear()
        self.state.update(loaded)
        self.param_groups[:] = groups

    # -- memory ---------------------------------------------------------------------------
    def state_bytes(self, device: torch.device | str | None = None) -> int:
        """Bytes of optimizer state held (on ``device`` only, where given)."""
        wanted = torch.device(device) if device is not None else None
        return sum(
            state_bytes({k: t for k, t in _tensors(state).items() if wanted is None or t.device == wanted})
            for state in self.state.values()
        )


_QUANT_KEYS = ("qmap1", "qmap2", "absmax1", "absmax2", "state1", "state2")
_WRAPPED = "__bnb_optimizer_quant_state__"


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {key: value for key, value in state.items() if isinstance(value, torch.Tensor) and not key.startswith("_")}


def _on(state: dict[str, Any], device: torch.device) -> bool:
    return all(t.device == device for t in _tensors(state).values())
