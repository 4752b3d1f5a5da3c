"""What a plan is compared against: one :class:`Target`, from the options or from a live device.

Every comparison of a plan with memory takes a Target: :func:`memfit.plan`, ``memfit fit``'s search,
and each question a training run asks (:class:`memfit.planner.search.run.RunPlanner`: preflight,
``fit: auto``, the step down after running out of memory). A Target is made in one of two ways:

- from the options (:func:`resolve_target`, :func:`target_from_options`): ``--gpu NAME`` (a GPU
  catalog entry: its memory, architecture and bf16 support) and / or ``--budget SIZE`` (a number of
  bytes the run may use; with a GPU it can only lower the card's memory). The CUDA context is the
  planner's estimate (:mod:`memfit.planner.exact.runtime`).
- from a live CUDA device (:func:`live_target`), with one policy. The device is read once, through
  one probe (:func:`read_cuda_device`: its name, the bytes free and the bytes in all), when the run
  starts planning. The budget is what is free then: what other processes hold is not the run's to
  use, and the description says how much that is. The CUDA context counts as spent (context bytes
  0): reading the device creates this process's context, whose memory is then already missing from
  "free", so a plan must not add it again. A card the GPU catalog knows lends its catalog name,
  architecture and bf16 support to the runtime estimates (cuBLAS workspaces) and to the precision
  notes; an unknown card plans with the default estimates.

The probe is the only thing here that touches a GPU; tests give :func:`live_target` a probe of
their own (any function returning a :class:`DeviceReading`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memfit.units import format_bytes, parse_bytes

#: How a Target was obtained (``Target.source``).
SOURCES = ("none", "gpu", "budget", "device")


@dataclass(frozen=True)
class Target:
    """The memory a plan is compared against, and the card whose runtime figures it uses.

    ``name`` is how a plan shows it (``rtx-4090``, ``rtx-4090, budget 20GiB``, ``budget 24GiB``, a
    device's name); ``memory_bytes`` the bytes the run may use (None: nothing to compare with, the
    plan says neither fits nor not); ``context_bytes`` the CUDA context a plan adds (None: the
    planner's estimate; 0: already spent, measured in the free memory of a live device);
    ``arch`` / ``supports_bf16`` / ``card`` come from the GPU catalog when the card is known;
    ``source`` says how the Target was obtained (one of :data:`SOURCES`) and ``description`` says it
    in a line for the console.
    """

    name: str | None = None
    memory_bytes: int | None = None
    context_bytes: int | None = None
    arch: str | None = None
    supports_bf16: bool | None = None
    card: str | None = None
    source: str = "none"
    description: str = ""

    @property
    def has_memory(self) -> bool:
        """Whether there is memory to compare a plan with."""
        return self.memory_bytes is not None

    def key(self) -> dict[str, Any]:
        """What a plan of this Target depends on, besides the CUDA context (the plan cache's key)."""
        return {
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "arch": self.arch,
            "supports_bf16": self.supports_bf16,
            "card": self.card,
        }


#: No GPU, no budget: a plan is made, and compared with nothing.
NO_TARGET = Target()


def resolve_target(gpu: str | None, budget: str | int | None) -> tuple[Target, list[str]]:
    """The Target of ``--gpu`` / ``--budget``, and what is wrong with each (one line per problem,
    naming the option, the value and the fix). Imports neither torch nor transformers."""
    target, problems = NO_TARGET, []
    if gpu is not None:
        from memfit.models.gpus import get_gpu

        try:
            card = get_gpu(gpu)
            target = Target(
                card.name, card.memory_bytes, None, card.arch, card.supports_bf16, card.name, "gpu", card.name
            )
        except ValueError as err:
            problems.append(f"--gpu: {err}")
    if budget is not None:
        try:
            budget_bytes = _budget_bytes(budget, target)
            name = f"{target.name}, budget {budget}" if target.name else f"budget {budget}"
            target = Target(name, budget_bytes, None, target.arch, target.supports_bf16, target.card, "budget", name)
        except ValueError as err:
            problems.append(f"--budget: {err}")
    return target, problems


def _budget_bytes(budget: str | int, target: Target) -> int:
    budget_bytes = parse_bytes(budget)
    if budget_bytes <= 0:
        raise ValueError(f"{budget!r} must be more than 0 bytes (e.g. '24GiB')")
    if target.memory_bytes is not None and budget_bytes > target.memory_bytes:
        # A budget lowers what the card offers (room kept for something else); it cannot add memory.
        raise ValueError(
            f"{budget} is more than {target.name}'s {format_bytes(target.memory_bytes)}: a budget can only be "
            f"lower than the card's memory. Drop --budget, or use a larger --gpu."
        )
    return budget_bytes


def target_from_options(gpu: str | None, budget: str | int | None) -> Target:
    """:func:`resolve_target`, raising :class:`~memfit.planner.errors.PlanError` listing every problem."""
    target, problems = resolve_target(gpu, budget)
    if problems:
        from memfit.planner.errors import PlanError

        raise PlanError(problems)
    return target


# ------------------------------------------------------------------------------------------------
# A live device


@dataclass(frozen=True)
class DeviceReading:
    """What the probe reads of a CUDA device: its name, the bytes free now and the bytes in all."""

    name: str
    free_bytes: int
    total_bytes: int


def read_cuda_device(index: int | None = None) -> DeviceReading:
    """The probe: CUDA device ``index`` (None: the current one) as the driver reports it now."""
    import torch

    free_bytes, total_bytes = torch.cuda.mem_get_info(index)
    return DeviceReading(torch.cuda.get_device_name(index), int(free_bytes), int(total_bytes))


def device_target(reading: DeviceReading) -> Target:
    """The Target of a live device read as ``reading``, by the policy in this module's docstring
    (pure: what is free is the budget, the CUDA context is spent, a known card lends its catalog figures)."""
    from memfit.models.gpus import get_gpu

    try:
        card = get_gpu(reading.name)
    except ValueError:
        card = None
    others = reading.total_bytes - reading.free_bytes
    description = (
        f"{reading.name}: {format_bytes(reading.free_bytes)} free of {format_bytes(reading.total_bytes)} "
        f"({format_bytes(others)} held by this process's CUDA context and other processes)"
    )
    return Target(
        name=f"{reading.name} (free memory)",
        memory_bytes=reading.free_bytes,
        context_bytes=0,
        arch=card.arch if card is not None else None,
        supports_bf16=card.supports_bf16 if card is not None else None,
        card=card.name if card is not None else None,
        source="device",
        description=description,
    )


#: Reads a CUDA device by its index: :func:`read_cuda_device`, or a test's stand-in.
Probe = Callable[[int | None], DeviceReading]


def live_target(index: int | None = None, probe: Probe = read_cuda_device) -> Target:
    """The Target of CUDA device ``index``, read now through ``probe``."""
    return device_target(probe(index))
