"""Assignment: give every node of an aten graph a backend, in passes like ggml's scheduler.

("Placement" in tightfit means where weights live: device, CPU or disk; "assignment" is
which backend runs an op.)

1. ``device`` hints: a hinted region runs on the backend it names.
2. Where the data lives: a node runs on the highest-priority backend for the device of
   its tensors (the weights' and inputs' device, D1).
3. Support: a backend that declares an op unsupported (``Capabilities.unsupported_ops``)
   or cannot store or compute a dtype passes the node on to the next backend for that
   device, and finally to the CPU; such a fallback warns once per op (an error in
   strict mode).
4. Expansion to neighbours, to avoid copies and splits: ``getitem`` stays with the node
   it reads; a view stays on its input's device, with the backend of the op before it
   when that backend can run it (no new split), else with its input's; ops that create
   tensors from nothing go where their first user runs.

Every decision keeps its reason, which ``TIGHTFIT_DEBUG=sched`` prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx

from tightfit._strict import report_fallback
from tightfit.backends.base import Backend
from tightfit.graph import _nodes
from tightfit.graph.honor import HintLedger
from tightfit.hints.read import node_hints

__all__ = ["Assignment", "assign", "unsupported_reason"]

# Ops that move or reinterpret data without arithmetic: no compute dtype needed.
_DATA_MOVEMENT = frozenset(
    {
        "aten::_to_copy",
        "aten::clone",
        "aten::copy",
        "aten::cat",
        "aten::stack",
        "aten::lift_fresh_copy",
        "aten::_unsafe_view",
        "aten::empty",
        "aten::empty_strided",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::zeros",
        "aten::full",
        "aten::new_zeros",
        "aten::new_full",
        "aten::scalar_tensor",
    }
)


@dataclass(frozen=True)
class Assignment:
    """The backend and device one node runs on (or, for an input, lives on), and why."""

    backend: Backend
    device: torch.device
    reason: str


def unsupported_reason(backend: Backend, ledger: HintLedger, node: torch.fx.Node) -> str | None:
    """Why ``backend`` cannot run ``node``, or None when it can."""
    caps = ledger.capabilities(backend)
    names = _nodes.op_names(node)
    for name in names:
        if name in caps.unsupported_ops:
            return f"{backend.name} declares {name} unsupported"
    involved = [*_nodes.tensors(node)]
    for arg in _nodes.input_nodes(node):
        involved.extend(_nodes.tensors(arg))
    for tensor in involved:
        if tensor.dtype not in caps.storage_dtypes:
            return f"{backend.name} cannot store {tensor.dtype}"
    moves_data = _nodes.is_view(node) or names[0] in _DATA_MOVEMENT or names[0].startswith("tightfit::")
    if not moves_data:
        for tensor in _nodes.tensors(node):
            if tensor.dtype.is_floating_point and tensor.dtype not in caps.compute_dtypes:
                return f"{backend.name} cannot compute in {tensor.dtype}"
    return None


class _Assigner:
    def __init__(self, backends: Sequence[Backend], cpu: Backend, ledger: HintLedger) -> None:
        self.backends = list(backends)
        self.cpu = cpu
        self.ledger = ledger
        self.assigned: dict[torch.fx.Node, Assignment] = {}
        self.previous: Assignment | None = None  # of the last op assigned in graph order

    # -- which backend a device or a hint means -----------------------------------------
    def home(self, device: torch.device) -> Backend:
        for backend in self.backends:
            if backend.device_type == device.type:
                return backend
        if device.type == self.cpu.device_type:
            return self.cpu
        from tightfit.backends.registry import get

        return get(device)

    def candidates(self, first: Backend, device: torch.device) -> list[Backend]:
        """``first``, then other backends for the same device type, then the CPU."""
        ordered = [first] + [b for b in self.backends if b is not first and b.device_type == first.device_type]
        if self.cpu not in ordered:
            ordered.append(self.cpu)
        return ordered

    def hinted(self, node: torch.fx.Node) -> tuple[Backend, torch.device] | None:
        """The backend a ``device`` hint names, if honored and available."""
        text = node_hints(node).get("device")
        if text is None:
            return None
        name, _, index = text.partition(":")
        backend = next((b for b in self.backends if b.name == name), None)
        backend = backend or next((b for b in self.backends if b.device_type == name), None)
        if backend is None:
            from tightfit.backends.registry import get

            try:
                backend = get(name)
            except (ValueError, RuntimeError) as error:
                self.ledger.not_applied(node, f"hint device={text!r}", str(error))
                return None
        if not self.ledger.honored(node, "device", backend):
            return None
        return backend, backend.device(int(index)) if index else backend.resolve_device(None)

    # -- the passes ------------------------------------------------------------------
    def assign_input(self, node: torch.fx.Node) -> None:
        device = _nodes.device_of(node)
        if device is None:
            return
        self.assigned[node] = Assignment(self.home(device), device, f"input on {device}")

    def assign_op(self, node: torch.fx.Node) -> bool:
        """Assign one op; False when it should follow its first user (decided later)."""
        producers = [arg for arg in _nodes.input_nodes(node) if arg in self.assigned]
        hinted = self.hinted(node)
        if hinted is None and producers and (_nodes.is_getitem(node) or not _nodes.is_tensor_node(node)):
            source = self.assigned[producers[0]]
            self.assigned[node] = Assignment(source.backend, source.device, f"follows {producers[0].name}")
            return True
        if hinted is None and producers and _nodes.is_view(node):
            source = self.assigned[producers[0]]
            before = self.previous
            if (
                before is not None
                and before.device == source.device
                and unsupported_reason(before.backend, self.ledger, node) is None
            ):
                self.assigned[node] = Assignment(
                    before.backend,
                    before.device,
                    f"a view of {producers[0].name}: on its device, with the op before it",
                )
                return True
            if unsupported_reason(source.backend, self.ledger, node) is None:
                self.assigned[node] = Assignment(
                    source.backend, source.device, f"a view of {producers[0].name}: stays with it (no copy)"
                )
                return True
        if hinted is None and not any(_nodes.tensors(arg) for arg in _nodes.input_nodes(node)) and node.users:
            return False  # creates a tensor from nothing: goes where its user runs
        device = _nodes.device_of(node)
        if hinted is not None:
            first, target = hinted
            why = f"device hint {node_hints(node)['device']!r}"
        elif device is not None:
            first, target = self.home(device), device
            why = f"data on {device}: highest-priority backend for {device.type}"
        else:
            return False
        self.choose(node, first, target, why)
        return True

    def choose(self, node: torch.fx.Node, first: Backend, target: torch.device, why: str) -> None:
        refusals = []
        for backend in self.candidates(first, target):
            reason = unsupported_reason(backend, self.ledger, node)
            if reason is None:
                break
            refusals.append(reason)
        else:
            backend = self.cpu  # the last fallback runs it even if it says otherwise
        if backend is not first:
            report_fallback(
                _nodes.op_name(node),
                first.name,
                "cpu",
                f"{'; '.join(refusals)}; running it on backend {backend.name} (assignment, {node.name})",
            )
            why = f"{why}; {'; '.join(refusals)}: fallback to {backend.name}"
        device = target if backend.device_type == target.type else backend.resolve_device(None)
        self.assigned[node] = Assignment(backend, device, why)

    def follow_users(self, node: torch.fx.Node) -> None:
        users = [user for user in node.users if user in self.assigned]
        if users:
            source = self.assigned[users[0]]
            if unsupported_reason(source.backend, self.ledger, node) is None:
                self.assigned[node] = Assignment(
                    source.backend, source.device, f"created for {users[0].name}: goes where it is used"
                )
                return
        device = _nodes.device_of(node) or self.cpu.resolve_device(None)
        self.choose(node, self.home(device), device, f"creates a tensor on {device}")


def assign(
    graph_module: torch.fx.GraphModule, backends: Sequence[Backend], cpu: Backend, ledger: HintLedger
) -> dict[torch.fx.Node, Assignment]:
    """An :class:`Assignment` for every input and op of ``graph_module`` (the output node has none)."""
    assigner = _Assigner(backends, cpu, ledger)
    deferred = []
    for node in graph_module.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            assigner.assign_input(node)
        elif node.op == "call_function":
            if assigner.assign_op(node):
                assigner.previous = assigner.assigned[node]
            else:
                deferred.append(node)
        elif node.op != "output":
            raise ValueError(
                f"tightfit's compile backend cannot assign a {node.op} node ({node.name}); "
                "it expects the aten graphs aot_autograd produces"
            )
    for node in reversed(deferred):
        assigner.follow_users(node)
    return assigner.assigned
