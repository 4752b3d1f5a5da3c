"""Run memfit's real training step under fake tensors and record its memory.

The model is built on ``meta`` and prepared exactly as the trainer prepares it (quantize, attach
adapters, enable checkpointing); inside ``FakeTensorMode`` it gets fake storage, and two full
training steps run (the second one with optimizer states in place) while a
:class:`~memfit.planner.tracker.MemoryTracker` counts every byte. No GPU and no weights are needed.

The fake device is the CPU: there PyTorch's SDPA picks its flash-attention kernel, whose memory
(output plus log-sum-exp, no attention matrix) is that of CUDA's flash and memory-efficient
kernels. Where CPU kernels allocate differently from CUDA ones, :mod:`memfit.planner.cuda_parity`
rewrites the op to what CUDA does.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from memfit.models.build import DTYPES, build_meta_model, count_parameters, make_config, materialize, prepare_for_method
from memfit.planner.cuda_parity import CudaParityMode
from memfit.planner.tracker import MemoryTracker, TrackerResult
from memfit.spec import RunSpec
from memfit.train.optim import build_optimizer
from memfit.train.step import train_step

#: The fake device the step runs on (see the module docstring for why CPU, not CUDA).
SIM_DEVICE = "cpu"

#: Steps simulated: the first creates the optimizer states, the second runs with them in place.
SIM_STEPS = 2


@dataclass
class SimulationResult:
    """Memory of one simulated run of ``num_layers`` decoder layers."""

    num_layers: int
    tracker: TrackerResult
    total_params: int
    trainable_params: int
    workspace_bytes: int


def simulate(
    config_dict: dict[str, Any],
    spec: RunSpec,
    *,
    num_layers: int | None = None,
    workspace_allocs: tuple[int, ...] = (),
) -> SimulationResult:
    """Simulate ``SIM_STEPS`` training steps of the model in ``config_dict`` as ``spec`` configures it.

    ``num_layers`` cuts the model to that many decoder layers (for extrapolation); ``None`` keeps all.
    ``workspace_allocs`` are cuBLAS workspaces, allocated as ``runtime`` where CUDA allocates them:
    the first at the first forward matmul (Python thread), the next at the first backward
    (autograd's device thread has its own cuBLAS handle).
    """
    config = make_config(config_dict, num_layers=num_layers)
    config.use_cache = False
    dtype = DTYPES[spec.precision]
    with _quiet():
        model = prepare_for_method(build_meta_model(config, dtype), spec)

    tracker = MemoryTracker()
    with _fake_mode() as fake, tracker, CudaParityMode(tracker):
        model = materialize(model, SIM_DEVICE)
        model.train()
        tracker.mark_model(model)
        hooks = tracker.watch_gradients(model)
        total, trainable = count_parameters(model)
        optimizer = build_optimizer(model.parameters(), spec.optimizer)
        batch = _fake_batch(spec, config.vocab_size)
        # The step's own peak is what matters; building the model is not part of it.
        tracker.reset_peak()
        observer = _WorkspaceObserver(tracker, workspace_allocs)
        for _ in range(SIM_STEPS):
            micro_batches = [batch] * min(spec.grad_accum, 2)  # two show the steady state
            with _quiet():
                train_step(model, micro_batches, optimizer, observer=observer)
            tracker.mark_optimizer(optimizer)
        for h in hooks:
            h.remove()
        result = tracker.result()
        del fake
    del model, optimizer, batch, observer
    return SimulationResult(
        num_layers=config.num_hidden_layers,
        tracker=result,
        total_params=total,
        trainable_params=trainable,
        workspace_bytes=sum(workspace_allocs),
    )


class _WorkspaceObserver:
    """Passes the step's phases to the tracker and allocates cuBLAS workspaces when CUDA would."""

    def __init__(self, tracker: MemoryTracker, workspace_allocs: tuple[int, ...]) -> None:
        self.tracker = tracker
        self.pending = {"forward": list(workspace_allocs[:1]), "backward": list(workspace_allocs[1:])}
        self.workspaces: list[torch.Tensor] = []  # kept alive, as cuBLAS keeps them

    def on_phase(self, name: str) -> None:
        self.tracker.set_phase(name)
        for nbytes in self.pending.get(name, []):
            self.workspaces.append(self.tracker.allocate_runtime(nbytes, SIM_DEVICE))
        self.pending[name] = []


def _fake_batch(spec: RunSpec, vocab_size: int) -> dict[str, torch.Tensor]:
    shape = (spec.batch_size, spec.seq_len)
    input_ids = torch.zeros(shape, dtype=torch.long, device=SIM_DEVICE)
    # No attention mask: training batches are packed or padded to a common length, and without a
    # padding mask the attention is plain causal (is_causal=True), which is what flash kernels run.
    return {"input_ids": input_ids, "labels": input_ids.clone()}


@contextlib.contextmanager
def _fake_mode() -> Iterator[Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    restore = _prepare_bitsandbytes()
    try:
        # Meta parameters are turned into fake ones by to_empty inside the mode.
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            yield fake
    finally:
        restore()


def _prepare_bitsandbytes():
    """bitsandbytes caches a lookup table on first use; make it a real tensor before faking.

    Otherwise the cache would hold a fake tensor after the simulation (and creating it under fake
    mode fails, as it reads values). Returns a function that restores the cache as it was.
    """
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        return lambda: None
    with _quiet():
        import bitsandbytes.functional as bnbf
    saved = dict(bnbf.name2qmap)
    if "dynamic" not in bnbf.name2qmap:
        bnbf.name2qmap["dynamic"] = bnbf.create_dynamic_map().to("cpu")

    def restore() -> None:
        bnbf.name2qmap.clear()
        bnbf.name2qmap.update(saved)

    return restore


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence library warnings that mean nothing for a simulation (CPU kernels, meta init)."""
    import logging

    loggers = [logging.getLogger(name) for name in ("bitsandbytes", "transformers", "peft")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
