"""The limits the detectors use, in one place, each with the reason for its value (docs/watch.md)."""

from __future__ import annotations

from dataclasses import dataclass

from memfit.units import GiB, MiB


@dataclass(frozen=True)
class Thresholds:
    """When a detector speaks up. Defaults suit real runs; tests pass smaller floors for tiny models."""

    # --- leak ---------------------------------------------------------------------------------
    #: Steps skipped at the start: optimizer states, allocator caches and lazily built kernels
    #: appear in the first steps and are not a leak.
    leak_warmup_steps: int = 10
    #: Fewest post-warm-up steps before a slope is trusted (pairwise slopes need a spread of steps).
    leak_min_points: int = 30
    #: The slope is measured over at most this many latest steps, so a leak that starts late is
    #: not diluted by a long flat start.
    leak_window: int = 400
    #: Growth per step that counts as a leak on a CUDA device. Allocated bytes after a step are
    #: exactly the same every step in a healthy loop (weights, states): any steady growth is real.
    device_leak_bytes_per_step: int = 64 * 1024
    #: Same for host RSS, which wanders with malloc arenas and Python object caches.
    host_leak_bytes_per_step: int = 256 * 1024
    #: The fitted growth across the window must also reach this much (tiny slopes over long runs).
    device_leak_min_growth_bytes: int = 16 * MiB
    host_leak_min_growth_bytes: int = 64 * MiB
    #: Each half of the window must grow at least this share of the threshold: a single jump (a
    #: cache filled once) is not a sustained climb.
    leak_half_fraction: float = 0.5
    #: Without a known run length, a leak is an error when memory is full within this many steps.
    leak_error_horizon_steps: int = 5000

    # --- stray device -------------------------------------------------------------------------
    #: PyTorch-allocated bytes on an unexpected device above which the finding is an error (below,
    #: a warning: a stray scalar is a bug but not yet a memory problem).
    stray_error_bytes: int = 64 * MiB
    #: NVML bytes of this process on an unexpected device (a CUDA context alone is ~300-600 MiB).
    stray_context_bytes: int = 64 * MiB
    #: Memory other processes hold on the run's device before it is worth a warning.
    other_processes_bytes: int = 1 * GiB

    # --- fragmentation ------------------------------------------------------------------------
    #: Reserved minus peak allocated must exceed both of these ...
    fragmentation_min_bytes: int = 1 * GiB
    fragmentation_fraction: float = 0.25
    #: ... for this many consecutive steps (a single odd batch is not a pattern).
    fragmentation_min_steps: int = 20

    # --- plan vs measured ---------------------------------------------------------------------
    #: Measured activations above plan x this ratio, and by at least the bytes below, is an error.
    activations_ratio: float = 1.5
    activations_min_excess_bytes: int = 64 * MiB
    #: Measured peak allocated above plan x this ratio, by at least the bytes below, is a warning.
    peak_ratio: float = 1.25
    peak_min_excess_bytes: int = 256 * MiB
