"""Replay the memory of a chunk's work the step has done before, instead of running it again.

The step's chunked loops (:mod:`memfit.step.chunking`) run each chunk's work as a *region*
(:func:`~memfit.step.chunking.run_region`): a call whose only effects are the new tensors it
returns and the transients it makes and frees, on behalf of one module. Under fake tensors the same
region comes back again and again with the same module and the same shapes: every full chunk of a
tiled MLP, in forward, in the recomputation of its activation checkpoint and in backward, in every
micro-batch of both simulated steps. Its allocations and frees are the same each time, in the same
order and of the same sizes, because a fake run's allocations follow from the ops and the shapes
alone.

:class:`RegionReplay` runs a region the first time for real (through the fake tensors and the
tracker) and keeps its events as a template, when what it saw makes a template sound: every event
of the region is an allocation made in it or the free of one; what is still alive at its end is
exactly what it returns, new tensors that nothing else holds; nothing outside the tracker's events
changed (the probe's state: attention kernels met, chunked loops recorded). The next time the same
module runs the same region on the same shapes under the same modes, the tracker is handed the
template's allocations and frees (:meth:`~memfit.planner.exact.tracker.MemoryTracker.replay_allocation`)
and the returned tensors are made empty with the template's shapes and strides: the same events, in
the same order, as running it, at a fraction of the cost. A test simulates with and without replay
and compares every event.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from memfit.planner.exact.tracker import Allocation, MemoryTracker

#: Set to False to make fake runs run every region (tests compare both ways).
REPLAY_REGIONS = True


@dataclass(frozen=True)
class Output:
    """One tensor a region returns (or a micro-batch leaves behind): which of its allocations holds
    it, and how to remake it."""

    local: int  # index of its allocation among the region's
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class _Template:
    """A region's memory: its allocations (as the tracker counted them) and events, and its return value."""

    allocations: tuple[Allocation, ...]
    events: tuple[tuple[bool, int], ...]  # (is an allocation, index among the region's allocations)
    outputs: tuple[Output | None, ...]
    container: type | None  # tuple or list; None for one tensor


class RegionReplay:
    """The planner's region runner (:func:`memfit.step.chunking.replaying_regions`) for one simulation.

    ``probe`` returns a snapshot of state outside the tracker's events that a region could change
    (a region that changed it is not replayed). ``templates``: where templates are kept, shared by
    the simulations of one kind of plan (:func:`memfit.planner.exact.simulate.simulate` keeps them by the
    model's config, the spec but for its shapes, and the architecture); a template is keyed by what
    decides its memory (:meth:`_key`), never by a module's identity, so modules equal in every
    respect (each block's MLP) share one.
    """

    def __init__(self, tracker: MemoryTracker, probe: Callable[[], Hashable] = lambda: None,
                 templates: dict | None = None) -> None:
        self.tracker = tracker
        self.probe = probe
        self._templates: dict[Hashable, _Template | None] = {} if templates is None else templates
        self.replayed = 0  # regions replayed (tests read it)

    def __call__(self, owner: Any, what: str, fn: Callable[..., Any], args: tuple) -> Any:
        key = self._key(owner, what, args) if REPLAY_REGIONS else None
        if key is None:
            return fn(*args)
        template = self._templates.get(key)
        if template is not None:
            self.replayed += 1
            return self._replay(template)
        tracker = self.tracker
        first_event, first_alloc, marks, before = len(tracker.events), len(tracker.allocations), len(tracker.phase_marks), self.probe()
        out = fn(*args)
        sound = len(tracker.phase_marks) == marks and self.probe() == before
        self._templates[key] = _template(tracker, out, first_event, first_alloc) if sound else None
        return out

    def _key(self, owner: Any, what: str, args: tuple) -> Hashable | None:
        """What decides a region's memory: the module and its state, the region, its arguments'
        shapes (or values), the modes; None when the region is not to be replayed."""
        grad = torch.is_grad_enabled()
        if grad and saved_tensors_hooked():
            return None  # saved tensors would go through hooks that may keep or move them
        shapes = []
        for a in args:
            if isinstance(a, torch.Tensor):
                shapes.append(tensor_key(a))
            elif isinstance(a, PLAIN):
                shapes.append(a)
            else:
                return None
        return (what, tuple(shapes), dispatch_modes(grad), tuple(self.tracker._places), module_state(owner))

    def _replay(self, template: _Template) -> Any:
        tracker = self.tracker
        made: dict[int, Allocation] = {}
        outputs: dict[int, torch.Tensor] = {}
        wanted = {o.local: o for o in template.outputs if o is not None}
        for is_alloc, local in template.events:
            like = template.allocations[local]
            if not is_alloc:
                tracker.replay_free(made.pop(local))
            elif local in wanted:
                outputs[local] = remake(tracker, wanted[local], like)
            else:
                made[local] = tracker.replay_allocation(like)
        values = [None if o is None else outputs[o.local] for o in template.outputs]
        return values[0] if template.container is None else template.container(values)


def remake(tracker: MemoryTracker, out: Output, like: Allocation, role: str | None = None) -> torch.Tensor:
    """An empty tensor laid out as ``out``, its allocation counted now as ``like``'s op and shape
    (for reports and the length model), with ``role`` where it is known already."""
    tensor = torch.empty_strided(out.shape, out.stride, dtype=out.dtype, device=out.device)
    alloc = tracker.allocation_of(tensor)
    alloc.op, alloc.shape, alloc.role = like.op, like.shape, role
    return tensor


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
    """The global modes a region's ops depend on."""
    return (grad, torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
            torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack())


def module_state(owner: Any) -> tuple:
    """What of a module decides what its forward does: each submodule's class, settings (its plain
    attributes: sizes, flags, PEFT's scaling and DoRA switches...), forwards patched on the instance,
    adapter switches and hooks; each parameter's and buffer's class, shape, dtype, device and
    requires_grad. Modules equal in all of these (the same layer of every block) share templates."""
    if not isinstance(owner, torch.nn.Module):
        return (type(owner),)
    modules = tuple(
        (name, type(m), m.training, _settings(m), _adapter_state(m), len(m._forward_hooks), len(m._forward_pre_hooks))
        for name, m in owner.named_modules()
    )
    tensors = tuple(
        (name, type(t), tuple(t.shape), t.dtype, t.device, t.requires_grad)
        for name, t in [*owner.named_parameters(), *owner.named_buffers()]
    )
    hooks = (len(torch.nn.modules.module._global_forward_hooks), len(torch.nn.modules.module._global_forward_pre_hooks))
    return modules, tensors, hooks


PLAIN = (bool, int, float, str, type(None), torch.dtype)


def _settings(module: torch.nn.Module) -> tuple:
    """A module's own attributes that are plain values (or containers of them), and the names of
    the functions set on the instance (a patched forward); other objects by their class."""
    found = []
    for name, value in vars(module).items():
        if name.startswith("_") and name not in ("_memfit_tile_tokens", "_disable_adapters"):
            if callable(value) and not isinstance(value, (dict, type)):
                found.append((name, getattr(value, "__qualname__", type(value).__qualname__)))
            continue
        found.append((name, _plain(value)))
    return tuple(found)


def _plain(value: Any) -> Hashable:
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        return (type(value), tuple(_plain(v) for v in value) if not isinstance(value, (set, frozenset)) else frozenset(map(_plain, value)))
    if isinstance(value, dict):
        return (dict, tuple((_plain(k), _plain(v)) for k, v in value.items()))
    if callable(value):
        return getattr(value, "__qualname__", type(value).__qualname__)
    return type(value)


def _adapter_state(module: torch.nn.Module) -> tuple:
    """A PEFT layer's switches (adapters disabled, merged, which are active); () for other modules."""
    if not hasattr(module, "active_adapters") or not hasattr(module, "merged_adapters"):
        return ()
    return (bool(getattr(module, "disable_adapters", False)), tuple(module.merged_adapters), tuple(module.active_adapters))


def _template(tracker: MemoryTracker, out: Any, first_event: int, first_alloc: int) -> _Template | None:
    """The template of a region that just ran, or None when what it did cannot be replayed."""
    allocations = tracker.allocations[first_alloc:]
    if any(a.place != "device" or a.role is not None for a in allocations):
        return None
    events = []
    for kind, alloc_id, _ in tracker.events[first_event:]:
        if alloc_id < first_alloc:
            return None  # it freed something it did not make
        events.append((kind == "alloc", alloc_id - first_alloc))
    container = None if isinstance(out, torch.Tensor) else type(out)
    if container not in (None, tuple, list):
        return None
    outputs = []
    for value in ([out] if container is None else out):
        output = _output(tracker, value, first_alloc) if value is not None else None
        if output is False:
            return None
        outputs.append(output)
    alive = {i for i, a in enumerate(allocations) if a.free_event is None}
    held = [o.local for o in outputs if o is not None]
    if sorted(held) != sorted(alive):
        return None  # something it made outlives it other than what it returns, or one storage is returned twice
    return _Template(tuple(allocations), tuple(events), tuple(outputs), container)


def _output(tracker: MemoryTracker, tensor: Any, first_alloc: int) -> Output | bool:
    """How to remake one returned tensor, or False when it is not a new, plain, whole storage."""
    alloc = whole_storage(tracker, tensor)
    if alloc is None or alloc.alloc_id < first_alloc:
        return False
    return output_of(tensor, alloc.alloc_id - first_alloc)


def _layout(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device


def output_of(tensor: torch.Tensor, local: int) -> Output:
    """How to remake ``tensor``, a whole storage, the ``local``-th allocation of what made it."""
    return Output(local, *_layout(tensor))


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
