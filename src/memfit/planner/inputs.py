"""A plan's inputs resolved and validated: the model argument, every knob, the Target.

Two halves. :func:`resolve` is cheap (no transformers, no torch): it resolves the model to its
config, builds the :class:`~memfit.spec.RunSpec` and the :class:`~memfit.planner.target.Target`,
and collects what is wrong with each alone. :func:`checked` raises those first, on their own, then
runs the checks that need the model's architecture (transformers) and the knobs together. Inputs
that passed are remembered in the plan cache, so the next time they pass without transformers.
Every problem is a line naming the field, the value and the fix, all raised at once as one
:class:`~memfit.planner.errors.PlanError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.models.catalog import ModelSource, model_type_problem, resolve_model, seq_len_problem
from memfit.planner.errors import PlanError
from memfit.planner.exact.runtime import context_bytes_problem
from memfit.planner.target import Target, resolve_target
from memfit.spec import RunSpec, SpecError, make_spec


@dataclass
class Resolved:
    """The model, knobs and target resolved without transformers or torch, with the problems found so far."""

    knobs: dict[str, Any]
    source: ModelSource | None
    spec: RunSpec | None
    target: Target
    source_problems: list[str]
    spec_problems: list[str]
    target_problems: list[str]

    @property
    def has_problems(self) -> bool:
        return bool(self.source_problems or self.spec_problems or self.target_problems)

    @property
    def problems(self) -> list[str]:
        return self.source_problems + self.spec_problems + self.target_problems


def resolve(
    model: str | dict,
    *,
    revision: str | None = None,
    gpu: str | None = None,
    budget: str | int | None = None,
    target: Target | None = None,
    context_bytes: int | str | None = None,
    **knobs: Any,
) -> Resolved:
    """The cheap half of :func:`validate`: resolve the model (its config), the knobs and the target
    (``target``, or the one ``gpu`` / ``budget`` give), and collect what is wrong with each alone
    (and with ``context_bytes``, a plan's CUDA context given instead of the estimate).
    Imports neither transformers nor torch, but for a vision-language model planned without a
    ``seq_len`` (:func:`with_room_for_images`)."""
    if target is not None and (gpu is not None or budget is not None):
        raise TypeError("give a Target or gpu / budget, not both")
    source = spec = None
    source_problems: list[str] = []
    spec_problems: list[str] = []
    try:
        source = resolve_model(model, revision=revision)
    except ValueError as err:
        source_problems.append(f"model: {err}")
    try:
        spec = make_spec(**knobs)
    except SpecError as err:
        spec_problems.extend(err.problems)
    if source is not None and spec is not None and knobs.get("seq_len") is None:
        spec = with_room_for_images(source.config, spec, knobs)
    target_problems: list[str] = []
    if target is None:
        target, target_problems = resolve_target(gpu, budget)
    context_problem = context_bytes_problem(context_bytes)
    if context_problem:
        target_problems = target_problems + [context_problem]
    return Resolved(knobs, source, spec, target, source_problems, spec_problems, target_problems)


def checked(resolved: Resolved, cache: bool = True) -> tuple[ModelSource, RunSpec, Target]:
    """The other half of :func:`validate`: the checks that need the model's architecture (transformers)
    and the knobs together; raise one PlanError listing every problem.

    What the cheap half found (the model argument, a knob, the GPU, the budget) is raised first, on
    its own, before transformers or torch is imported: those mistakes are reported in a fraction of
    a second, and the checks that need the model's architecture run once they are fixed.

    Inputs that passed are remembered in the plan cache (``cache``): the checks depend on nothing but
    the model's config, the knobs and the code (all in the key), so the next time the same inputs
    pass without importing transformers.
    """
    if resolved.has_problems:
        raise PlanError(resolved.problems)
    from memfit.planner.shortcuts import cache as plan_cache

    key = validation_key(resolved) if cache else None
    if key is not None and plan_cache.load("validated", key) is True:
        return resolved.source, resolved.spec, resolved.target
    source, spec = resolved.source, resolved.spec
    problem = model_type_problem(source.config)
    # Nothing more can be checked against a model transformers cannot build.
    problems = [f"model: {problem}"] if problem else model_problems(source, spec)
    if problems:
        raise PlanError(problems)
    if key is not None:
        plan_cache.store("validated", key, True)
    return source, spec, resolved.target


def validate(
    model: str | dict,
    *,
    revision: str | None = None,
    gpu: str | None = None,
    budget: str | int | None = None,
    target: Target | None = None,
    **knobs: Any,
) -> tuple[ModelSource, RunSpec, Target]:
    """Check the model, every knob, the GPU and the budget (or ``target``); raise one PlanError
    listing all problems (those found without transformers first, on their own: see :func:`checked`)."""
    return checked(resolve(model, revision=revision, gpu=gpu, budget=budget, target=target, **knobs))


def quick_problems(
    model: str | dict,
    *,
    revision: str | None = None,
    gpu: str | None = None,
    budget: str | int | None = None,
    target: Target | None = None,
    **knobs: Any,
) -> list[str]:
    """The problems :func:`validate` finds without importing transformers or torch: the model
    argument, each knob alone and together, the GPU, the budget (a fraction of a second)."""
    return resolve(model, revision=revision, gpu=gpu, budget=budget, target=target, **knobs).problems


def validation_key(resolved: Resolved) -> str | None:
    """The cache key of what :func:`checked` checks (None when a cheap check failed already)."""
    from memfit.planner.shortcuts import cache as plan_cache

    if resolved.has_problems or not plan_cache.enabled():
        return None
    return plan_cache.make_key(
        "validated",
        {
            "model": {"name": resolved.source.name, "config": resolved.source.config},
            "spec": resolved.spec.model_dump(mode="json"),
        },
    )


def validation_state(
    model: str | dict,
    *,
    revision: str | None = None,
    gpu: str | None = None,
    budget: str | int | None = None,
    target: Target | None = None,
    **knobs: Any,
) -> str:
    """What is known of these inputs without importing transformers: ``"problems"`` (a check that
    needs no model failed: :func:`validate` will say which), ``"validated"`` (they passed
    :func:`validate` before, with this code and these libraries: the plan cache remembers it, and
    the plans to come may be there too), or ``"unknown"``."""
    from pathlib import Path

    from memfit.planner.shortcuts import cache as plan_cache

    if isinstance(model, str) and "/" in model and not Path(model).expanduser().exists():
        return "unknown"  # a Hub id: resolving it asks the Hub, which validate() is about to do anyway
    resolved = resolve(model, revision=revision, gpu=gpu, budget=budget, target=target, **knobs)
    if resolved.has_problems:
        return "problems"
    key = validation_key(resolved)
    return "validated" if key is not None and plan_cache.load("validated", key) is True else "unknown"


def model_problems(source: ModelSource, spec: RunSpec) -> list[str]:
    """Problems that need both the model and the knobs (cheap: the config only, no model build)."""
    from memfit.models.build import make_config
    from memfit.step.attention import batch_layout

    problems = []
    config = make_config(source.config)
    try:
        layout = batch_layout(spec, config)  # packing needs attention kept inside each example
    except ValueError as err:
        problems.append(str(err))
    else:
        problems.extend(p for p in sequence_parallel_problems(config, spec, layout) if p)
    too_long = seq_len_problem(source.name, source.config, spec.seq_len)
    if too_long:
        problems.append(too_long)
    targets = targets_problem(source.config, spec)
    if targets:
        problems.append(targets)
    problems.extend(
        p
        for p in (
            training_mode_problem(source.config, spec),
            quantized_base_problem(source.config, spec),
            vision_problem(source.config, spec),
        )
        if p
    )
    if spec.base_bits is not None or spec.optimizer in ("adamw8bit", "paged-adamw8bit"):
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:
            what = f"--method {spec.method}" if spec.base_bits is not None else f"--optimizer {spec.optimizer}"
            problems.append(f"{what} needs bitsandbytes, which is not installed: pip install 'memfit[qlora]'")
    if spec.gpus > 1:
        from memfit.planner.sharding import mode_problems

        problems.extend(mode_problems(spec.shard, spec.gpus, spec.optimizer))
    return problems


def vision_problem(config: dict[str, Any], spec: RunSpec, spelling: str = "flag") -> str | None:
    """Why a vision-language model cannot be planned with ``spec`` (None when it can, or for a text
    model): an objective other than sft, or more image tokens than ``seq_len`` holds."""
    from memfit.models.vision import is_vision_config

    if not is_vision_config(config):
        return None
    from memfit.spec import spell, spell_setting

    if spec.objective != "sft":
        return (
            f"{spell('objective', spelling)}: {spec.objective} is not planned for vision-language models; "
            f"use {spell_setting('objective', 'sft', spelling)}."
        )
    from memfit.models.build import make_config
    from memfit.models.vision import image_layout

    layout = image_layout(make_config(config), spec.image_max_pixels)
    needed = spec.images * layout.sequence_tokens + 1
    if needed <= spec.seq_len:
        return None
    most = max((spec.seq_len - 1) // layout.sequence_tokens, 0)
    return (
        f"{spell('images', spelling)}: {spec.images} image(s) of up to {spec.image_max_pixels:,} pixels take "
        f"{layout.tokens:,} image tokens each ({layout.sequence_tokens:,} with their markers), {needed - 1:,} in all, "
        f"more than {spell_setting('seq_len', spec.seq_len, spelling)} holds beside a token of text. Use "
        f"{spell_setting('seq_len', needed, spelling)} or more, {spell_setting('images', most, spelling)} or a smaller "
        f"{spell('image_max_pixels', spelling)}."
    )


def with_room_for_images(config: dict[str, Any], spec: RunSpec, knobs: dict[str, Any]) -> RunSpec:
    """``spec`` for a model planned without a ``seq_len``: a vision-language model's rows hold its
    images' tokens beside the default length of text (TRL leaves an image's tokens untruncated);
    a text model's spec as it is."""
    from memfit.models.vision import is_vision_config

    if not is_vision_config(config):
        return spec
    from memfit.models.build import make_config
    from memfit.models.vision import image_layout

    try:
        layout = image_layout(make_config(config), spec.image_max_pixels)
        return make_spec(**{**knobs, "seq_len": spec.seq_len + spec.images * layout.sequence_tokens})
    except (ValueError, SpecError):
        return spec  # an unknown family, or a length past a bound: the checks say which


def sequence_parallel_problems(config: Any, spec: RunSpec, layout: str) -> list[str | None]:
    """What ``--sequence-parallel`` asks of the model: heads that split over its ranks, rows it can cut."""
    from memfit.step.sequence_parallel import heads_problem, layout_problem

    return [layout_problem(layout, spec.sequence_parallel), heads_problem(config, spec.sequence_parallel)]


def training_mode_problem(config: dict[str, Any], spec: RunSpec) -> str | None:
    """Why the model's config cannot train at ``spec``'s precision as it stands (None when it can):
    xLSTM's ``mode: inference`` (its configs' default) runs kernels whose matmuls mix fp32 states
    with 16-bit weights, which fails in a training step with bf16 or fp16 weights."""
    mode = str(config.get("mode") or "inference")
    if config.get("model_type") != "xlstm" or "train" in mode or spec.weight_precision == "fp32":
        return None
    return (
        f'model: xlstm\'s "mode": "{mode}" runs xLSTM\'s inference kernels, which cannot train with '
        f'{spec.weight_precision} weights. Set "mode": "train" in the config (memfit train: model_overrides: '
        "{mode: train}), or use --precision fp32."
    )


#: model_type -> the linear layer its PyTorch path multiplies by its weight instead of calling it
#: (transformers' Mamba: ``dt_proj.weight @ ...``), which a 4-bit or 8-bit layer does not hold.
WEIGHT_READ_DIRECTLY = {"mamba": "dt_proj"}


def quantized_base_problem(config: dict[str, Any], spec: RunSpec) -> str | None:
    """Why the model cannot run on a quantized base (None when it can, or when the base is not quantized)."""
    layer = WEIGHT_READ_DIRECTLY.get(str(config.get("model_type")))
    if layer is None or spec.base_bits is None:
        return None
    return (
        f"--method {spec.method}: transformers' {config['model_type']} multiplies by its {layer} weight directly, "
        f"which a {spec.base_bits}-bit layer does not hold, so its step fails on a quantized base. Use --method lora "
        "or full."
    )


def targets_problem(config: dict[str, Any], spec: RunSpec, spelling: str = "flag") -> str | None:
    """Why LoRA ``targets`` or ``modules_to_save`` cannot apply to the model (a target that matches no
    linear layer of its decoder, adapters on expert weights with dropout or DoRA, a module to save
    that matches no module or that LoRA adapts), or
    None. One decoder layer of each kind is built on ``meta`` (no memory) and asked, as the trainer's
    :func:`memfit.step.prepare.check_targets` and :func:`~memfit.step.prepare.check_modules_to_save`
    ask the real model; ``spelling`` as for :func:`memfit.spec.make_spec`."""
    from memfit.spec import ALL_LINEAR

    # all-linear names nothing to check, unless it puts adapters on expert weights that take no dropout or DoRA
    if not spec.uses_adapters or (
        spec.targets == (ALL_LINEAR,) and not spec.modules_to_save and not spec.dropout and not spec.dora
    ):
        return None
    from memfit.models.build import DTYPES, build_meta_model, make_config
    from memfit.models.errors import ModelBuildError
    from memfit.models.layer_kinds import covering_layers
    from memfit.planner.exact.simulate import _quiet
    from memfit.step.prepare import check_modules_to_save, check_targets

    try:
        with _quiet():
            model = build_meta_model(make_config(config, layers=covering_layers(config)), DTYPES[spec.weight_precision])
    except ModelBuildError as err:
        return str(err)
    problems = []
    for check in (check_targets, check_modules_to_save):
        try:
            check(model, spec, spelling)
        except ModelBuildError as err:
            problems.append(str(err))
    return "; ".join(problems) or None
