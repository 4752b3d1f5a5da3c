"""Run memfit's real training step under fake tensors and record its memory.

The model is built on ``meta`` and prepared exactly as the trainer prepares it (quantize, attach
adapters, enable checkpointing); inside ``FakeTensorMode`` it gets fake storage, and two full
training steps run (the second one with optimizer states in place) while a
:class:`~memfit.planner.exact.tracker.MemoryTracker` counts every byte. No GPU and no weights are needed.

The fake device is the CPU: there PyTorch's SDPA picks its flash-attention kernel, whose memory
(output plus log-sum-exp, no attention matrix) is that of CUDA's flash and memory-efficient
kernels. Where CPU kernels allocate differently from CUDA ones, :mod:`memfit.planner.exact.cuda_parity`
rewrites the op to what CUDA does.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.models.build import (
    DTYPES,
    build_meta_model,
    count_parameters,
    make_config,
    materialize,
)
from memfit.models.errors import ModelBuildError
from memfit.models.mixer_kernels import pytorch_mixers
from memfit.models.vision import language_config, vision_parts
from memfit.planner.exact.cuda_parity import (
    CudaParityMode,
    offload_parity,
    plan_bitsandbytes_optimizer,
    planned_grad_scaler,
)
from memfit.planner.exact.tracker import MemoryTracker, TrackerResult
from memfit.planner.exact.values import IntegerValues
from memfit.spec import RunSpec
from memfit.step import seam
from memfit.step.batch import PADDED
from memfit.step.builder import build_step
from memfit.step.offload import pinned_host_copies
from memfit.step.optim import build_optimizer
from memfit.step.preference import keep_reference_copy, longest_pairs, needs_reference_copy
from memfit.step.prepare import adapted_modules, place_for_training, prepare_for_method, trained_copies

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
    attention: str  # the attention implementation the model runs ("memfit_documents", "sdpa" or "eager")
    attention_kernels: tuple[str, ...] = ()  # the SDPA kernels CUDA would run ("flash", "math"...)
    batch_layout: str = "padded"  # the micro-batches' layout (memfit.step.batch: padded or documents)
    embeddings_on_host: bool = False  # frozen input embeddings kept in host memory
    trained_copies: tuple[dict, ...] = ()  # modules_to_save copies: the modules using each, its parameters
    adapted: tuple[str, ...] = ()  # short names of the modules carrying LoRA adapters
    #: With adapters: the trainable parameters on the experts and off them ("experts", "rest"), each
    #: their element count and bytes as the tracker counts them (MemoryTracker.state_bytes).
    adapter_bytes: dict[str, dict[str, int]] = field(default_factory=dict)


#: Makes the step's seam runner (:class:`memfit.step.seam.Runner`) for one simulation, from its
#: tracker, the probe of what the simulation notes outside memory (the attention kernels met: a set
#: that only grows), and whether micro-batches may be replayed (not when a loss scaler's first
#: scaling makes its scale): the shortcuts' replay (:meth:`memfit.planner.shortcuts.replay.Replay.bind`).
RunnerFactory = Callable[[MemoryTracker, Callable[[], frozenset], bool], seam.Runner]


def simulate(
    config_dict: dict[str, Any],
    spec: RunSpec,
    *,
    layers: tuple[int, ...] | None = None,
    workspace_allocs: tuple[int, ...] = (),
    fake: bool = True,
    arch: str | None = None,
    runner: RunnerFactory | None = None,
) -> SimulationResult:
    """Simulate ``SIM_STEPS`` training steps of the model in ``config_dict`` as ``spec`` configures it.

    ``layers`` cuts the model to copies of its decoder layers at those indices (None: all of them).
    ``workspace_allocs`` are cuBLAS workspaces, allocated as ``runtime`` where CUDA allocates them:
    the first at the first forward matmul (Python thread), the next at the first backward
    (autograd's device thread has its own cuBLAS handle).
    ``fake=False`` runs the same thing on real CPU tensors (random weights): tests use it to check
    that fake and real runs count the same bytes. ``arch``: the target GPU's architecture, which
    decides the attention kernel CUDA runs (None: Ampere or newer). ``runner``: what answers the
    step's seam for work on fake tensors (:data:`RunnerFactory`); None: every chunk, region and
    micro-batch runs.
    """
    config = make_config(config_dict, layers=layers)
    config.use_cache = False
    dtype = DTYPES[spec.weight_precision]
    step_fn = build_step(spec, config)
    # Everything the preparation makes goes on meta too: PEFT makes each adapter on the default
    # device and initialises it (real random numbers on the CPU) before moving it to its base
    # layer's device, meta here; made there at once, nothing is drawn.
    with _quiet(), bitsandbytes_only_if_used(spec), torch.device("meta"):
        model = prepare_for_method(build_meta_model(config, dtype), spec)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    attention = str(getattr(base.config, "_attn_implementation", None) or "eager")
    copies, adapted = tuple(trained_copies(model)), tuple(adapted_modules(model))

    tracker = MemoryTracker()
    parity = CudaParityMode(tracker, arch)
    with (
        _simulable(config),
        _bitsandbytes_tables() if _uses_bitsandbytes(spec) else contextlib.nullcontext(),
        _fake_mode() if fake else contextlib.nullcontext(),
        _packed_positions(spec.recipe == "hf" and spec.packing and step_fn.layout == PADDED),
        seam.values_kept() if step_fn.vision is not None else contextlib.nullcontext(),
        offload_parity(),
        pinned_host_copies(),
        # Work seen before may be replayed, not run (what it notes besides memory: the attention kernels met).
        seam.running(runner(tracker, lambda: parity.kernels, not step_fn.scales_loss))
        if runner
        else contextlib.nullcontext(),
        tracker,
        parity,
        # A vision-language forward reads its integer tensors' values (memfit.planner.exact.values).
        IntegerValues() if step_fn.vision is not None and fake else contextlib.nullcontext(),
    ):
        model = materialize(model, SIM_DEVICE, random_values=not fake)
        # Real CPU tensors cannot be pinned without an accelerator: say where the host copies go.
        with tracker.outside_device("host") if not fake else contextlib.nullcontext():
            embeddings_on_host = place_for_training(model, spec)
        model.train()
        if needs_reference_copy(spec):
            with _quiet():
                keep_reference_copy(model)  # full fine-tuning's DPO reference: a frozen copy, as the trainer keeps
        tracker.mark_model(model)
        hooks = tracker.watch_gradients(model)
        if step_fn.vision is not None:
            hooks += tracker.watch_vision(vision_parts(model).values())
        total, trainable = count_parameters(model)
        optimizer = build_optimizer(
            model.parameters(), spec.optimizer, step_in_backward=spec.step_in_backward, adamw_impl=spec.adamw_impl
        )
        for inner in getattr(optimizer, "inner_optimizers", [optimizer]):
            plan_bitsandbytes_optimizer(inner, tracker)
        observer, grad_scaler = _run_steps(model, spec, step_fn, optimizer, tracker, workspace_allocs, config)
        adapter_bytes = _adapter_bytes(model, optimizer, tracker) if spec.uses_adapters else {}
        for h in hooks:
            h.remove()
        result = tracker.result()
    del model, base, optimizer, observer, grad_scaler
    return SimulationResult(
        num_layers=language_config(config).num_hidden_layers,
        tracker=result,
        total_params=total,
        trainable_params=trainable,
        attention=attention,
        attention_kernels=tuple(sorted(parity.kernels)),
        batch_layout=step_fn.layout,
        embeddings_on_host=embeddings_on_host,
        trained_copies=copies,
        adapted=adapted,
        adapter_bytes=adapter_bytes,
    )


def _adapter_bytes(model, optimizer, tracker: MemoryTracker) -> dict[str, dict[str, int]]:
    """The trainable parameters' bytes, those on the experts apart from the rest: what the experts'
    adapters cost in weights, gradients and optimizer states, counted from the step's own tensors."""
    from memfit.models.experts import on_experts

    groups: dict[str, list] = {"experts": [], "rest": []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups["experts" if on_experts(name) else "rest"].append(p)
    return {group: tracker.state_bytes(params, optimizer) for group, params in groups.items()}


def _run_steps(
    model, spec: RunSpec, step_fn, optimizer, tracker: MemoryTracker, workspace_allocs: tuple[int, ...], config=None
):
    """``SIM_STEPS`` steps of ``step_fn`` on the longest examples, the tracker's peak reset first;
    the workspace observer (whose workspaces stay alive, as cuBLAS keeps them) and the grad scaler."""
    grad_scaler = planned_grad_scaler(step_fn, SIM_DEVICE)
    examples = _planned_examples(spec, step_fn.layout, config if step_fn.vision is not None else None)
    # The step's own peak is what matters; building the model is not part of it.
    tracker.reset_peak()
    observer = _WorkspaceObserver(tracker, workspace_allocs)
    for step in range(SIM_STEPS):
        # The trainer makes a step's grad_accum micro-batches up front and holds them through
        # the step; so does the plan. The first step only has to create the optimizer states;
        # in the last, two micro-batches show gradient accumulation's steady state (the second
        # runs with gradients held).
        held = [step_fn.collate(examples, 0) for _ in range(spec.grad_accum)]
        with _quiet():
            step_fn(
                model,
                held[: min(spec.grad_accum, 2) if step == SIM_STEPS - 1 else 1],
                optimizer,
                grad_scaler=grad_scaler,
                observer=observer,
            )
        del held
        tracker.mark_optimizer(optimizer)
    return observer, grad_scaler


class _WorkspaceObserver:
    """Passes the step's phases to the tracker and allocates cuBLAS workspaces when CUDA would."""

    def __init__(self, tracker: MemoryTracker, workspace_allocs: tuple[int, ...]) -> None:
        self.tracker = tracker
        self.pending = {"forward": list(workspace_allocs[:1]), "backward": list(workspace_allocs[1:])}
        self.workspaces: list[torch.Tensor] = []  # kept alive, as cuBLAS keeps them

    def on_phase(self, name: str) -> None:
        self.tracker.set_phase(name)
        # A reference pass runs the step's first matmuls on the Python thread, as a forward does.
        pending = "forward" if name == "reference" else name
        for nbytes in self.pending.get(pending, []):
            self.workspaces.append(self.tracker.allocate_runtime(nbytes, SIM_DEVICE))
        self.pending[pending] = []


def _planned_examples(spec: RunSpec, layout: str, vision_config=None) -> list[dict[str, Any]]:
    """A micro-batch of the longest examples the run takes: sequences, pairs, or grpo's completions;
    a vision-language model's sequences with ``spec.images`` images of the largest size each."""
    if vision_config is not None:
        from memfit.step.vision import planned_vision_example

        return [
            planned_vision_example(vision_config, example["input_ids"].shape[0], spec.images, spec.image_max_pixels)
            for example in _longest_examples(spec, layout)
        ]
    if spec.is_grpo:
        from memfit.step.grpo import longest_completions

        return longest_completions(spec, layout)
    return longest_pairs(spec, layout) if spec.is_preference else _longest_examples(spec, layout)


def _longest_examples(spec: RunSpec, layout: str) -> list[dict[str, Any]]:
    """A micro-batch of the longest examples the run takes: ``batch_size`` of ``seq_len`` tokens.

    Their token values do not matter (fake tensors have none). In padded batches the last one is a
    token shorter, so that the batch carries the padding mask a real padded batch carries (and the
    model the ``[batch, 1, seq, seq]`` mask it builds from it); one example alone is never padded,
    nor are packed rows, nor examples in one row.
    """
    import numpy as np

    lengths = [spec.seq_len] * spec.batch_size
    if layout == PADDED and spec.batch_size > 1 and not spec.packing:
        lengths[-1] -= 1
    examples = []
    for length in lengths:
        # Arrays rather than lists: the collate function reads them alike, and faster.
        ids = np.zeros(length, dtype=np.int64)
        example = {"input_ids": ids, "labels": ids}
        if spec.packing:  # a packed row: one example filling it
            example["position_ids"] = np.arange(length, dtype=np.int64)
        examples.append(example)
    return examples


@contextlib.contextmanager
def _simulable(config) -> Iterator[None]:
    """The model as fake tensors can run it: its sequence mixers on transformers' PyTorch path
    (mamba-ssm's, causal-conv1d's and fla's kernels do not run on fake tensors; the plan says so
    where the run would take them), and a step that needs tensor values to know its shapes (an op
    whose output size depends on the data, such as ``nonzero``) turned into a ModelBuildError."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        with pytorch_mixers(config):
            yield
    except (DynamicOutputShapeException, DataDependentOutputException) as err:
        op = getattr(err, "func", None) or str(err)
        raise ModelBuildError(
            f"memfit cannot plan {config.model_type}: its training step runs {op}, whose output shape depends on the "
            "tensors' values, which the planner's fake tensors do not have"
        ) from None


@contextlib.contextmanager
def _fake_mode() -> Iterator[Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Meta parameters are turned into fake ones by to_empty inside the mode.
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        yield fake


@contextlib.contextmanager
def _packed_positions(packed: bool) -> Iterator[None]:
    """Let transformers see, under fake tensors, what it sees on real ones about packed rows.

    transformers reads the values of ``position_ids`` to detect several sequences packed in one
    row, and then builds an explicit ``[batch, 1, seq, seq]`` mask. Fake tensors have no values, so
    the answer is given: rows are packed exactly when the plan is of packed rows the model masks
    itself (the ``hf`` recipe with packing; memfit's step keeps packed examples apart without any
    mask, :mod:`memfit.step.attention`). The check's own transients (a few ``[batch, seq]`` integer
    tensors, freed at once) are left out of the plan, on real tensors too, so that fake and real
    simulations stay comparable byte for byte.
    """
    from unittest import mock

    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - older transformers without this check
        yield
        return
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        yield
        return

    def answer(position_ids):
        return torch.zeros_like(position_ids) if packed else None

    with mock.patch.object(masking_utils, "find_packed_sequence_indices", answer):
        yield


def _uses_bitsandbytes(spec: RunSpec) -> bool:
    return spec.base_bits is not None or spec.optimizer in ("adamw8bit", "paged-adamw8bit")


#: Functions of the libraries memfit prepares models with that remember whether bitsandbytes is
#: installed (``functools.lru_cache``): (module, function). See :func:`bitsandbytes_only_if_used`.
_BITSANDBYTES_ANSWERS = (
    ("peft.import_utils", "is_bnb_available"),
    ("peft.import_utils", "is_bnb_4bit_available"),
    ("transformers.utils.import_utils", "is_bitsandbytes_available"),
)


@contextlib.contextmanager
def bitsandbytes_only_if_used(spec: RunSpec) -> Iterator[None]:
    """Prepare a model for a configuration that does not use bitsandbytes without importing it.

    Importing bitsandbytes costs about a second (it compiles kernels with ``torch.compile`` at
    import, which imports TorchInductor), and PEFT imports it whenever it is installed: at
    ``import peft`` (``peft.helpers``) and when it makes LoRA layers, to ask whether a layer is a
    bitsandbytes one. A model that is neither 4-bit nor trained with an 8-bit optimizer has no
    bitsandbytes layer (there can be none while bitsandbytes is not imported), so the answer is
    known: while such a model is prepared, and bitsandbytes has not been imported yet, it is made
    to look not installed (``sys.modules["bitsandbytes"] = None``: an import raises ImportError,
    ``importlib.util.find_spec`` answers None), and PEFT makes the plain LoRA layers it would make
    anyway. Afterwards it is installed again, and the answers PEFT and transformers cached meanwhile
    are forgotten, so that a QLoRA plan or an 8-bit optimizer later in the same process imports it
    and gets bitsandbytes' layers as usual. (``peft.helpers``, when first imported inside, keeps
    ``bnb = None``: only its SVD diagnostics use it, never memfit.)
    """
    if _uses_bitsandbytes(spec) or "bitsandbytes" in sys.modules:
        yield  # needed, or already paid for: nothing to save
        return
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None:
            del sys.modules["bitsandbytes"]
        for module_name, function_name in _BITSANDBYTES_ANSWERS:
            forget = getattr(getattr(sys.modules.get(module_name), function_name, None), "cache_clear", None)
            if forget is not None:
                forget()


@contextlib.contextmanager
def _bitsandbytes_tables() -> Iterator[None]:
    """Build bitsandbytes' cached lookup table before tracking, and restore the cache afterwards.

    bitsandbytes creates a quantization map on first use and keeps it in a module-level cache.
    Made under fake mode it would fail (it reads values) or leave a fake tensor in the cache; made
    under the tracker it would count as the step's memory. On CUDA it is one 1 KiB tensor.
    """
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        yield
        return
    from unittest import mock

    with _quiet():
        import bitsandbytes.functional as bnbf
        from bitsandbytes.optim.optimizer import Optimizer8bit
    saved = dict(bnbf.name2qmap)
    if "dynamic" not in bnbf.name2qmap:
        bnbf.name2qmap["dynamic"] = bnbf.create_dynamic_map().to("cpu")
    # The 8-bit optimizers build the same two maps in their constructor.
    signed, unsigned = bnbf.create_dynamic_map(signed=True), bnbf.create_dynamic_map(signed=False)

    def fill_qmap(optimizer) -> None:
        optimizer.name2qmap["dynamic"] = signed
        optimizer.name2qmap["udynamic"] = unsigned

    try:
        with mock.patch.object(Optimizer8bit, "fill_qmap", fill_qmap):
            yield
    finally:
        bnbf.name2qmap.clear()
        bnbf.name2qmap.update(saved)


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
