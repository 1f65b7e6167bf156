"""Compile one split with inductor (not public).

Inductor expects the decomposed graphs its own aot_autograd call would give it, so the
split is traced again with inductor's decompositions (over the same fake tensors), and
compiled in a tracing context of its own: the forward and backward graphs that the
compile backend receives are cut into several splits, each one a graph inductor sees
as complete.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

__all__: list[str] = []


def compile_split(graph_module: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., tuple[Any, ...]]:
    """Inductor-compiled code for a split: boxed (called with the list of inputs, which it
    clears, so each input is freed after its last use), returns a tuple."""
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch._inductor.compile_fx import compile_fx_inner, record_original_output_strides
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    fake_mode = detect_fake_mode(tensors)
    with fake_mode:
        decomposed = make_fx(graph_module, decomposition_table=select_decomp_table())(*example_inputs)
    decomposed = _joint_graph_passes(decomposed, tensors[0].device if tensors else None)
    record_original_output_strides(decomposed)  # outputs keep the strides the next split was compiled for
    with tracing(TracingContext(fake_mode)):
        compiled = compile_fx_inner(decomposed, list(example_inputs))

    def run(args: list[Any]) -> tuple[Any, ...]:
        return tuple(compiled(args))

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _joint_graph_passes(graph_module: torch.fx.GraphModule, device: torch.device | None) -> torch.fx.GraphModule:
    """Inductor's own graph-level rewrites (such as matmul-softmax-matmul into fused
    attention), which its compile_fx runs before compile_fx_inner; skipped if absent."""
    try:
        from torch._inductor.compile_fx import _recursive_joint_graph_passes
    except ImportError:  # a torch without them: compile without
        return graph_module
    return _recursive_joint_graph_passes(graph_module, input_device=device)
