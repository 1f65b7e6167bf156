"""Models and backends shared by the graph and memory tests (not a test module)."""

from __future__ import annotations

import dataclasses

import torch
from torch._higher_order_ops.hints_wrap import hints_wrapper

import tightfit
from tightfit.backends.cpu import CPUBackend
from tightfit.graph.execution import observe_splits


class Attention(torch.nn.Module):
    """Self-attention whose core (scores, softmax, weighted sum) can carry hints.

    ``hints`` puts the core in ``tightfit.hint(**hints)``; ``wrapper_hints`` wraps it in
    PyTorch's ``hints_wrapper`` instead (compiled only: it has no eager autograd).
    """

    def __init__(
        self, embed: int = 32, heads: int = 8, hints: dict | None = None, wrapper_hints: dict | None = None
    ) -> None:
        super().__init__()
        self.heads = heads
        self.hints = hints
        self.wrapper_hints = wrapper_hints
        self.qkv = torch.nn.Linear(embed, 3 * embed)
        self.out = torch.nn.Linear(embed, embed)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        return scores.softmax(-1) @ v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, embed = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, embed // self.heads).permute(2, 0, 3, 1, 4)
        if self.hints is not None:
            with tightfit.hint(**self.hints):
                y = self.core(q, k, v)
        elif self.wrapper_hints is not None:
            y = hints_wrapper(self.core, (q, k, v), {}, hints=self.wrapper_hints)
        else:
            y = self.core(q, k, v)
        return self.out(y.transpose(1, 2).reshape(batch, seq, embed))


def restricted(base: type, unsupported: frozenset[str], name: str) -> tightfit.backends.Backend:
    """A backend on ``base``'s device that refuses some ops, so the scheduler must split."""

    class Restricted(base):
        priority = 50

        def _capabilities(self):
            return dataclasses.replace(super()._capabilities(), unsupported_ops=unsupported)

    Restricted.name = name
    Restricted.__qualname__ = f"Restricted[{name}]"
    return Restricted()


def restricted_cpu() -> tightfit.backends.Backend:
    return restricted(CPUBackend, frozenset({"aten::_softmax", "aten::_softmax_backward_data"}), "cpu-restricted")


def fx_compile(model: torch.nn.Module, **options) -> torch.nn.Module:
    """torch.compile with the tightfit backend, splits run as FX modules (fast to compile)."""
    options.setdefault("execution", "fx")
    return torch.compile(model, backend=tightfit.graph.compiler(**options))


def run_recording(fn):
    """Run ``fn`` and return (its result, the splits that ran, in order)."""
    ran = []
    with observe_splits(lambda event, split: ran.append(split) if event == "start" else None):
        result = fn()
    return result, ran


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
