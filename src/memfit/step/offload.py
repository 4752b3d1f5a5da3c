"""Offloaded activation checkpointing: each checkpointed layer's input waits in host memory.

With activation checkpointing a decoder layer keeps only its input hidden states
(``[batch, seq, hidden]``) until backward recomputes it. At long context those inputs of every
layer are what fills the GPU: Llama-3.1-8B at 100k tokens holds 32 x 100k x 4096 x 2 B = 26 GB of
them. Here each one is copied to pinned host memory when forward saves it, and copied back to the
device just before its layer's recomputation.

How the inputs are found: non-reentrant ``torch.utils.checkpoint`` saves its tensor arguments as
saved tensors *before* it installs its own hooks for the layer's inner activations, so
``saved_tensors_hooks`` entered around the checkpoint call see exactly the layer's inputs, and
nothing the layer computes.

On CUDA the copies overlap compute:

- forward (pack): the device-to-host copy runs on a side "copy" stream that first waits for the
  compute stream; ``record_stream`` keeps the caching allocator from handing the input's block to
  someone else before that copy has read it;
- backward (unpack of layer ``i``): layer ``i``'s input is normally on its way already; the compute
  stream waits for its copy, then the copy of layer ``i - 1``'s input is started, so that it moves
  while layer ``i`` is recomputed and differentiated.

On the CPU (tests, and a simulation's fake CPU device) the same code runs synchronously: the "host
copy" is a second CPU tensor and the "device copy" a third. Memory then behaves as on CUDA: a
layer's input lives on the device only while it is being packed, and in backward for the current
and the prefetched layer. Under :func:`pinned_host_copies` host copies are allocated with
``pin_memory=True`` on the CPU where they can be, which is how a memory tracker tells host memory
from device memory.

Limits: only tensors a layer receives as positional arguments are saved by the checkpoint, hence
offloaded (transformers passes the hidden states positionally; ``stats.tensors_packed`` staying 0 in
training means a model does not). Each copy is handed back once and freed, so a second backward
through the same graph (``retain_graph=True``) is refused with a clear error.

Use::

    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    enable_offloaded_checkpointing(model)
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.step.seam import host_copy_pinnable

#: Saved floating tensors smaller than this stay where they are: below a few KiB the fixed cost of
#: a copy (launch, event, host allocation) buys no memory worth having. Layer inputs are megabytes.
MIN_OFFLOAD_BYTES = 4096

_PIN_ON_CPU = threading.local()  # set by pinned_host_copies()


@contextlib.contextmanager
def pinned_host_copies(host_placement: Callable[[], Any] | None = None) -> Iterator[None]:
    """Allocate the host copies of CPU tensors with ``pin_memory=True`` while active, where they
    can be pinned (:func:`memfit.step.seam.host_copy_pinnable`).

    For a memory tracker on the CPU (the planner's, a run's recorder): it counts pinned allocations as
    host memory, so host and device bytes are told apart as on CUDA. Host copies that cannot be
    pinned stay plain; ``host_placement`` (a context manager factory, e.g. a tracker's
    ``outside_device("host")``) is then entered around their allocation, so a measurement counts
    them as host memory all the same.
    """
    previous = getattr(_PIN_ON_CPU, "active", False), getattr(_PIN_ON_CPU, "placement", None)
    _PIN_ON_CPU.active, _PIN_ON_CPU.placement = True, host_placement
    try:
        yield
    finally:
        _PIN_ON_CPU.active, _PIN_ON_CPU.placement = previous


def host_copy(source: torch.Tensor) -> torch.Tensor:
    """An empty host tensor like ``source`` to copy it into: pinned where :func:`pinned_copy_wanted`,
    and allocated under the host placement of :func:`pinned_host_copies` where it cannot be."""
    pinned = pinned_copy_wanted(source)
    placement = (
        getattr(_PIN_ON_CPU, "placement", None) if getattr(_PIN_ON_CPU, "active", False) and not pinned else None
    )
    with placement() if placement is not None else contextlib.nullcontext():
        return torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pinned)


@dataclass
class OffloadStats:
    """What the offloader did, counted since it was created (cheap integers, for tests and reports)."""

    tensors_packed: int = 0
    bytes_packed: int = 0
    tensors_unpacked: int = 0
    prefetches: int = 0  # copies back started ahead of their layer's recomputation
    sync_fetches: int = 0  # copies back started only when their layer needed them (no overlap)


class _Offloaded:
    """One saved tensor in host memory, and the chain to the tensor saved just before it."""

    __slots__ = ("__weakref__", "device", "device_copy", "fetched_event", "host", "index", "offloaded_event", "prev")

    def __init__(self, host: torch.Tensor, device: torch.device, prev: _Offloaded | None) -> None:
        self.host: torch.Tensor | None = host
        self.device = device
        self.offloaded_event: Any = None  # CUDA: the device-to-host copy is done
        self.device_copy: torch.Tensor | None = None  # set once the copy back has been started
        self.fetched_event: Any = None  # CUDA: the host-to-device copy is done
        # The tensor packed before this one in the same forward (the previous layer's input): the
        # one backward needs next, hence the one to prefetch when this one is unpacked.
        self.prev = prev
        self.index = 0 if prev is None else prev.index + 1  # position in its forward, 0 = first

    @property
    def consumed(self) -> bool:
        return self.host is None and self.device_copy is None


class ActivationOffloader:
    """Pack/unpack hooks that move checkpointed layer inputs to host memory and back.

    One per model. :meth:`checkpoint` is what each layer's ``_gradient_checkpointing_func`` calls.
    """

    def __init__(self, *, min_offload_bytes: int = MIN_OFFLOAD_BYTES) -> None:
        if isinstance(min_offload_bytes, bool) or not isinstance(min_offload_bytes, int) or min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes must be an integer >= 0, got {min_offload_bytes!r}")
        self.min_offload_bytes = min_offload_bytes
        self.stats = OffloadStats()
        self._copy_streams: dict[torch.device, Any] = {}
        # Weak: the offloader must not keep a forward's host copies alive; the autograd graph owns them.
        self._last_packed: weakref.ref[_Offloaded] | None = None

    # ----------------------------------------------------------------- the checkpoint function
    def checkpoint(self, function: Callable[..., Any], *args: Any, **checkpoint_kwargs: Any) -> Any:
        """Non-reentrant ``torch.utils.checkpoint`` of ``function(*args)`` with offloaded inputs."""
        from torch.utils.checkpoint import checkpoint

        checkpoint_kwargs["use_reentrant"] = False  # only non-reentrant saves inputs where our hooks see them
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return checkpoint(function, *args, **checkpoint_kwargs)

    # ----------------------------------------------------------------- forward: pack
    def _wants(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, nn.Parameter) or not tensor.is_floating_point():
            return False
        if tensor.layout is not torch.strided or tensor.device.type not in ("cpu", "cuda"):
            return False
        return tensor.numel() * tensor.element_size() >= self.min_offload_bytes

    def _pack(self, tensor: torch.Tensor) -> Any:
        if not self._wants(tensor):
            return tensor
        last = self._last_packed() if self._last_packed is not None else None
        if last is not None and last.consumed:
            last = None  # a finished forward: this tensor starts a new chain
        with torch.no_grad():
            source = tensor.detach()
            if source.device.type == "cuda":
                handle = self._pack_cuda(source, last)
            else:
                host = host_copy(source)
                host.copy_(source)
                handle = _Offloaded(host, source.device, last)
        self._last_packed = weakref.ref(handle)
        self.stats.tensors_packed += 1
        self.stats.bytes_packed += tensor.numel() * tensor.element_size()
        return handle

    def _pack_cuda(self, source: torch.Tensor, last: _Offloaded | None) -> _Offloaded:
        compute = torch.cuda.current_stream(source.device)
        copy_stream = self._copy_stream(source.device)
        copy_stream.wait_stream(compute)  # the input must be computed before it is read
        host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        with torch.cuda.stream(copy_stream):
            host.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(copy_stream)
        # The layer's forward may free the input right away; its block must not be reused before the
        # copy stream has read it.
        source.record_stream(copy_stream)
        handle = _Offloaded(host, source.device, last)
        handle.offloaded_event = event
        return handle

    def _copy_stream(self, device: torch.device) -> Any:
        stream = self._copy_streams.get(device)
        if stream is None:
            stream = self._copy_streams[device] = torch.cuda.Stream(device=device)
        return stream

    # ----------------------------------------------------------------- backward: unpack, prefetch
    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        handle = packed
        if handle.consumed:
            raise RuntimeError(
                "offloaded checkpointing hands each saved layer input back once and then frees it; "
                "a second backward through the same graph (retain_graph=True) is not supported. "
                "Use --checkpointing on for that."
            )
        if handle.device_copy is None:
            self.stats.sync_fetches += 1
            self._fetch(handle)
        else:
            self.stats.prefetches += 1
        tensor = handle.device_copy
        if handle.fetched_event is not None:
            compute = torch.cuda.current_stream(tensor.device)
            compute.wait_event(handle.fetched_event)
            # Made on the copy stream, used (and freed) on the compute stream.
            tensor.record_stream(compute)
        previous = handle.prev
        # Nothing of this tensor stays with the offloader or the handle once it is handed back.
        handle.host = handle.device_copy = handle.fetched_event = handle.offloaded_event = handle.prev = None
        if self._last_packed is not None and self._last_packed() is handle:
            self._last_packed = None
        self.stats.tensors_unpacked += 1
        # The previous layer's input is needed next: start its copy now, so it overlaps this layer.
        if previous is not None and previous.device_copy is None and previous.host is not None:
            self._fetch(previous)
        return tensor

    def _fetch(self, handle: _Offloaded) -> None:
        """Start copying ``handle``'s host tensor back to its device (on CPU: copy it now)."""
        host = handle.host
        with torch.no_grad():
            if handle.device.type == "cuda":
                copy_stream = self._copy_stream(handle.device)
                with torch.cuda.stream(copy_stream):
                    copy_stream.wait_event(handle.offloaded_event)
                    device_copy = torch.empty(host.shape, dtype=host.dtype, device=handle.device)
                    device_copy.copy_(host, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(copy_stream)
                handle.fetched_event = event
            else:
                device_copy = torch.empty(host.shape, dtype=host.dtype, device=handle.device)
                device_copy.copy_(host)
        handle.device_copy = device_copy


def pinned_copy_wanted(source: torch.Tensor) -> bool:
    """Whether a host copy of ``source`` should be pinned: always from CUDA (fast, asynchronous
    copies), and for CPU tensors under :func:`pinned_host_copies` (a memory tracker on the CPU)."""
    return source.device.type == "cuda" or _pin_cpu_copy(source)


def _pin_cpu_copy(source: torch.Tensor) -> bool:
    """Whether the host copy of a CPU tensor is allocated pinned (see :func:`pinned_host_copies`)."""
    return getattr(_PIN_ON_CPU, "active", False) and host_copy_pinnable(source)


def _checkpointed_modules(model: nn.Module) -> list[nn.Module]:
    """Modules that carry a checkpoint function and have checkpointing switched on."""
    return [
        m
        for m in model.modules()
        if getattr(m, "gradient_checkpointing", False) is True
        and callable(getattr(m, "_gradient_checkpointing_func", None))
    ]


def offloader_of(model: nn.Module) -> ActivationOffloader | None:
    """The offloader that :func:`enable_offloaded_checkpointing` installed on ``model``, if any."""
    for module in _checkpointed_modules(model):
        found = _offloader_in(module._gradient_checkpointing_func)
        if found is not None:
            return found
    return None


def _offloader_in(func: Any) -> ActivationOffloader | None:
    if isinstance(func, functools.partial):
        owner = getattr(func.func, "__self__", None)
        if isinstance(owner, ActivationOffloader):
            return owner
    return None


def enable_offloaded_checkpointing(model: nn.Module, *, min_offload_bytes: int = MIN_OFFLOAD_BYTES) -> int:
    """Make every checkpointed layer of ``model`` keep its saved input in host memory; return the layer count.

    Call it after transformers' checkpointing is on
    (``model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})``);
    it replaces each layer's ``_gradient_checkpointing_func`` with :meth:`ActivationOffloader.checkpoint`
    of one offloader shared by the model (other checkpoint arguments, such as
    ``preserve_rng_state``, are kept; checkpointing is always non-reentrant). PEFT-wrapped models work
    (the layers are inside). Calling it again changes nothing and returns the same count.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    modules = _checkpointed_modules(model)
    layers = [m for m in modules if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no layer with activation checkpointing on; enable it first: "
            'model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})'
        )
    offloader = offloader_of(model) or ActivationOffloader(min_offload_bytes=min_offload_bytes)
    for module in modules:
        current = module._gradient_checkpointing_func
        if _offloader_in(current) is offloader:
            continue
        kwargs = dict(current.keywords) if isinstance(current, functools.partial) else {}
        kwargs.pop("use_reentrant", None)
        module._gradient_checkpointing_func = functools.partial(offloader.checkpoint, **kwargs)
    return len(layers)
