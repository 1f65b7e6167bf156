"""The compile backend: ``torch.compile(model, backend="tightfit")``.

dynamo's graph -> ``hints_wrapper`` bodies inlined -> aot_autograd (so training works:
the forward and the backward graph both reach us, both carrying the hints) -> for each
aten graph: assignment, hint check, schedules, partition, execution.

``backend="tightfit"`` uses the defaults; ``tightfit.graph.compiler(execution=...,
backends=..., memory=...)`` returns a configured backend whose options are checked when it is
made. ``options={...}`` in ``torch.compile`` are accepted too, checked at the first
compile.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from tightfit._validate import check_choice, check_type
from tightfit.backends.base import Backend
from tightfit.graph.assign import Assignment, assign
from tightfit.graph.debug import debug_topics, maybe_print
from tightfit.graph.execution import EXECUTIONS, MEMORY_MODES, Program, build_program
from tightfit.graph.honor import HintLedger
from tightfit.graph.inline import inline_hints_wrappers
from tightfit.graph.partition import Split, partition
from tightfit.graph.schedules import plan_schedules

__all__ = ["CompileOptions", "compile_graph", "compiler", "split_graph", "tightfit_backend"]

logger = logging.getLogger("tightfit.graph")


@dataclass(frozen=True)
class CompileOptions:
    """Options of the tightfit compile backend.

    ``execution``: "auto" (a backend's own compiler, else inductor where it works, else
    FX), "inductor", or "fx" (no compiler: quick to start, and what a memory
    measurement with a dispatch mode can see). ``backends``: the backends to assign
    nodes to, highest priority first (default: every available one); the CPU backend
    is added as the last fallback when missing. ``memory``: "allocator" (results
    allocated as usual) or "arena" (whole splits run op by op inside the arena the
    memory plan gives, so the planned peak is the peak; docs/memory.md).
    """

    execution: str = "auto"
    backends: tuple[Backend, ...] | None = None
    memory: str = "allocator"

    def __post_init__(self) -> None:
        check_type("execution", self.execution, str)
        check_choice("execution", self.execution, EXECUTIONS)
        check_type("memory", self.memory, str)
        check_choice("memory", self.memory, MEMORY_MODES)
        if self.memory == "arena" and self.execution == "inductor":
            raise ValueError(
                "memory='arena' runs splits op by op in their arena, which execution='inductor' "
                "cannot do; accepted with memory='arena': execution='auto' or 'fx'"
            )
        if self.backends is not None:
            check_type("backends", self.backends, (tuple, list))
            if not self.backends:
                raise ValueError("backends must name at least one backend, got an empty sequence")
            for index, backend in enumerate(self.backends):
                check_type(f"backends[{index}]", backend, Backend)
            object.__setattr__(self, "backends", tuple(self.backends))

    @classmethod
    def from_options(cls, options: Any) -> CompileOptions:
        """From ``torch.compile(..., options={...})`` (None: the defaults)."""
        if options is None:
            return cls()
        if isinstance(options, CompileOptions):
            return options
        check_type("options", options, dict)
        unknown = set(options) - {"execution", "backends", "memory"}
        if unknown:
            raise ValueError(f"options {sorted(unknown)} are not accepted; accepted: backends, execution, memory")
        return cls(**options)


def _backends(options: CompileOptions) -> tuple[list[Backend], Backend]:
    from tightfit.backends.registry import available, get

    chosen = list(options.backends) if options.backends is not None else available()
    cpu = next((backend for backend in chosen if backend.name == "cpu"), None) or get("cpu")
    return chosen, cpu


def split_graph(
    graph_module: torch.fx.GraphModule, *, options: CompileOptions, name: str
) -> tuple[list[Split], dict[torch.fx.Node, Assignment], HintLedger]:
    """Assignment, hint check, schedules and partition of one aten graph: its splits in order.

    What :func:`compile_graph` compiles, and what the memory planner plans.
    """
    backends, cpu = _backends(options)
    ledger = HintLedger(name)
    assignment = assign(graph_module, backends, cpu, ledger)
    ledger.check_all(
        (node for node in graph_module.graph.nodes if node.op == "call_function"),
        {node: where.backend for node, where in assignment.items()},
    )
    plans = plan_schedules(graph_module, assignment, ledger)
    return partition(graph_module, assignment, plans, ledger), assignment, ledger


def compile_graph(
    graph_module: torch.fx.GraphModule, example_inputs: Sequence[Any], *, options: CompileOptions, name: str
) -> Program:
    """Compile one aten graph (aot_autograd's forward, backward or inference graph)."""
    debug_topics()  # a bad TIGHTFIT_DEBUG is an error before any work
    splits, assignment, ledger = split_graph(graph_module, options=options, name=name)
    program = build_program(graph_module, splits, options.execution, name, options.memory)
    program.ledger = ledger
    maybe_print(program, assignment, ledger)
    return program


def _compile(
    graph_module: torch.fx.GraphModule, example_inputs: list[Any], options: CompileOptions
) -> Callable[..., Any]:
    from torch._dynamo.backends.common import aot_autograd

    inline_hints_wrappers(graph_module)
    stages = {
        stage: functools.partial(_aot_stage, options=options, name=stage)
        for stage in ("forward", "backward", "inference")
    }
    return aot_autograd(
        fw_compiler=stages["forward"], bw_compiler=stages["backward"], inference_compiler=stages["inference"]
    )(graph_module, example_inputs)


def _aot_stage(
    graph_module: torch.fx.GraphModule, example_inputs: Sequence[Any], *, options: CompileOptions, name: str
) -> Program:
    return compile_graph(graph_module, example_inputs, options=options, name=name)


def tightfit_backend(
    graph_module: torch.fx.GraphModule, example_inputs: list[Any], *, mode: str | None = None, options: Any = None
) -> Callable[..., Any]:
    """The backend behind ``torch.compile(model, backend="tightfit")``."""
    if mode not in (None, "default"):
        logger.debug("tightfit compile backend: mode=%r has no effect", mode)
    return _compile(graph_module, example_inputs, CompileOptions.from_options(options))


def compiler(
    *, execution: str = "auto", backends: Sequence[Backend] | None = None, memory: str = "allocator"
) -> Callable[..., Any]:
    """A tightfit compile backend with options, for ``torch.compile(model, backend=...)``."""
    options = CompileOptions(
        execution=execution, backends=tuple(backends) if isinstance(backends, list) else backends, memory=memory
    )

    def tightfit(graph_module: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable[..., Any]:
        if kwargs.get("options") is not None:
            raise ValueError("pass options to tightfit.graph.compiler(...), not to torch.compile(options=...)")
        return _compile(graph_module, example_inputs, options)

    tightfit.options = options  # type: ignore[attr-defined]
    return tightfit
