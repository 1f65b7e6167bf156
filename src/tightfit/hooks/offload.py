"""Offloading: weights live off the device (CPU memory, or unnamed memory-mapped files on disk)
and each unit's tensors are copied onto the device right before the unit runs, then
dropped after it.

With ``prefetch``, the first forward records the order units run in; from then on,
entering a unit starts the copy of the next one on a side stream (backends with
asynchronous copies), so the copy overlaps the current unit's compute. Before it starts,
the host waits until the device is done with the unit before the current one: the host
runs ahead of the device, and a dropped copy's memory returns to the allocator only once
the device has passed its last use, so without that wait every unit the host had already
left could still hold its copy (on a GPU a 1.1B model fitted at 25% allocated 42% over its
budget). So at most two units' copies are held: the current one and the next. On the CPU
there is nothing to copy: offloading to the CPU is a no-op there, and to disk computes
straight from the mapped pages while prefetch asks the OS to read the next unit's
file ahead (``madvise(WILLNEED)``).
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from tightfit import backends
from tightfit._progress import task
from tightfit._validate import check_device, check_type
from tightfit.backends.registry import copy_streams
from tightfit.hooks import _diffusers
from tightfit.hooks._disk import DISK_DTYPES, MappedFile, MappedRegions, OffloadFileError
from tightfit.hooks._exclusive import OneForwardAtATime
from tightfit.hooks._units import Granularity, Slot, Unit, check_granularity, compile_patterns, select_units
from tightfit.hooks.registry import HookRegistry, ModuleHook

__all__ = [
    "OFFLOADING",
    "OFFLOADING_SCHEDULE",
    "OFFLOAD_TARGETS",
    "OffloadFileError",
    "OffloadHook",
    "apply_offloading",
    "remove_offloading",
    "resident_bytes",
]

#: Name of the per-unit offloading hook in a module's :class:`HookRegistry`.
OFFLOADING = "tightfit.offloading"
#: Name of the hook on the offloaded root that marks each forward pass (prefetch order).
OFFLOADING_SCHEDULE = "tightfit.offloading.schedule"

#: Where offloaded weights may live (``offload_to``). Not "storage", which names a weight
#: format (float8, nf4, ...) in the fit planner.
OFFLOAD_TARGETS = ("cpu", "disk")


@dataclass(eq=False)
class _Record:
    """One distinct offloaded tensor: the module's own tensor object and where it came from."""

    tensor: torch.Tensor  # its ``.data`` is the stored copy while offloaded
    device: torch.device  # where it lived before
    file: MappedFile | MappedRegions | None = None  # offloaded to disk: the file it is a view of, under ``key``
    key: str = ""
    version: int = 0  # ``tensor._version`` when it became a view: a change made in place shows


class _Schedule:
    """The order offloaded units run in, learnt in the first forward, and the prefetch it
    drives: shared by the units of one ``apply_offloading`` call, or of a whole model
    whose units were offloaded one by one (:func:`link_offloading`)."""

    def __init__(self) -> None:
        self.order: list[OffloadHook] = []
        self.position: dict[int, int] = {}
        self.recording = True

    def start_pass(self) -> None:
        if self.order:
            self.recording = False
            self.order[0].prefetch()

    def end_pass(self) -> None:
        if self.order:
            self.recording = False

    def entered(self, hook: OffloadHook) -> None:
        """A unit started its forward: record the order (first pass) or prefetch the next unit."""
        if self.recording:
            if id(hook) not in self.position:
                self.position[id(hook)] = len(self.order)
                self.order.append(hook)
            return
        index = self.position.get(id(hook))
        if index is not None and index + 1 < len(self.order):
            if index >= 1:
                self.order[index - 1].wait_released()  # its copies' memory is free before the next one's
            self.order[index + 1].prefetch()


class _Offload:
    """State shared by the hooks of one ``apply_offloading`` call."""

    def __init__(
        self,
        device: torch.device,
        offload_to: str,
        folder: Path | None,
        streams: ModuleType | None,
        target: torch.device | None = None,
    ) -> None:
        self.device = device
        self.offload_to = offload_to  # "disk", or the device the stored copies live on ("cpu", "cuda:1")
        self.target = target  # that device; None for the disk
        self.folder = folder
        self.records: dict[int, _Record] = {}
        self.files: list[MappedFile | MappedRegions] = []
        self.pending: list[tuple[_Record, MappedFile, str]] = []  # written to disk, not yet swapped in
        self.streams = streams  # torch.cuda-like module when the backend copies asynchronously
        self.side_stream = streams.Stream(device) if streams is not None else None
        self.schedule = _Schedule()

    @property
    def prefetches(self) -> bool:
        """Whether prefetch does anything here: a side-stream copy, or a file read ahead."""
        return self.streams is not None or self.offload_to == "disk"

    def swap_in(self) -> None:
        """Point every tensor written to disk at its view of the file (the last step of applying)."""
        for record, file, key in self.pending:
            record.tensor.data = file.tensors[key]
            record.file, record.key, record.version = file, key, record.tensor._version
        self.pending.clear()

    def read_back(self) -> dict[int, torch.Tensor]:
        """The data of the disk records on their own devices again, by record; nothing assigned yet.

        Each is read from its file with ordinary reads and checked against its CRC-32
        (:class:`OffloadFileError` when a file changed). A tensor changed in place while
        offloaded is not read: its copy-on-write view holds the change.
        """
        restored = {}
        for key, record in self.records.items():
            if record.file is not None:
                record.file.check()
                if record.tensor._version == record.version:
                    restored[key] = record.file.read(record.key).to(record.device)
        return restored

    def restore(self, restored: dict[int, torch.Tensor]) -> None:
        """Put every stored tensor back on its device (from ``restored`` where it has it) and free the storage."""
        for key, record in self.records.items():
            if key in restored:
                record.tensor.data = restored[key]
            elif record.file is not None or self.target is not None:  # a disk record not swapped in holds its own data
                record.tensor.data = record.tensor.data.to(record.device, copy=True)
        self.records.clear()
        self.pending.clear()
        for file in self.files:
            file.close()
        self.files.clear()


class OffloadHook(ModuleHook):
    """Copies the unit's stored tensors onto the device for its forward and drops them afterwards.

    A unit of several blocks (``blocks_per_unit``) has this one hook on each of its
    ``members``: the first to run brings the tensors of all of them in, and they are
    dropped after the last one's forward. Offloaded to disk, every forward first checks
    that the unit's files are as written.
    """

    order = 10
    diffusers_name = "group_offloading"

    def __init__(self, state: _Offload, slots: list[Slot], members: list[nn.Module] | None = None) -> None:
        self.state = state
        self.schedule = state.schedule
        self.slots = slots
        self.members = members or []  # the modules it is registered on, in order (empty: one module)
        files = (state.records[id(slot.get())].file for slot in slots if id(slot.get()) in state.records)
        self.files = list({id(file): file for file in files if file is not None}.values())  # the disk files it reads
        self.moves = any(slot.get().device != state.device for slot in slots)
        self._prefetched: tuple[list[torch.Tensor], Any] | None = None
        self._released: Any = None  # marks, on the compute stream, the end of the last use of its copies
        self._stored: list[torch.Tensor] | None = None  # what the slots held before the copies went in
        self._depth = 0  # forwards of its members running now (a module may run inside itself)
        self._claim = OneForwardAtATime(OFFLOADING)

    def __repr__(self) -> str:
        return f"OffloadHook({len(self.slots)} tensors, offloaded to {self.state.offload_to}, compute on {self.state.device})"

    def diffusers_config(self) -> object:
        """What diffusers' guards read from its group offloading hook's ``config``."""
        state = self.state
        return _diffusers.offload_config(
            state.device,
            state.target if state.target is not None else torch.device("cpu"),
            offload_type="block_level" if self.members else "leaf_level",
            num_blocks_per_group=max(len(self.members), 1),
            non_blocking=state.device.type != "cpu",
            use_stream=state.side_stream is not None,
            offload_to_disk_path=str(state.folder) if state.folder is not None else None,
        )

    def prefetch(self) -> None:
        """Start bringing this unit's tensors in: a side-stream copy, or a read-ahead of its file."""
        try:
            for file in self.files:
                file.check()
        except OffloadFileError:
            return  # the unit raises when it runs
        for file in self.files:
            file.will_need()
        state = self.state
        if not self.moves or state.side_stream is None or self._prefetched is not None:
            return
        with state.streams.stream(state.side_stream):
            copies = [slot.get().to(state.device, non_blocking=True) for slot in self.slots]
            event = state.side_stream.record_event()
        self._prefetched = (copies, event)

    def _onload(self) -> list[torch.Tensor]:
        state = self.state
        if self._prefetched is None:
            return [slot.get().to(state.device, non_blocking=state.device.type != "cpu") for slot in self.slots]
        copies, event = self._prefetched
        self._prefetched = None
        current = state.streams.current_stream(state.device)
        current.wait_event(event)
        for copy in copies:
            copy.record_stream(current)  # its memory is not reused before this stream is done with it
        return copies

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._claim.enter(module)
        try:
            for file in self.files:
                file.check()
            if self._stored is None:  # not brought in yet (the unit's first member, or a forward that raised)
                stored = [slot.get() for slot in self.slots]
                if self.moves:
                    for slot, copy in zip(self.slots, self._onload()):
                        slot.set(copy)
                self._stored = stored
                self.schedule.entered(self)
        except BaseException:
            if self._depth == 0:
                self._restore()
            self._claim.exit()
            raise
        self._depth += 1
        return args, kwargs

    def _restore(self) -> None:
        if self._stored is not None and self.moves:
            for slot, stored in zip(self.slots, self._stored):
                slot.set(stored)
            if self.state.side_stream is not None:
                self._released = self.state.streams.current_stream(self.state.device).record_event()
        self._stored = None

    def wait_released(self) -> None:
        """Wait until the device is done with this unit's last copies (their memory is then free)."""
        if self._released is not None:
            self._released.synchronize()
            self._released = None

    def post_forward(self, module: nn.Module, output: object) -> object:
        self._depth -= 1
        if self._depth == 0 and (not self.members or module is self.members[-1]):
            self._restore()
        self._claim.exit()
        return output

    def abort(self, module: nn.Module) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._restore()
        self._claim.exit()

    def detach(self, module: nn.Module) -> None:
        if self._depth == 0:
            self._restore()  # a unit whose last member did not run holds its copies until now


class _ScheduleHook(ModuleHook):
    """On the offloaded root: marks the start and end of each forward pass."""

    order = 0

    def __init__(self, schedule: _Schedule) -> None:
        self.schedule = schedule
        self._claim = OneForwardAtATime(OFFLOADING_SCHEDULE)

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._claim.enter(module)
        try:
            self.schedule.start_pass()
        except BaseException:
            self._claim.exit()
            raise
        return args, kwargs

    def post_forward(self, module: nn.Module, output: object) -> object:
        self.schedule.end_pass()
        self._claim.exit()
        return output

    def abort(self, module: nn.Module) -> None:
        self.schedule.end_pass()
        self._claim.exit()


def _check_device(device: object) -> tuple[backends.Backend, torch.device]:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}: {device!r}")
    backend = backends.get(device)  # ValueError when unknown, RuntimeError when not available here
    resolved = backend.resolve_device(device)
    if resolved.type != "cpu" and resolved.index is not None:
        count = torch.get_device_module(resolved.type).device_count()
        if resolved.index >= count:
            raise ValueError(
                f"device={str(device)!r} does not exist: this machine has {count} {resolved.type} device(s)"
            )
    return backend, resolved


def _hooked(module: nn.Module, name: str) -> list[nn.Module]:
    return [m for m in module.modules() if (r := HookRegistry.get(m)) is not None and name in r]


def apply_offloading(
    module: nn.Module,
    device: str | torch.device,
    *,
    offload_to: str | torch.device = "cpu",
    granularity: Granularity = "block",
    prefetch: bool = True,
    pin_memory: bool | None = None,
    path: str | Path | None = None,
    storage: str | None = None,
    skip: str | tuple[str, ...] = (),
    blocks_per_unit: int = 1,
    use_stream: bool | None = None,
) -> list[str]:
    """Keep ``module``'s parameters and buffers in ``offload_to`` and compute each unit on ``device``.

    ``offload_to="cpu"`` keeps them in CPU memory (pinned by default where the device copies
    asynchronously); ``"disk"`` writes one unnamed file per unit in the folder ``path``
    (default: the system's temporary folder) and maps it back; the OS frees the files
    when the process ends, however it ends; another device (``"cuda:1"``, a
    ``torch.device``) keeps them in that device's memory. Units are picked by
    ``granularity`` as in layerwise casting (``"block"`` by default); with ``"block"``,
    ``blocks_per_unit`` consecutive blocks of a list make one unit (diffusers'
    ``num_blocks_per_group``), brought in when the first runs and dropped after the last.
    ``skip`` regexes (searched in qualified names and class names of modules, and in
    qualified names of tensors) leave what they find where it is, not offloaded.
    ``use_stream=True`` asks for prefetch copies on a side stream and is an error where
    the device's backend copies synchronously; ``False`` copies on the current stream;
    ``None`` (the default) uses a side stream where there is one. Apply layerwise casting
    first to offload float8 weights. All or nothing: when storing any unit fails (a full
    disk), what was done is undone and the error (an ``OSError`` for the disk) says
    nothing was offloaded.
    Returns the hooked units' names. ``storage`` is the old name of ``offload_to``
    (deprecated: "storage" is a weight format elsewhere in tightfit).
    """
    check_type("module", module, nn.Module)
    if storage is not None:
        if offload_to != "cpu":
            raise TypeError(f"pass offload_to={offload_to!r} alone: storage={storage!r} is its deprecated old name")
        warnings.warn(
            "apply_offloading(storage=...) is deprecated; use offload_to=...", DeprecationWarning, stacklevel=2
        )
        offload_to = storage
    backend, device = _check_device(device)
    offload_to, target = _check_target(offload_to)
    check_granularity(granularity)
    check_type("prefetch", prefetch, bool)
    if pin_memory is not None:
        check_type("pin_memory", pin_memory, bool)
    skip_patterns = compile_patterns("skip", skip)
    check_type("blocks_per_unit", blocks_per_unit, int)
    if isinstance(blocks_per_unit, bool) or blocks_per_unit < 1:
        raise ValueError(f"blocks_per_unit must be an int >= 1, got {blocks_per_unit!r}")
    if blocks_per_unit > 1 and granularity != "block":
        raise ValueError(
            f"blocks_per_unit={blocks_per_unit} groups the blocks of granularity='block'; "
            f"got granularity={granularity!r}"
        )
    async_copy = device.type != "cpu" and backend.capabilities().async_copy
    if use_stream is not None:
        check_type("use_stream", use_stream, bool)
        if use_stream and copy_streams(device) is None:
            raise ValueError(
                f"use_stream=True needs a device whose backend copies asynchronously on streams; device {device} "
                f"(backend {backend.name}) has none. Pass use_stream=False or leave it None"
            )
        if use_stream and not prefetch:
            raise ValueError("use_stream=True copies the next unit ahead on a side stream; it needs prefetch=True")
    if pin_memory and (offload_to != "cpu" or not async_copy):
        raise ValueError(
            f"pin_memory=True needs offload_to='cpu' and a device with asynchronous copies; got offload_to={offload_to!r}, "
            f"device {device} (backend {backend.name}, async_copy={async_copy})"
        )
    if path is not None:
        check_type("path", path, (str, Path))
        if offload_to != "disk":
            raise ValueError(f"path is only used with offload_to='disk', got offload_to={offload_to!r}")
        if not Path(path).is_dir():
            raise ValueError(f"path={str(path)!r} is not an existing folder")
    if _hooked(module, OFFLOADING):
        raise ValueError("offloading is already applied to this module; call remove_offloading(module) first")
    units = select_units(module, granularity, skip_patterns, blocks_per_unit=blocks_per_unit)
    for unit in units:
        for slot in unit.slots:
            if slot.get().is_meta:
                raise ValueError(
                    f"{unit.name or type(module).__name__}.{slot.name} is on the meta device (no data to offload); "
                    f"load the weights first (tightfit.load streams a checkpoint into an offloading plan)"
                )
    if offload_to == "disk":
        for unit in units:
            for slot in unit.slots:
                if slot.get().dtype not in DISK_DTYPES:
                    raise ValueError(
                        f"{unit.name or type(module).__name__}.{slot.name} has dtype {slot.get().dtype}, "
                        f"which an offload file does not hold; use offload_to='cpu'"
                    )
    streams = copy_streams(device) if prefetch and use_stream is not False else None
    folder = Path(path if path is not None else tempfile.gettempdir()) if offload_to == "disk" else None
    state = _Offload(device, offload_to, folder, streams, target)
    pin = async_copy if pin_memory is None else pin_memory
    with task(f"offloading to {offload_to}", len(units)) as advance:
        try:
            for unit in units:
                _store_unit(state, unit, pin and offload_to == "cpu")
                advance(1)
            state.swap_in()
        except BaseException as error:
            state.restore(state.read_back())
            if isinstance(error, OSError):
                raise _nothing_offloaded(error, folder) from error
            raise
    _hook(module, units, state, prefetch)
    return [unit.name for unit in units]


def _check_target(offload_to: object) -> tuple[str, torch.device | None]:
    """(``"disk"`` or the device's name, the device or None): where offloaded tensors live."""
    if not isinstance(offload_to, (str, torch.device)):
        raise TypeError(
            f"offload_to must be a str or torch.device, got {type(offload_to).__name__}: {offload_to!r}; "
            f"accepted: {', '.join(map(repr, OFFLOAD_TARGETS))} or a device such as 'cuda:1'"
        )
    if offload_to == "disk":
        return "disk", None
    try:
        parsed = torch.device(offload_to)
    except RuntimeError:
        raise ValueError(
            f"offload_to={offload_to!r} is not accepted; accepted: {', '.join(map(repr, OFFLOAD_TARGETS))} "
            f"or a device such as 'cuda:1'"
        ) from None
    if parsed.type == "cpu":
        return "cpu", torch.device("cpu")
    _, target = _check_device(parsed)  # its backend must be here
    return str(target), target


def _hook(module: nn.Module, units: list[Unit], state: _Offload, prefetch: bool) -> None:
    visible = _diffusers.wanted(module)
    for unit in units:
        members = unit.members if len(unit.members) > 1 else None
        hook = OffloadHook(state, _unique(unit.slots), members)
        if not visible:
            hook.diffusers_name = None
        for member in unit.members:
            HookRegistry.of(member).register(OFFLOADING, hook)
    if prefetch and state.prefetches:
        HookRegistry.of(module).register(OFFLOADING_SCHEDULE, _ScheduleHook(state.schedule))


def link_offloading(module: nn.Module) -> None:
    """One prefetch schedule over every offloaded unit under ``module``, however many
    calls offloaded them (a plan's units, offloaded one by one as a checkpoint streams in,
    to CPU memory and to disk): entering a unit prefetches the next whichever call
    offloaded it, as within one ``apply_offloading`` call. Private to tightfit."""
    found = (HookRegistry.get(m).hook(OFFLOADING) for m in _hooked(module, OFFLOADING))
    hooks = list({id(hook): hook for hook in found}.values())  # a unit of several blocks has one hook on each
    if not hooks:
        return
    schedule = _Schedule()
    for hook in hooks:
        hook.schedule = schedule
    for submodule in _hooked(module, OFFLOADING_SCHEDULE):
        HookRegistry.get(submodule).remove(OFFLOADING_SCHEDULE)
    if any(hook.state.prefetches for hook in hooks):
        HookRegistry.of(module).register(OFFLOADING_SCHEDULE, _ScheduleHook(schedule))


def offload_in_place(module: nn.Module, device: str | torch.device, files: list[MappedRegions]) -> None:
    """Hook ``module`` as one unit offloaded to disk whose tensors are views of ``files``
    already (a checkpoint mapped in place by ``tightfit.load``): it computes on ``device``
    from the files' pages, as a unit ``apply_offloading(offload_to="disk")`` wrote does.
    Its tensors that are no view of a file (converted on reading) stay in CPU memory and
    are copied like those offloaded to the CPU. Private to tightfit."""
    _, device = _check_device(device)
    if _hooked(module, OFFLOADING):
        raise ValueError("offloading is already applied to this module; call remove_offloading(module) first")
    streams = copy_streams(device)
    state = _Offload(device, "disk", files[0].folder if files else None, streams)
    views = {file.tensors[key].data_ptr(): (file, key) for file in files for key in file.tensors}
    units = select_units(module, "model", ())
    for slot in (slot for unit in units for slot in unit.slots):
        tensor = slot.get()
        found = views.get(tensor.data_ptr()) if tensor.numel() else None
        if found is not None and id(tensor) not in state.records:
            state.records[id(tensor)] = _Record(tensor, torch.device("cpu"), found[0], found[1], tensor._version)
    state.files.extend(files)
    _hook(module, units, state, True)


def _nothing_offloaded(error: OSError, folder: Path | None) -> OSError:
    """``error`` again (same errno, so callers may catch OSError), saying that applying was undone."""
    where = f" in {folder}; free space there or pass path= on another disk" if folder is not None else ""
    message = f"offloading failed ({error.strerror or error}){where}. Nothing was offloaded: the module is as it was"
    return OSError(error.errno, message, error.filename) if error.errno is not None else OSError(message)


def _unique(slots: Iterable[Slot]) -> list[Slot]:
    seen: dict[tuple[int, str], Slot] = {}
    for slot in slots:
        seen.setdefault((id(slot.owner), slot.name), slot)
    return list(seen.values())


def _store_unit(state: _Offload, unit: Unit, pin: bool) -> None:
    """Offload the unit's tensors not offloaded yet: CPU copies at once, a disk file to swap in at the end."""
    fresh = []
    for slot in unit.slots:
        tensor = slot.get()
        if id(tensor) not in state.records and (state.target is not None or tensor.numel()):
            state.records[id(tensor)] = _Record(tensor, tensor.device)
            fresh.append(tensor)
    if state.target is not None:
        for tensor in fresh:
            data = tensor.data.to(state.target)
            tensor.data = data.pin_memory() if pin else data
    elif fresh:
        file = MappedFile(state.folder, unit.name, {str(i): t for i, t in enumerate(fresh)})
        state.files.append(file)
        state.pending += [(state.records[id(tensor)], file, str(i)) for i, tensor in enumerate(fresh)]


def remove_offloading(module: nn.Module) -> None:
    """Remove the offloading hooks under ``module``; every tensor goes back to its device, bit for bit.

    Disk files are read back and checked first: when one changed since it was written,
    :class:`OffloadFileError` is raised and nothing is changed (no bad byte reaches the model).
    """
    check_type("module", module, nn.Module)
    hooked = _hooked(module, OFFLOADING)
    if not hooked:
        raise ValueError("no offloading is applied to this module")
    states = {id(hook.state): hook.state for hook in (HookRegistry.get(m).hook(OFFLOADING) for m in hooked)}
    restored = [(state, state.read_back()) for state in states.values()]
    for submodule in hooked:
        HookRegistry.get(submodule).remove(OFFLOADING)
    for submodule in _hooked(module, OFFLOADING_SCHEDULE):
        HookRegistry.get(submodule).remove(OFFLOADING_SCHEDULE)
    for state, data in restored:
        state.restore(data)


def resident_bytes(module: nn.Module, device: str | torch.device) -> int:
    """Bytes of ``module``'s parameters and buffers held in ``device``'s memory between forwards.

    Distinct storages count once; tensors memory-mapped from offloading files do not count
    (the OS may drop their pages at any time).
    """
    check_type("module", module, nn.Module)
    target = check_device("device", device)
    mapped = set()
    for submodule in _hooked(module, OFFLOADING):
        state = HookRegistry.get(submodule).hook(OFFLOADING).state
        mapped |= {id(record.tensor) for record in state.records.values() if record.file is not None}
    storages = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if (
            id(tensor) not in mapped
            and tensor.device.type == target.type
            and (target.index is None or tensor.device.index == target.index)
        ):
            storage = tensor.untyped_storage()
            storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())
