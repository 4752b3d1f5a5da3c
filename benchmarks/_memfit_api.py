"""The memfit internals the benchmarks use, imported here and nowhere else.

memfit's modules move as the project is reorganised (the training step, loading and optimizers
are going to their own package); the benchmarks import memfit through this module only, so that a
move is one edit here. Public entry points (``memfit.plan``, ``memfit.fit``,
``memfit.train.recipe.train``) are used where they do the job. Every import sits inside the function
that needs it: importing this module costs nothing, and never imports torch.
"""

from __future__ import annotations

from typing import Any

# ------------------------------------------------------------------------------------------------
# Planning (public API)


def plan(model: str | dict, **knobs: Any):
    """``memfit.plan``: the planned peak of one training step (a MemoryPlan)."""
    import memfit

    return memfit.plan(model, **knobs)


def planner_module(name: str):
    """``memfit.planner``'s module ``name`` (``"exact.tracker"``), from this tree or from one laid out
    before the planner's exact/shortcuts/search packages (``memfit.planner.tracker``), so that
    before-and-after benchmarks run either."""
    import importlib

    try:
        return importlib.import_module(f"memfit.planner.{name}")
    except ImportError:
        old = {"search.core": "search", "search.run": "run", "search.report": "fit_report"}.get(
            name, name.split(".")[-1]
        )
        return importlib.import_module(f"memfit.planner.{old}")


def fit(model: str | dict, **options: Any):
    """``memfit fit``'s search (a FitResult); ``max_seq_len`` per method among its fields. ``memfit.fit``,
    or in a tree from before it, the search module's keyword ``fit``."""
    import memfit

    if hasattr(memfit, "fit"):
        return memfit.fit(model, **options)
    return planner_module("search.core").fit(model, **options)


def relative_cost(knobs: dict[str, Any]) -> float:
    """The planner's estimated time per token, in forward passes over the weights (see memfit.planner.throughput)."""
    from memfit.planner.throughput import relative_cost as _relative_cost

    return _relative_cost(knobs)


def planner_module_name() -> str:
    """The module a plan imports (with everything heavy it pulls in): its import time is a plan's
    cold start (``memfit.planner.simulate`` in trees from before the planner's exact/ package)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("memfit.planner.exact.simulate") is not None
    except ImportError:
        found = False
    return "memfit.planner.exact.simulate" if found else "memfit.planner.simulate"


def clear_plan_cache() -> None:
    """Forget everything the planner remembers, in this process and in the on-disk plan cache (so
    that a timed plan works everything out again): its memo (``memfit.planner.shortcuts.memo``), or
    in a tree from before it, the same stores where they were (simulations, series, depth plans,
    layouts, replay templates), so that before and after are timed alike."""
    try:
        memo = planner_module("shortcuts.memo")
    except ImportError:
        memo = None
    if memo is not None:
        memo.MEMO.clear()
        planner_module("shortcuts.cache").environment()  # the source digest again, untimed (the old trees keep theirs)
        return
    for module, names in (
        ("shortcuts.extrapolate", ("_SAMPLE_CACHE", "_SERIES_CACHE")),
        ("shortcuts.depths", ("_PLANS",)),
        ("layout", ("_LAYOUT_CACHE",)),
        ("exact.simulate", ("_REGION_TEMPLATES",)),
    ):
        try:
            found = planner_module(module)
        except ImportError:  # memfit from before that store
            continue
        for name in names:
            getattr(found, name, {}).clear()
    try:
        cache = planner_module("shortcuts.cache")
    except ImportError:  # memfit from before the on-disk cache
        return
    cache.clear()


# ------------------------------------------------------------------------------------------------
# Models, GPUs, knobs


def model_config(model: str | dict) -> dict[str, Any]:
    """The config.json dict of a catalog name, a config path or a config dict."""
    from memfit.models.catalog import resolve_model

    return resolve_model(model).config


def make_spec(**knobs: Any):
    """A validated RunSpec (raises memfit.spec.SpecError listing every problem)."""
    from memfit.spec import make_spec as _make_spec

    return _make_spec(**knobs)


def get_gpu(name: str):
    """The GPU catalog entry for a catalog name, an alias or a torch device name (ValueError if none)."""
    from memfit.models.gpus import get_gpu as _get_gpu

    return _get_gpu(name)


def gpu_key(device_name: str | None) -> str | None:
    """The catalog name of a torch device name ("NVIDIA H100 80GB HBM3" -> "h100-80gb"), or None."""
    if not device_name:
        return None
    try:
        return get_gpu(device_name).name
    except ValueError:
        return None


def make_hf_config(config_dict: dict[str, Any]):
    """A transformers config object built from a config.json dict."""
    from memfit.models.build import make_config

    return make_config(config_dict)


# ------------------------------------------------------------------------------------------------
# The real training step, as the trainer runs it


def resolve_device(name: str):
    """The trainer's device resolution: ``cuda`` means ``cuda:0`` (with an index, as tensors report
    their device) and becomes the current device; ``cpu`` stays the CPU."""
    from memfit.train.loading import resolve_device as _resolve_device

    return _resolve_device(name)


def load_model(config_dict: dict[str, Any], spec, device, *, init: str = "random", seed: int = 0):
    """memfit's loader: the model on ``device``, prepared for ``spec`` (a LoadedModel: .model, .config, .setup)."""
    from memfit.train.loading import load_model as _load_model

    return _load_model(config_dict, spec, device, init=init, seed=seed)


def build_optimizer(params, name: str, *, step_in_backward: bool = False, adamw_impl: str = "fused"):
    """The optimizer the trainer builds for ``--optimizer name`` (``adamw_impl``: the hf recipe's AdamW)."""
    from memfit.step.optim import build_optimizer as _build_optimizer

    return _build_optimizer(params, name, step_in_backward=step_in_backward, adamw_impl=adamw_impl)


def keep_reference(model, spec) -> None:
    """Full fine-tuning's DPO reference, a frozen copy of the model, kept as the trainer keeps it."""
    from memfit.step.preference import keep_reference_copy, needs_reference_copy

    if needs_reference_copy(spec):
        keep_reference_copy(model)


def training_step(spec, config_dict: dict[str, Any]):
    """The step the trainer runs for ``spec`` on this model (a TrainingStep: its loss, clipping,
    fp16 loss scaling and the layout of its micro-batches, as the planner plans it)."""
    from memfit.models.build import make_config
    from memfit.step.builder import build_step

    return build_step(spec, make_config(config_dict))


def step_batches(step, rows, device, count: int = 1, spec=None) -> list[dict[str, Any]]:
    """``count`` micro-batches of ``rows`` (lists of token ids, labels the same) made as the trainer
    makes them (the step's collate), on ``device``; a preference ``spec``'s are its longest pairs
    (the planner's, chosen and rejected of ``seq_len`` tokens each)."""
    from memfit.step.batch import to_device

    if spec is not None and spec.is_preference:
        from memfit.step.preference import longest_pairs

        examples = longest_pairs(spec, step.layout)
    else:
        examples = [{"input_ids": list(r), "labels": list(r)} for r in rows]
    return [to_device(step.collate(examples, 0), device) for _ in range(count)]


def train_step(model, micro_batches, optimizer, *, step, grad_scaler=None):
    """One optimizer step of memfit's trainer (``step``: a TrainingStep); returns (loss, grad_norm)."""
    return step(model, micro_batches, optimizer, grad_scaler=grad_scaler)


def memory_tracker():
    """The planner's tracker (a TorchDispatchMode counting every storage), for measuring on a CPU,
    with the rewrites the planner runs under, so that CPU kernels allocate what CUDA's would
    (:mod:`memfit.planner.exact.cuda_parity`): a CPU measurement then checks the plan's code path."""
    CudaParityMode = planner_module("exact.cuda_parity").CudaParityMode
    MemoryTracker = planner_module("exact.tracker").MemoryTracker

    class ParityTracker(MemoryTracker):
        def __enter__(self):
            super().__enter__()
            self._parity = CudaParityMode(self)
            self._parity.__enter__()
            return self

        def __exit__(self, *exc):
            self._parity.__exit__(*exc)
            return super().__exit__(*exc)

    return ParityTracker()


# ------------------------------------------------------------------------------------------------
# The trainer (public API) and its data


def train_config(settings: dict[str, Any]):
    """A validated TrainConfig from a dict of settings (raises memfit.train.config.ConfigError)."""
    from memfit.train.config import validate_config

    return validate_config(settings)


def train(config, **options: Any):
    """``memfit train`` as a function (a TrainResult)."""
    from memfit.train.recipe import train as _train

    return _train(config, **options)


def train_model_config(config) -> dict[str, Any]:
    """The model config dict a TrainConfig trains (catalog config plus its overrides)."""
    from memfit.train.config import model_config_dict

    return model_config_dict(config)


def train_tokenizer_path(config):
    """The tokenizer folder a TrainConfig uses."""
    from memfit.train.config import tokenizer_path

    return tokenizer_path(config)


def training_batches(config, tokenizer):
    """The trainer's examples and batch order for ``config``: (examples, BatchIterator)."""
    from memfit.train.data import BatchIterator, load_records, tokenize_records

    records, _ = load_records(config.data)
    examples = tokenize_records(records, tokenizer, seq_len=config.seq_len)
    return examples, BatchIterator(examples, batch_size=config.batch_size, seed=config.seed)


def collate(examples, pad_token_id: int):
    """Padded tensors with a padding mask where there is padding (what the Hugging Face side takes)."""
    from memfit.step.batch import collate as _collate

    return _collate(examples, pad_token_id)


# ------------------------------------------------------------------------------------------------
# What the planner assumes about a CUDA device


def runtime_assumptions(arch: str | None) -> dict[str, Any]:
    """The planner's runtime figures for a GPU architecture: CUDA context and cuBLAS workspaces."""
    runtime = planner_module("exact.runtime")

    overhead = runtime.runtime_overhead(arch)
    return {
        "cuda_context_bytes": overhead.context_bytes,
        "cublas_workspace_allocs_bytes": list(overhead.cublas_workspace_allocs),
        "cublas_workspace_bytes": overhead.cublas_workspace_bytes,
        "num_cublas_workspaces": runtime.DEFAULT_NUM_CUBLAS_WORKSPACES,
        "default_cuda_context_bytes": runtime.DEFAULT_CUDA_CONTEXT_BYTES,
    }


def format_bytes(nbytes: int) -> str:
    """memfit's short binary-unit form of a byte count (``512 B``, ``1.2 MiB``, ``23.5 GiB``)."""
    from memfit.units import format_bytes as _format_bytes

    return _format_bytes(int(nbytes))


def allocator_constants() -> dict[str, int]:
    """The caching-allocator constants the planner's allocator model uses."""
    allocator = planner_module("exact.allocator")

    return {
        "min_block_bytes": allocator.K_MIN_BLOCK_SIZE,
        "small_size_bytes": allocator.K_SMALL_SIZE,
        "small_segment_bytes": allocator.K_SMALL_BUFFER,
        "min_large_alloc_bytes": allocator.K_MIN_LARGE_ALLOC,
        "large_segment_bytes": allocator.K_LARGE_BUFFER,
        "round_large_bytes": allocator.K_ROUND_LARGE,
    }


def allocator_model(events: list[tuple[str, int, int]]):
    """Replay (kind, key, bytes) events through the planner's allocator model (peaks and traces)."""
    allocator = planner_module("exact.allocator")

    return allocator.simulate(events, record_trace=True)
