"""Conformance harness (D4): every op on every available backend, and every CPU kernel,
against the reference kernel run on the CPU.

Outputs that an op writes in place are allocated with sentinel bytes after them, so a
kernel that writes past its output is caught. Comparison is bit equality or a
normalized mean squared error under the op's stated threshold.

Each op is a progress task (:mod:`tightfit._progress`): a full check runs long enough
on a small CPU (the fast kernels compile at first use) that a caller with a display
(``tightfit check``) shows it op by op; a library caller sees nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tightfit._progress import task
from tightfit.backends import Backend, available, get
from tightfit.ops._registry import Case, OpDef, registered_ops

__all__ = ["CheckResult", "run_checks", "SENTINEL_BYTE", "SENTINEL_BYTES"]

SENTINEL_BYTE = 0xA5
SENTINEL_BYTES = 64


@dataclass(frozen=True)
class CheckResult:
    op: str
    backend: str
    kernel: str
    case: str
    status: str  # "OK", "FAIL" or "not supported"
    detail: str = ""


def _with_sentinel(template: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous tensor shaped like ``template`` followed by sentinel bytes; (tensor, guard bytes)."""
    nbytes = template.numel() * template.element_size()
    arena = torch.full((nbytes + SENTINEL_BYTES,), SENTINEL_BYTE, dtype=torch.uint8, device=device)
    tensor = arena[:nbytes].view(template.dtype).view(template.shape)
    return tensor, arena[nbytes:]


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    # a fresh layout: a one-element tensor counts as contiguous whatever its stride, and view needs stride 1
    return tensor.detach().cpu().reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)


def _bytes_differing(want: torch.Tensor, got: torch.Tensor) -> int:
    """Bytes that differ, except inside elements that are NaN in both: devices disagree on
    NaN signs and payloads (torch's CUDA casts return one canonical NaN), and no format
    here gives them meaning."""
    size = want.element_size()
    differs = (_flat_bytes(got) != _flat_bytes(want)).reshape(-1, size).any(dim=1)
    if want.is_floating_point():
        differs &= ~(torch.isnan(want.float().reshape(-1)) & torch.isnan(got.detach().cpu().float().reshape(-1)))
    return int(differs.sum()) * size


def _compare(expected: Any, actual: Any, metric: str | float) -> str | None:
    """None when equal under ``metric``, else what differs."""
    expected_leaves, _ = tree_flatten(expected)
    actual_leaves, _ = tree_flatten(actual)
    if len(expected_leaves) != len(actual_leaves):
        return f"{len(actual_leaves)} outputs, expected {len(expected_leaves)}"
    for index, (want, got) in enumerate(zip(expected_leaves, actual_leaves)):
        if not isinstance(want, torch.Tensor):
            if want != got:
                return f"output {index}: {got!r} != {want!r}"
            continue
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            got_text = f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
            return f"output {index}: got {got_text}, expected {want.dtype} {tuple(want.shape)}"
        if metric == "bitwise":
            mismatched = _bytes_differing(want, got)
            if mismatched:
                return f"output {index}: {mismatched} of {want.numel() * want.element_size()} bytes differ"
        else:
            want64, got64 = want.double(), got.detach().cpu().double()
            error = float(((got64 - want64) ** 2).sum() / (want64**2).sum().clamp_min(1e-300))
            if not error <= metric:
                return f"output {index}: normalized MSE {error:.3g} > {metric:.3g}"
    return None


def _required_dtypes(case: Case) -> set[torch.dtype]:
    leaves, _ = tree_flatten(case.args)
    return {
        leaf.dtype if isinstance(leaf, torch.Tensor) else leaf
        for leaf in leaves
        if isinstance(leaf, (torch.Tensor, torch.dtype))
    }


def _run_case(opdef: OpDef, case: Case, fn: Callable[..., Any], device: torch.device) -> str | None:
    """Run ``fn`` on ``device``; compare with the reference on the CPU. None means pass."""
    expected_args = tree_map(lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf, case.args)
    expected = opdef.reference(*expected_args)
    args = list(tree_map(lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, case.args))
    guards = {}
    for index in opdef.mutated:
        if case.args[index] is None:  # an optional tensor the op would write, not given
            continue
        args[index], guards[index] = _with_sentinel(case.args[index], device)
        args[index].copy_(case.args[index])  # start from what the reference starts from
    actual = fn(*args)
    for index, guard in guards.items():
        if bool((guard != SENTINEL_BYTE).any()):
            return f"wrote past the end of argument {index} (sentinel bytes changed)"
    if opdef.mutated:
        expected = [expected_args[index] for index in opdef.mutated]
        actual = [args[index] for index in opdef.mutated]
    return _compare(expected, actual, opdef.metric)


def _targets(opdef: OpDef, backends: Iterable[Backend]) -> list[tuple[Backend, str, Callable[..., Any]]]:
    """(backend, kernel label, callable): dispatch per backend, plus the CPU kernel called directly."""
    targets = []
    for backend in backends:
        kernel = opdef.kernels.get(backend.device_type)
        label = f"dispatch -> {kernel.label}" if kernel else "dispatch -> reference"
        targets.append((backend, label, opdef))
    cpu_kernel = opdef.kernels.get("cpu")
    if cpu_kernel is not None:
        targets.append((get("cpu"), f"direct {cpu_kernel.label}", cpu_kernel.fn))
    return targets


def _outcome(
    opdef: OpDef, case: Case, fn: Callable[..., Any], device: torch.device, storage: set[torch.dtype]
) -> tuple[str, str]:
    """(status, detail) of one case on one target."""
    missing = _required_dtypes(case) - storage
    if missing:
        return "not supported", f"no storage for {sorted(map(str, missing))}"
    try:
        problem = _run_case(opdef, case, fn, device)
    except Exception as error:  # a crash in a kernel is a failed check, not a crashed harness
        problem = f"raised {type(error).__name__}: {error}"
    return ("OK", "") if problem is None else ("FAIL", problem)


def _check_target(
    opdef: OpDef,
    cases: list[Case],
    backend: Backend,
    label: str,
    fn: Callable[..., Any],
    advance: Callable[[int], None],
) -> list[CheckResult]:
    def result(case: str, status: str, detail: str = "") -> CheckResult:
        return CheckResult(opdef.name, backend.name, label, case, status, detail)

    try:
        storage = backend.capabilities().storage_dtypes
        device = backend.resolve_device(None)
    except RuntimeError as error:
        advance(len(cases))
        return [result("(backend)", "FAIL", str(error))]
    results = []
    for case in cases:
        results.append(result(case.name, *_outcome(opdef, case, fn, device, storage)))
        advance(1)
    return results


def run_checks(ops: Iterable[str] | None = None, backends: Iterable[Backend] | None = None) -> list[CheckResult]:
    """Check the named ops (default: all) on the given backends (default: all available)."""
    if isinstance(ops, str):
        raise TypeError(f"ops must be a list of op names or None, got the str {ops!r}; pass [{ops!r}]")
    all_ops = registered_ops()
    names = sorted(all_ops) if ops is None else list(ops)
    for name in names:
        if name not in all_ops:
            raise ValueError(f"op {name!r} is not registered; registered ops: {', '.join(sorted(all_ops))}")
    chosen = list(available() if backends is None else backends)
    for backend in chosen:
        if not isinstance(backend, Backend):
            raise TypeError(f"backends must hold tightfit Backend objects, got {type(backend).__name__}: {backend!r}")
    results = []
    for name in names:
        opdef = all_ops[name]
        cases = list(opdef.cases())
        targets = _targets(opdef, chosen)
        with task(name, len(cases) * len(targets)) as advance:
            for backend, label, fn in targets:
                results.extend(_check_target(opdef, cases, backend, label, fn, advance))
    return results
