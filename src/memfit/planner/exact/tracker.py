"""Count every byte a piece of PyTorch code allocates, and say what each byte was for.

:class:`MemoryTracker` is a ``TorchDispatchMode``: it sees the output of every aten op, notes each
storage it has not seen before, and learns of its death through ``weakref.finalize``. It works the
same on real tensors and on fake ones (``FakeTensorMode``), which is what lets the planner run the
real training step with no GPU and no weights and still get the byte counts that a real run gets.

Each storage gets a role when its purpose becomes known:

- parameters: ``weights`` (frozen) or ``trainable`` (``mark_model``);
- ``gradients``: tensors that end up in ``param.grad`` (a post-accumulate-grad hook);
- ``optimizer``: tensors held in ``optimizer.state`` (``mark_optimizer``);
- ``activations``: what forward allocated and is still alive when backward starts (saved tensors,
  checkpoint inputs, the logits the loss keeps);
- ``runtime``: library workspaces that the planner injects (``allocate_runtime``);
- everything else is ``temporaries``.

Roles are final knowledge, applied to the whole lifetime of a storage: a tensor made in forward and
saved for backward is an activation from the moment it was allocated.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memfit.planner.categories import TRACKED_CATEGORIES
from memfit.planner.exact.allocator import K_MIN_BLOCK_SIZE, round_size, simulate as allocator_simulate
from memfit.step.host_embeddings import HOST_RESIDENT_ATTR
from memfit.step.preference import reference_model

# Roles win over each other in this order: a parameter saved for backward stays a parameter.
_ROLE_PRIORITY = {name: rank for rank, name in enumerate(TRACKED_CATEGORIES)}

#: CUDA's caching allocator hands out blocks in multiples of 512 bytes; counting the same way keeps
#: our "allocated" comparable with ``torch.cuda.memory_allocated``. The size of the block that holds
#: ``nbytes`` is the allocator model's ``round_size`` (a multiple of 512, at least 512).
BLOCK_BYTES = K_MIN_BLOCK_SIZE
round_block_bytes = round_size


#: The op C++ code (autograd, for one) dispatches to ask a tensor subclass for its device.
PRIM_DEVICE = torch.ops.prim.device.default


def known_device(func, args) -> torch.device | None:
    """The answer to ``func(*args)`` when it asks a fake tensor for its device, else None.

    Autograd asks every fake tensor for its device (``prim.device``), through every dispatch mode
    on the stack: half the ops a simulated step dispatches are these questions. A fake tensor knows
    its device (its ``device`` is a Python property), so the planner's modes answer at once instead
    of passing the question down.
    """
    if func is not PRIM_DEVICE:
        return None
    from torch._subclasses.fake_tensor import FakeTensor

    return args[0].device if len(args) == 1 and isinstance(args[0], FakeTensor) else None


@dataclass
class Allocation:
    """One storage's life: when it was allocated and freed (event indices) and what it was for."""

    alloc_id: int
    nbytes: int
    phase: str
    alloc_event: int
    free_event: int | None = None
    role: str | None = None
    place: str = "device"  # or outside the device allocator: "host" (pinned), "paged" (unified memory)
    op: str = ""  # the aten op whose output it was, for "what allocated this" reports
    requested_bytes: int = 0  # the storage's own size, before rounding to allocator blocks
    shape: tuple[int, ...] = ()  # the shape of the first tensor seen on it (how its size arose)

    @property
    def category(self) -> str:
        return self.role or "temporaries"


@dataclass
class Snapshot:
    """Live bytes by category at one moment (the peak), and where in the step it was."""

    event_index: int
    phase: str
    allocated_bytes: int
    categories: dict[str, int]


@dataclass
class TrackerResult:
    """What the tracker saw: every allocation, the event sequence and the peak."""

    allocations: list[Allocation]
    events: list[tuple[str, int, int]]  # device only: ("alloc", id, bytes) / ("free", id, 0)
    peak: Snapshot
    outside_peaks: dict[str, int]  # peak live bytes per place outside the device allocator
    phase_peaks: dict[str, int] = field(default_factory=dict)
    phase_marks: list[tuple[str, int]] = field(default_factory=list)
    peak_from_event: int = -1  # the peak is the highest moment after this event (set by reset_peak)
    #: A vision-language step's first forward through its vision tower and projector after the peak
    #: was reset: (index of the last event before that forward, index of the first event after the
    #: tower and projector ran); None for a text model.
    vision_window: tuple[int, int] | None = None
    _live: list[int] | None = field(default=None, repr=False, compare=False)  # live_bytes(), once worked out
    _reserved: tuple[int, int] | None = field(default=None, repr=False, compare=False)  # (events, reserved_bytes())

    def categories_at(self, event_index: int) -> dict[str, int]:
        """Live device bytes by category just after event ``event_index``."""
        totals = dict.fromkeys(TRACKED_CATEGORIES, 0)
        for a in self.allocations:
            if a.place != "device" or a.alloc_event > event_index:
                continue
            if a.free_event is not None and a.free_event <= event_index:
                continue
            totals[a.category] += a.nbytes
        return totals

    def vision_activation_bytes(self) -> int:
        """What the vision tower and projector keep for backward from one forward: the activations
        made while they ran (:attr:`vision_window`); 0 for a text model."""
        if self.vision_window is None:
            return 0
        first, stop = self.vision_window
        return sum(
            a.nbytes
            for a in self.allocations
            if a.place == "device" and a.role == "activations" and first < a.alloc_event < stop
        )

    def live_bytes(self) -> list[int]:
        """Live device bytes just after each event (worked out once: a result is not changed once made)."""
        if self._live is None or len(self._live) != len(self.events):
            sizes = {a.alloc_id: a.nbytes for a in self.allocations}
            live, series = 0, []
            for kind, alloc_id, _ in self.events:
                live += sizes[alloc_id] if kind == "alloc" else -sizes[alloc_id]
                series.append(live)
            self._live = series
        return self._live

    def reserved_bytes(self) -> int:
        """The bytes the caching allocator's model reserves at its highest over :attr:`events`
        (replayed once, when first asked: a plan whose depth is extrapolated replays the full depth's
        events instead, and never needs its samples' own)."""
        if self._reserved is None or self._reserved[0] != len(self.events):
            self._reserved = (len(self.events), allocator_simulate(self.events).peak_reserved_bytes)
        return self._reserved[1]

    def segments(self) -> list[Segment]:
        """The step's phases in order, each with its live bytes at start, at end and at its highest."""
        live = self.live_bytes()
        marks = list(self.phase_marks) + [("end", len(live) - 1)]
        found = []
        for (phase, start), (_, end) in itertools.pairwise(marks):
            if start < 0 or end <= start:
                continue
            top = max(range(start + 1, end + 1), key=live.__getitem__)
            found.append(Segment(phase, start, end, top, live[start], live[end], live[top]))
        return found


@dataclass(frozen=True)
class Segment:
    """One phase of a simulated step: event indices and live device bytes at its start, end and top."""

    phase: str
    start_event: int
    end_event: int
    top_event: int
    start_bytes: int
    end_bytes: int
    top_bytes: int


class MemoryTracker(TorchDispatchMode):
    """Dispatch mode that records each new storage, its size, its phase and (later) its role.

    Use it as a context manager around the code to measure, call :meth:`set_phase` as the code moves
    between ``setup``, ``forward``, ``backward`` and ``optimizer``, and read :meth:`result`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase = "setup"
        self.allocations: list[Allocation] = []
        self.events: list[tuple[str, int, int]] = []
        self._by_storage: dict[int, Allocation] = {}
        self._live_device_bytes = 0
        self._live_outside: dict[str, int] = {}
        self._peak_device_bytes = 0
        self._peak_outside: dict[str, int] = {}
        self._peak_event = -1
        self._peak_from_event = -1
        self._phase_peaks: dict[str, int] = {}
        self._places: list[str] = []  # innermost last: where new storages live
        self.phase_marks: list[tuple[str, int]] = []  # (phase, index of the last event before it)
        #: While a list: every allocation and free, device or not, in order, as (is an allocation,
        #: Allocation). A replayed micro-batch is recorded this way (:mod:`memfit.planner.shortcuts.micro_batches`).
        self.journal: list[tuple[bool, Allocation]] | None = None
        #: The event count each time a vision-language model's tower and projector finished a forward
        #: (:meth:`watch_vision`).
        self.vision_ends: list[int] = []
        #: id() of each trainable parameter -> the bytes of its gradient when autograd last accumulated it
        #: (0 where an optimizer stepping inside backward had already freed it).
        self.gradient_bytes: dict[int, int] = {}

    # ----------------------------------------------------------------- recording
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        device = known_device(func, args)
        if device is not None:
            return device
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Most ops return one tensor or a flat tuple of them: no need for a tree walk.
        if isinstance(out, torch.Tensor):
            flat = (out,)
        elif isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) or t is None for t in out):
            flat = out
        else:
            flat, _ = tree_flatten(out)
        # Pinned memory is host memory (offloaded activations), whatever device the fake run uses.
        pinned = bool(kwargs.get("pin_memory"))
        if pinned:
            self._places.append("host")
        try:
            for t in flat:
                if isinstance(t, torch.Tensor):
                    self._note(t, func)
        finally:
            if pinned:
                self._places.pop()
        return out

    def _note(self, tensor: torch.Tensor, func=None) -> Allocation | None:
        if tensor.device.type == "meta":
            return None
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse or opaque tensors have no storage
            return None
        key = storage._cdata
        known = self._by_storage.get(key)
        if known is not None:
            return known
        requested = int(storage.nbytes())
        nbytes = round_block_bytes(requested)
        alloc = Allocation(
            alloc_id=len(self.allocations),
            nbytes=nbytes,
            phase=self.phase,
            alloc_event=len(self.events),
            place=self._places[-1] if self._places else "device",
            op=getattr(func, "__name__", "") if func is not None else "",
            requested_bytes=requested,
            shape=tuple(int(n) for n in tensor.shape),
        )
        self._by_storage[key] = alloc
        self._record(alloc)
        weakref.finalize(storage, self._free, key, alloc)
        return alloc

    def _record(self, alloc: Allocation) -> None:
        """Count a new allocation: its event, the live bytes and the peaks."""
        nbytes = alloc.nbytes
        self.allocations.append(alloc)
        if self.journal is not None:
            self.journal.append((True, alloc))
        if alloc.place != "device":
            live = self._live_outside.get(alloc.place, 0) + nbytes
            self._live_outside[alloc.place] = live
            self._peak_outside[alloc.place] = max(self._peak_outside.get(alloc.place, 0), live)
        else:
            self.events.append(("alloc", alloc.alloc_id, nbytes))
            self._live_device_bytes += nbytes
            if self._live_device_bytes > self._peak_device_bytes:
                self._peak_device_bytes = self._live_device_bytes
                self._peak_event = alloc.alloc_event
            if self._live_device_bytes > self._phase_peaks.get(self.phase, 0):
                self._phase_peaks[self.phase] = self._live_device_bytes

    def _free(self, key: int, alloc: Allocation) -> None:
        if self._by_storage.get(key) is alloc:
            del self._by_storage[key]
        self._release(alloc)

    def _release(self, alloc: Allocation) -> None:
        alloc.free_event = len(self.events)
        if self.journal is not None:
            self.journal.append((False, alloc))
        if alloc.place != "device":
            self._live_outside[alloc.place] -= alloc.nbytes
        else:
            # Device events are what the caching-allocator model replays; host memory is not in it.
            self.events.append(("free", alloc.alloc_id, 0))
            self._live_device_bytes -= alloc.nbytes

    def replay_allocation(self, like: Allocation, *, as_made: bool = False) -> Allocation:
        """Count an allocation of ``like``'s size, op and shape now, with no tensor behind it: a
        replayed region's (:mod:`memfit.planner.shortcuts.regions`), freed by :meth:`replay_free`. ``as_made``:
        in ``like``'s place and with its role (a replayed micro-batch's,
        :mod:`memfit.planner.shortcuts.micro_batches`), rather than in the place
        new storages go now and with no role yet."""
        place = like.place if as_made else self._places[-1] if self._places else "device"
        alloc = Allocation(
            alloc_id=len(self.allocations),
            nbytes=like.nbytes,
            phase=self.phase,
            alloc_event=len(self.events),
            place=place,
            op=like.op,
            requested_bytes=like.requested_bytes,
            shape=like.shape,
            role=like.role if as_made else None,
        )
        self._record(alloc)
        return alloc

    def replay_free(self, alloc: Allocation) -> None:
        """Count the end of an allocation made by :meth:`replay_allocation`."""
        self._release(alloc)

    def allocation_of(self, tensor: torch.Tensor) -> Allocation | None:
        """The live allocation behind ``tensor``'s storage, if the tracker has seen it."""
        try:
            return self._by_storage.get(tensor.untyped_storage()._cdata)
        except (NotImplementedError, RuntimeError):
            return None

    # ----------------------------------------------------------------- phases and roles
    def set_phase(self, phase: str) -> None:
        """Name the part of the step that runs from now on (forward, backward, optimizer, ...).

        When forward ends, whatever forward allocated and is still alive is held for backward
        (saved tensors, checkpoint inputs, the logits the loss keeps): those are the activations.
        """
        if self.phase == "forward" and phase != "forward":
            for alloc in self._by_storage.values():
                if alloc.phase == "forward" and alloc.role is None:
                    alloc.role = "activations"
        if phase != self.phase:
            self.phase_marks.append((phase, len(self.events) - 1))
        self.phase = phase

    # The training step reports its phases through ``on_phase`` (see memfit.step.train_step.StepObserver).
    on_phase = set_phase

    def reset_peak(self) -> None:
        """Forget the peak so far (setup is not part of the step): the peak restarts at live bytes."""
        self._peak_device_bytes = self._live_device_bytes
        self._peak_event = len(self.events) - 1
        self._peak_from_event = self._peak_event
        self._peak_outside = dict(self._live_outside)
        self._phase_peaks = {}

    def assign(self, tensor: torch.Tensor, role: str) -> None:
        """Give the storage behind ``tensor`` a role, unless it already has a stronger one."""
        alloc = self._note(tensor)
        if alloc is None:
            return
        if alloc.role is None or _ROLE_PRIORITY[role] < _ROLE_PRIORITY[alloc.role]:
            alloc.role = role

    def mark_model(self, model: torch.nn.Module) -> None:
        """Label parameters (trainable or frozen weights) and buffers (weights) of ``model``.

        Tensors flagged with :data:`HOST_RESIDENT_ATTR` (kept in host memory on purpose, e.g. frozen
        input embeddings) count as host memory even when the tracker first sees them here.
        """
        for p in model.parameters():
            with self.outside_device("host") if getattr(p, HOST_RESIDENT_ATTR, False) else contextlib.nullcontext():
                self.assign(p, "trainable" if p.requires_grad else "weights")
            # Quantized parameters (bitsandbytes Params4bit) carry their quantization state beside
            # the packed data; it is stored on the device too.
            quant_state = getattr(p, "quant_state", None)
            if quant_state is not None:
                for t in _quant_state_tensors(quant_state):
                    self.assign(t, "weights")
            # An int8 weight (bitsandbytes Int8Params) carries one fp32 scale per row beside it (its
            # layer's matmul state holds them once it has run forward).
            scales = getattr(p, "SCB", None)
            if isinstance(scales, torch.Tensor):
                self.assign(scales, "weights")
        for module in model.modules():
            scales = getattr(getattr(module, "state", None), "SCB", None)
            if isinstance(scales, torch.Tensor):
                self.assign(scales, "weights")
        for b in model.buffers():
            with self.outside_device("host") if getattr(b, HOST_RESIDENT_ATTR, False) else contextlib.nullcontext():
                self.assign(b, "weights")
        # A DPO run's frozen reference copy (full fine-tuning) is weights, though not a submodule.
        reference = reference_model(model)
        if reference is not None:
            for t in list(reference.parameters()) + list(reference.buffers()):
                self.assign(t, "weights")

    def watch_gradients(self, model: torch.nn.Module) -> list:
        """Label each ``param.grad`` as gradients when autograd accumulates it. Returns the hook handles."""
        handles = []
        for p in model.parameters():
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(self._label_gradient))
        return handles

    def _label_gradient(self, param: torch.Tensor) -> None:
        # An optimizer that steps inside backward may already have used and freed the gradient.
        if param.grad is not None:
            self.assign(param.grad, "gradients")
        alloc = self.allocation_of(param.grad) if param.grad is not None else None
        self.gradient_bytes[id(param)] = alloc.nbytes if alloc is not None else 0

    def mark_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Label every tensor held in ``optimizer.state`` as optimizer state."""
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.assign(value, "optimizer")
                for t in _quant_state_tensors(value):
                    self.assign(t, "optimizer")

    def state_bytes(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """The bytes ``params`` hold as the tracker counts them: their own storages (``weights``), their
        gradients as autograd last accumulated them (``gradients``) and their optimizer states
        (``optimizer``, every tensor of ``optimizer.state`` of each, bitsandbytes' quantization states too)."""
        seen: set[int] = set()

        def counted(tensors) -> int:
            total = 0
            for t in tensors:
                alloc = self.allocation_of(t)
                if alloc is not None and alloc.alloc_id not in seen:
                    seen.add(alloc.alloc_id)
                    total += alloc.nbytes
            return total

        states = {}
        for inner in getattr(optimizer, "inner_optimizers", [optimizer]):
            states.update({id(p): state for p, state in inner.state.items()})
        optimizer_tensors = []
        for p in params:
            for value in states.get(id(p), {}).values():
                optimizer_tensors.extend([value] if isinstance(value, torch.Tensor) else _quant_state_tensors(value))
        return {
            "params": sum(p.numel() for p in params),
            "weights": counted(params),
            "gradients": sum(self.gradient_bytes.get(id(p), 0) for p in params),
            "optimizer": counted(optimizer_tensors),
        }

    @contextlib.contextmanager
    def outside_device(self, place: str) -> Iterator[None]:
        """Storages created within this block live outside the device allocator, in ``place``
        (``"host"``: pinned host memory; ``"paged"``: CUDA unified memory)."""
        self._places.append(place)
        try:
            yield
        finally:
            self._places.pop()

    def allocate_runtime(self, nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Allocate ``nbytes`` that stand for a library workspace (cuBLAS) and label them runtime."""
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.assign(workspace, "runtime")
        return workspace

    # ----------------------------------------------------------------- results
    @property
    def live_device_bytes(self) -> int:
        return self._live_device_bytes

    def watch_vision(self, parts) -> list:
        """Note when each of ``parts`` (a vision-language model's tower and projector) finishes a
        forward; returns the hooks (to remove)."""

        def finished(module, args, output) -> None:
            self.vision_ends.append(len(self.events))

        return [part.register_forward_hook(finished) for part in parts]

    def result(self) -> TrackerResult:
        """Everything recorded so far, with the category breakdown at the device peak."""
        partial = TrackerResult(
            allocations=list(self.allocations),
            events=list(self.events),
            peak=Snapshot(-1, "setup", 0, {}),
            outside_peaks=dict(self._peak_outside),
            phase_peaks=dict(self._phase_peaks),
            phase_marks=list(self.phase_marks),
            peak_from_event=self._peak_from_event,
            vision_window=_first_vision_forward(self.vision_ends, self.phase_marks, self._peak_from_event),
        )
        index = self._peak_event
        phase = self.allocations[self.events[index][1]].phase if index >= 0 else "setup"
        partial.peak = Snapshot(
            event_index=index,
            phase=phase,
            allocated_bytes=self._peak_device_bytes,
            categories=partial.categories_at(index),
        )
        return partial


def _first_vision_forward(
    vision_ends: list[int], phase_marks: list[tuple[str, int]], after: int
) -> tuple[int, int] | None:
    """The first forward through the vision parts after event ``after``: (the last event before that
    forward began, the event count when the last of the vision parts finished in it)."""
    ends = [end for end in vision_ends if end > after]
    forwards = [index for phase, index in phase_marks if phase == "forward"]
    starts = [index for index in forwards if ends and index < ends[0]]
    if not starts:
        return None
    # The tower and the projector each finish once a forward: the later, before the next forward.
    bound = next((index + 1 for index in forwards if index >= ends[0]), ends[-1])
    return starts[-1], max(end for end in ends if end <= bound)


def _quant_state_tensors(obj) -> list[torch.Tensor]:
    """Tensors inside a bitsandbytes QuantState (absmax, code, nested state), if ``obj`` is one."""
    found: list[torch.Tensor] = []
    for name in ("absmax", "code", "offset"):
        value = getattr(obj, name, None)
        if isinstance(value, torch.Tensor):
            found.append(value)
    nested = getattr(obj, "state2", None)
    if nested is not None and nested is not obj:
        found.extend(_quant_state_tensors(nested))
    return found
