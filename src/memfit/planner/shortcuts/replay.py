"""Replay the memory of work the step has done before, instead of running it again.

The step runs two kinds of self-contained work through its seam (:mod:`memfit.step.seam`): a
chunk's work (a *region*: a tiled MLP's or norm's chunk, in forward, in the recomputation of its
activation checkpoint and in backward) and a micro-batch (its forward and backward). Both are a
:class:`~memfit.step.seam.Unit`: a call whose effects are its return value, the transients it makes
and frees, the phases it tells the step's observer and the gradients it accumulates into its
module's parameters; a region is a micro-batch without phases or gradients. Under fake tensors a
unit's allocations and frees follow from the ops and the shapes alone, so the same unit on the same
module state, shapes, held gradients and modes (:func:`unit_key`) makes the same events every time:
every full chunk of every tiled layer, in every micro-batch of both simulated steps and at every
depth; and each step's first micro-batch, which runs with no gradients held on a batch of the same
shapes.

:class:`Replay`, the seam's runner for one simulation, runs a unit the first time for real (through
the fake tensors and the tracker), recording its journal: every allocation and free, device and
host, with the roles they end up with; the phases told to the observer between them; where each
gradient was added into a parameter. When the journal makes a sound template (every free is of an
allocation the unit made; what it still holds at its end is exactly what it returns and the
gradients it left on the parameters, new and whole storages; nothing but its own observer and
gradients wrote phases or accumulations), the next unit with the same key is replayed: the
observer is told the same phases at the same points (so it does what it would do then: cuBLAS's
workspaces), the tracker gets the same allocations and frees
(:meth:`~memfit.planner.exact.tracker.MemoryTracker.replay_allocation`), and the returned tensors
and gradients are made empty with the template's layouts. A micro-batch that finds exactly the
first one's gradients held replays it with each gradient freed after its accumulation, where the
first kept it as the parameter's ``.grad`` (autograd adds the new gradient into the one held and
frees it), when each was the storage backward made.

What a unit notes outside memory (the attention kernels met, the chunked loops run: the probe) only
grows within a simulation; a template keeps what its unit added, and is replayed only where that is
noted already.

The runner also answers which chunks of a chunked loop run: the first two and the last (the first
allocates what later chunks reuse, the second stands for every full chunk after it, the last may be
partial), the same peak, categories and reserved memory as every chunk; and it records each loop
(rows, chunk) for the length model (:mod:`memfit.planner.shortcuts.lengths`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from memfit.planner.exact.tracker import Allocation, MemoryTracker
from memfit.step.seam import Unit, memory_attributes

#: Chunked loops of more chunks than this run only the first two and the last under the runner.
SHORTCUT_CHUNKS = 3


@dataclass(frozen=True)
class Output:
    """One tensor a unit returns or leaves on a parameter: which of its allocations holds it, and
    how to remake it."""

    local: int  # index of its allocation among the unit's
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def layout(self) -> tuple:
        return self.shape, self.stride, self.dtype, self.device


@dataclass(frozen=True)
class Template:
    """A unit's memory: its journal (("alloc", Allocation), ("free", index among its allocations),
    ("phase", name) told to the observer, ("accumulated", parameter index) where a gradient was added
    into a parameter), what it returned, the gradients it left and what it noted outside memory."""

    journal: tuple[tuple[str, Any], ...]
    outputs: tuple[Output | None, ...]  # the returned tensors, flattened
    treespec: Any  # how to put the returned value back together
    grads: tuple[tuple[int, Output], ...]  # (parameter index, the gradient it left on it)
    stolen: bool  # each gradient it left is the storage backward made (not a copy of it)
    notes: tuple[frozenset, ...]  # what it added to the probe (and to the chunked loops)


class Replay:
    """The seam's runner (:class:`memfit.step.seam.Runner`) for one simulation.

    ``templates``: where templates are kept, shared by the simulations of one kind of plan (their
    depths, lengths and micro-batches: :class:`memfit.planner.shortcuts.memo.Memo` keeps them by the
    model's config, the spec but for its shapes, and the architecture); a template is keyed by what
    decides its memory (:func:`unit_key`), never by a module's identity, so modules equal in every
    respect (each block's MLP) share one. :meth:`bind` gives it the simulation's tracker.
    """

    def __init__(self, templates: dict | None = None) -> None:
        self.templates: dict[Hashable, Template | None] = {} if templates is None else templates
        self.loops: set[tuple[int, int]] = set()  # (rows, chunk) of every chunked loop run
        self.replayed = 0  # units replayed (tests read it)
        self.tracker: MemoryTracker | None = None
        self.probe: Callable[[], frozenset] = frozenset
        self.micro_batches = True

    def bind(
        self, tracker: MemoryTracker, probe: Callable[[], frozenset] = frozenset, micro_batches: bool = True
    ) -> Replay:
        """This runner for the simulation ``tracker`` counts: ``probe`` returns what the simulation
        has noted outside memory (a set that only grows); ``micro_batches`` False runs every
        micro-batch (a loss scaler's first scaling makes its scale)."""
        self.tracker, self.probe, self.micro_batches = tracker, probe, micro_batches
        return self

    def chunk_starts(self, starts: list[int], total: int, chunk: int) -> list[int]:
        self.loops.add((int(total), int(chunk)))
        return starts[:2] + starts[-1:] if len(starts) > SHORTCUT_CHUNKS else starts

    def run(self, unit: Unit) -> Any:
        if unit.gradients and not self.micro_batches:
            return unit.run(unit.observer)
        key = unit_key(unit, self.tracker)
        if key is None:
            return unit.run(unit.observer)
        base, held = key
        if held and key not in self.templates:
            first = self.templates.get((base, ()))
            if first is not None and first.stolen and held == tuple((i, o.layout) for i, o in first.grads):
                self.templates[key] = _accumulating(first)
        template = self.templates.get(key)
        if template is not None:
            if not all(added <= now for added, now in zip(template.notes, self._noted())):
                return unit.run(unit.observer)  # it would note what is not noted yet
            self.replayed += 1
            return _replay(self.tracker, unit, template)
        if held:
            return unit.run(unit.observer)  # accumulating, with no first micro-batch to derive it from
        out, self.templates[key] = self._record(unit)
        return out

    def _noted(self) -> tuple[frozenset, ...]:
        return frozenset(self.probe()), frozenset(self.loops)

    def _record(self, unit: Unit) -> tuple[Any, Template | None]:
        """Run ``unit``, journaling what it does; its output and its template (None: not replayable)."""
        tracker = self.tracker
        journal: list[tuple[Any, Any]] = []
        arrived: dict[int, int] = {}  # parameter index -> the allocation of the first gradient it was handed
        handles = _watch_accumulation(tracker, unit.owner, arrived) if unit.gradients else []
        marks, before = len(tracker.phase_marks), self._noted()
        outer, tracker.journal = tracker.journal, journal
        try:
            out = unit.run(_Told(tracker, unit.observer) if unit.observer is not None else None)
        finally:
            tracker.journal = outer
            if outer is not None:
                outer.extend(journal)  # a unit inside another's recording: the outer one's too
            for handle in handles:
                handle.remove()
        if unit.observer is None and len(tracker.phase_marks) != marks:
            return out, None  # phases changed without an observer to tell them to
        notes = tuple(now - then for now, then in zip(self._noted(), before))
        return out, _template(tracker, unit, journal, arrived, out, notes)


class _Told:
    """A unit's observer, told through here: the phases join the journal; what the observer
    allocates itself (cuBLAS workspaces) does not."""

    def __init__(self, tracker: MemoryTracker, observer: Any) -> None:
        self.tracker, self.observer = tracker, observer

    def on_phase(self, name: str) -> None:
        journal, self.tracker.journal = self.tracker.journal, None
        journal.append(("phase", name))
        try:
            self.observer.on_phase(name)
        finally:
            self.tracker.journal = journal


def _replay(tracker: MemoryTracker, unit: Unit, template: Template) -> Any:
    """Hand ``tracker`` the template's events, tell the observer its phases, put empty gradients of
    the template's layouts on the parameters; the returned value, remade empty."""
    from torch.utils._pytree import tree_unflatten

    wanted = {o.local: o for o in template.outputs if o is not None}
    wanted.update((o.local, o) for _, o in template.grads)
    made: dict[int, Allocation] = {}
    tensors: dict[int, torch.Tensor] = {}
    local = 0
    for kind, value in template.journal:
        if kind == "alloc":
            if local in wanted:
                tensors[local] = remake(tracker, wanted[local], value)
            else:
                made[local] = tracker.replay_allocation(value, as_made=True)
            local += 1
        elif kind == "free":
            tracker.replay_free(made.pop(value))
        elif kind == "phase":
            unit.observer.on_phase(value)
    if template.grads:
        params = list(unit.owner.parameters())
        for index, out in template.grads:
            params[index].grad = tensors[out.local]
    leaves = [None if o is None else tensors[o.local] for o in template.outputs]
    return tree_unflatten(leaves, template.treespec)


def remake(tracker: MemoryTracker, out: Output, like: Allocation) -> torch.Tensor:
    """An empty tensor laid out as ``out``, its allocation counted now with ``like``'s op, shape and role."""
    tensor = torch.empty_strided(out.shape, out.stride, dtype=out.dtype, device=out.device)
    alloc = tracker.allocation_of(tensor)
    alloc.op, alloc.shape, alloc.role = like.op, like.shape, like.role
    return tensor


# ------------------------------------------------------------------------------------------------
# What decides a unit's memory


def unit_key(unit: Unit, tracker: MemoryTracker) -> tuple[Hashable, tuple] | None:
    """What decides ``unit``'s memory (the work, its inputs' shapes and plain values, the modes, where
    new storages go, its module's state) and the gradients its module holds, when it accumulates
    them; None when it is not to be replayed."""
    grad = torch.is_grad_enabled()
    # Saved tensors would go through hooks that may keep or move them (a micro-batch runs backward
    # whatever mode it starts in).
    if (grad or unit.gradients) and saved_tensors_hooked():
        return None
    if unit.gradients and not isinstance(unit.owner, torch.nn.Module):
        return None
    shapes = _shapes(unit.inputs)
    if shapes is None:
        return None
    held = ()
    if unit.gradients:
        held = tuple((i, _layout(p.grad)) for i, p in enumerate(unit.owner.parameters()) if p.grad is not None)
    return (unit.what, shapes, dispatch_modes(grad), tuple(tracker._places), module_state(unit.owner)), held


def tensor_key(t: torch.Tensor) -> tuple:
    """What of a tensor argument decides the memory of what runs on it: its layout, dtype, device,
    whether it requires grad and its class."""
    return tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad, type(t)


def saved_tensors_hooked() -> bool:
    """Whether saved-tensor hooks are active (``torch.autograd.graph.saved_tensors_hooks``); True
    when this torch cannot say, so that nothing is replayed on a guess."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def dispatch_modes(grad: bool) -> tuple:
    """The global modes a unit's ops depend on."""
    return (
        grad,
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
        torch._C._len_torch_function_stack(),
        torch._C._len_torch_dispatch_stack(),
    )


def module_state(owner: Any) -> tuple:
    """What of a module decides what its forward does: each submodule's class, settings (its plain
    attributes: sizes, flags, PEFT's scaling and DoRA switches, and the private attributes declared
    as deciding memory, :func:`memfit.step.seam.memory_attribute`), forwards patched on the
    instance, adapter switches and hooks; each parameter's and buffer's class, shape, dtype, device
    and requires_grad. Modules equal in all of these (the same layer of every block) share templates."""
    if not isinstance(owner, torch.nn.Module):
        return (type(owner),)
    declared = memory_attributes()
    modules = tuple(
        (
            name,
            type(m),
            m.training,
            _settings(m, declared),
            _adapter_state(m),
            len(m._forward_hooks),
            len(m._forward_pre_hooks),
        )
        for name, m in owner.named_modules()
    )
    tensors = tuple(
        (name, type(t), tuple(t.shape), t.dtype, t.device, t.requires_grad)
        for name, t in [*owner.named_parameters(), *owner.named_buffers()]
    )
    hooks = (len(torch.nn.modules.module._global_forward_hooks), len(torch.nn.modules.module._global_forward_pre_hooks))
    return modules, tensors, hooks


PLAIN = (bool, int, float, str, type(None), torch.dtype)


def _settings(module: torch.nn.Module, declared: frozenset[str]) -> tuple:
    """A module's own attributes that are plain values (or containers of them), the private ones
    only where ``declared``; and the names of the functions set on the instance (a patched forward);
    other objects by their class."""
    found = []
    for name, value in vars(module).items():
        if name.startswith("_") and name not in declared:
            if callable(value) and not isinstance(value, (dict, type)):
                found.append((name, getattr(value, "__qualname__", type(value).__qualname__)))
            continue
        found.append((name, _plain(value)))
    return tuple(found)


def _plain(value: Any) -> Hashable:
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        return (
            type(value),
            tuple(_plain(v) for v in value)
            if not isinstance(value, (set, frozenset))
            else frozenset(map(_plain, value)),
        )
    if isinstance(value, dict):
        return (dict, tuple((_plain(k), _plain(v)) for k, v in value.items()))
    if callable(value):
        return getattr(value, "__qualname__", type(value).__qualname__)
    return type(value)


def _adapter_state(module: torch.nn.Module) -> tuple:
    """A PEFT layer's switches (adapters disabled, merged, which are active); () for other modules."""
    if not hasattr(module, "active_adapters") or not hasattr(module, "merged_adapters"):
        return ()
    return (
        bool(getattr(module, "disable_adapters", False)),
        tuple(module.merged_adapters),
        tuple(module.active_adapters),
    )


def _shapes(value: Any) -> Hashable | None:
    """The shapes (and plain values) of a unit's inputs, nested; None when something else is in them."""
    if isinstance(value, torch.Tensor):
        return tensor_key(value)
    if isinstance(value, PLAIN):
        return (value,)
    if isinstance(value, Mapping):
        items = tuple((k, _shapes(v)) for k, v in value.items())
        return None if any(v is None for _, v in items) else (type(value), items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # e.g. the documents of a packed row
        items = tuple((f.name, _shapes(getattr(value, f.name))) for f in dataclasses.fields(value))
        return None if any(v is None for _, v in items) else (type(value), items)
    if isinstance(value, (list, tuple)):
        items = tuple(_shapes(v) for v in value)
        return None if None in items else (type(value), items)
    return None


def _layout(t: torch.Tensor) -> tuple:
    """Shape, strides, dtype and device of a tensor (as :attr:`Output.layout` has them)."""
    return tuple(t.shape), tuple(t.stride()), t.dtype, t.device


# ------------------------------------------------------------------------------------------------
# Templates


def _watch_accumulation(tracker: MemoryTracker, model: torch.nn.Module, arrived: dict[int, int]) -> list:
    """Hooks that note, for each trainable parameter, the allocation of the first gradient autograd
    hands it (``arrived``) and, in the journal being written, each time a gradient has been
    accumulated into it. They only read: what autograd does is the same with them as without."""
    handles = []
    for index, p in enumerate(model.parameters()):
        if not p.requires_grad:
            continue

        def handed(grad: torch.Tensor, index: int = index) -> None:
            if index not in arrived:
                alloc = tracker.allocation_of(grad)
                arrived[index] = alloc.alloc_id if alloc is not None else -1

        def accumulated(_: torch.Tensor, index: int = index) -> None:
            if tracker.journal is not None:
                tracker.journal.append(("accumulated", index))

        handles.append(p.register_hook(handed))
        handles.append(p.register_post_accumulate_grad_hook(accumulated))
    return handles


def _template(
    tracker: MemoryTracker, unit: Unit, journal: list, arrived: dict[int, int], out: Any, notes: tuple[frozenset, ...]
) -> Template | None:
    """The template of a unit that just ran, or None when it cannot be replayed."""
    from torch.utils._pytree import tree_flatten

    local_of: dict[int, int] = {}  # alloc_id -> index among the unit's allocations
    entries: list[tuple[str, Any]] = []
    for kind, value in journal:
        if kind is True:
            local_of[value.alloc_id] = len(local_of)
            entries.append(("alloc", dataclasses.replace(value)))  # as it is now: roles can come later
        elif kind is False:
            if value.alloc_id not in local_of:
                return None  # it freed something it did not make
            entries.append(("free", local_of[value.alloc_id]))
        elif (kind == "phase" and unit.observer is None) or (kind == "accumulated" and not unit.gradients):
            return None  # another unit's phases or gradients, written while this one ran
        else:
            entries.append((kind, value))
    leaves, treespec = tree_flatten(out)
    outputs, held = [], []
    for leaf in leaves:
        output = None if leaf is None else _left_behind(tracker, leaf, local_of)
        if output is False:
            return None
        outputs.append(output)
        held.extend([output.local] if output is not None else [])
    grads = []
    for index, p in enumerate(unit.owner.parameters() if unit.gradients else ()):
        if p.grad is not None:
            output = _left_behind(tracker, p.grad, local_of)
            if output is False:
                return None
            grads.append((index, output))
            held.append(output.local)
    freed = {value for kind, value in entries if kind == "free"}
    if sorted(held) != sorted(set(local_of.values()) - freed):
        return None  # it left something else behind, or one storage twice
    stolen = all(local_of.get(arrived.get(index, -1)) == output.local for index, output in grads)
    return Template(tuple(entries), tuple(outputs), treespec, tuple(grads), stolen, notes)


def _accumulating(first: Template) -> Template:
    """``first`` as it runs with its own gradients held: each gradient backward makes is added into
    the one held and freed after the parameter's first accumulation, instead of kept as its
    ``.grad`` (a parameter handed several gradients, a tied one, adds the later ones alike in both)."""
    grad_of = {index: output.local for index, output in first.grads}
    kept = set(grad_of.values())
    journal: list[tuple[str, Any]] = []
    freed: set[int] = set()
    local = 0
    for kind, value in first.journal:
        if kind == "alloc":
            journal.append((kind, dataclasses.replace(value, role=None) if local in kept else value))
            local += 1
        elif kind == "accumulated":
            if value in grad_of and value not in freed:
                freed.add(value)
                journal.append(("free", grad_of[value]))
        else:
            journal.append((kind, value))
    return dataclasses.replace(first, journal=tuple(journal), grads=(), stolen=False)


def _left_behind(tracker: MemoryTracker, tensor: Any, local_of: dict[int, int]) -> Output | bool:
    """How to remake a tensor a unit returned or left on a parameter, or False when it is not a new,
    plain, whole storage of the unit's (``local_of``: alloc_id -> its index among them)."""
    alloc = whole_storage(tracker, tensor)
    if alloc is None or alloc.alloc_id not in local_of:
        return False
    return Output(local_of[alloc.alloc_id], *_layout(tensor))


def whole_storage(tracker: MemoryTracker, tensor: Any) -> Allocation | None:
    """The tracker's allocation of ``tensor`` when ``tensor`` is a plain fake tensor that does not
    require grad and spans its whole storage (so that ``empty_strided`` remakes it), else None."""
    from torch._subclasses.fake_tensor import FakeTensor

    if type(tensor) is not FakeTensor or tensor.requires_grad or tensor.storage_offset() != 0:
        return None
    alloc = tracker.allocation_of(tensor)
    if alloc is None:
        return None
    shape, stride = tuple(tensor.shape), tuple(tensor.stride())
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    if span * tensor.element_size() != alloc.requested_bytes:
        return None  # empty_strided would not remake the same storage
    return alloc
