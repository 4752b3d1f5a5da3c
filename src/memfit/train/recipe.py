"""The training run, top to bottom, in named phases: data, configuration, model, optimizer, resume, reference, loop, outputs.

:func:`train` is the whole recipe. Each phase is a small function that takes the run's state
(:class:`_Run`) and returns what it made for the phases after it, the way torchtune's recipes name
their setup steps: :func:`_data`, :func:`_configuration` (the knobs, planned and checked before any
weight is read: :class:`~memfit.planner.search.run.RunPlanner`), :func:`_model` (with DPO's frozen
reference copy for full fine-tuning), :func:`_optimizer`, :func:`_resume`, :func:`_reference`
(``precompute_reference``: the reference log-probs of every pair, once, before training),
:func:`_loop`, :func:`_outputs`.

Each optimizer step is the :class:`~memfit.step.builder.TrainingStep` that
:func:`memfit.step.builder.build_step` makes for the configuration, the same one the planner
simulates, so the memory the plan predicted is the memory of this loop. Everything else is
bookkeeping around it, in modules of its own: the run folder (:mod:`~memfit.train.run_folder`),
progress and metrics (:mod:`~memfit.train.progress`), signals and out-of-memory
(:mod:`~memfit.train.guards`), data (:mod:`~memfit.train.examples`,
:mod:`~memfit.train.micro_batches`, :mod:`~memfit.train.evaluation`), checkpoints
(:mod:`~memfit.train.checkpointing`). One process and the ranks of a ``torchrun`` launch run the
same code: what differs is asked of the :mod:`world <memfit.train.world>`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from memfit.console import make_console
from memfit.models.build import make_config
from memfit.planner.search.run import SEARCHED, Preflight, RunPlanner, describe
from memfit.run_files import memory_file_name
from memfit.step.attention import restore_attention
from memfit.step.autocast import autocast_dtype
from memfit.step.builder import build_step
from memfit.step.grpo import summarize_metrics as summarize_grpo_metrics
from memfit.step.optim import build_optimizer
from memfit.step.preference import keep_reference_copy, needs_reference_copy, summarize_metrics
from memfit.step.prepare import lean_step_changes, prepare_given_model
from memfit.train.checkpointing import capture_rng, latest_checkpoint, restore_rng
from memfit.train.config import (
    TrainConfig,
    lr_factor,
    model_config_dict,
    total_steps,
    warmup_steps,
)
from memfit.train.disk_space import FULL_DISK_ERRNOS, after_full_disk, full_disk_message
from memfit.train.distributed import DistributedError, check_world
from memfit.train.errors import DiskFull, OutOfMemory, TrainError
from memfit.train.evaluation import evaluation_metrics
from memfit.train.examples import (
    RunData,
    check_vocab,
    load_run_processor,
    load_tokenizer,
    pad_token_id,
    prepare_data,
    seed_everything,
)
from memfit.train.fitting import fit_configuration, planned_seq_len, recorded_knobs, run_target
from memfit.train.generation import eval_generations
from memfit.train.guards import StopOnSignal, handle_oom
from memfit.train.hub_model import fetch_small_files, fetch_weights
from memfit.train.loading import load_model, verify_setup
from memfit.train.micro_batches import count_step_tokens
from memfit.train.preflight import preflight_run
from memfit.train.progress import LiveProgress, MetricsLog, NullLog, Throughput, end_of_run_metrics, warn
from memfit.train.reference import precompute_reference, reference_file
from memfit.train.rollouts import longest_sequence
from memfit.train.run_folder import RunRecord, finished_run, first_logged_loss, truncate_metrics
from memfit.train.world import make_world
from memfit.units import format_bytes
from memfit.watch.compare import comparison_lines
from memfit.watch.readings import step_peak_reading
from memfit.watch.recorder import MemoryRecorder

__all__ = ["OutOfMemory", "TrainError", "TrainResult", "train"]


@dataclass
class TrainResult:
    """How a run ended. ``status``: completed, interrupted (by SIGINT / SIGTERM: resumable), or
    finished (``resume`` on a run that had already completed: nothing was trained or written).
    ``signal_name``: the signal that stopped an interrupted run, or that reached a completed one
    during its last step or while its outputs were written (it completed all the same)."""

    status: str
    step: int
    total_steps: int
    run_dir: Path
    output_dir: Path | None = None
    checkpoint: Path | None = None
    signal_name: str | None = None
    losses: list[tuple[int, float]] = field(default_factory=list)
    #: (step, loss) where the run began: its first step's, also after a resume (from metrics.jsonl).
    first_loss: tuple[int, float] | None = None
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    setup: dict[str, Any] = field(default_factory=dict)
    tokens_per_second: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # a completed run's end-of-run record (train_runtime...)
    model: Any = field(default=None, repr=False)  # the trained model, still on its device


def train(
    config: TrainConfig,
    *,
    resume: bool = False,
    model: torch.nn.Module | None = None,
    console: Any = None,
    progress: bool = True,
    conformance_steps: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> TrainResult:
    """Train as ``config`` says and return how it ended.

    Args:
        config: a validated :class:`~memfit.train.config.TrainConfig` (see :func:`load_config`).
        resume: continue from the latest checkpoint in ``config.output_dir``; the result is the
            same as if the run had never stopped (model, optimizer, schedule, RNG, data order).
        model: use this model instead of loading ``config.model`` (a transformers PreTrainedModel
            or a PeftModel, already on its device; custom wrappers are refused, see
            :func:`memfit.step.prepare.refuse_wrapped_model`).
        console: a Rich console for the progress bar and messages (default: stderr).
        progress: show the live progress bar.
        conformance_steps: on the CPU, measure this many steps as the planner counts (its CUDA-parity
            rewrites), for comparing a run with its plan byte for byte (:mod:`memfit.train.conformance`).
        clock: seconds, for ``elapsed_s`` and the end-of-run ``train_runtime`` (``time.perf_counter``;
            a test gives its own).

    Raises:
        TrainError: the output folder holds another run, the data or model do not fit, or the device
            ran out of memory (:class:`OutOfMemory`, after saving a checkpoint).
        PreflightError: the plan says the run does not fit the GPU or budget (``force`` overrides).

    With ``gpus`` > 1 every process torchrun started calls this; the process group is joined here
    (and left at the end) unless the caller joined it already.
    """
    if resume:
        run_dir = Path(config.output_dir or "runs/train")
        done = finished_run(run_dir, config)
        if done is not None:  # nothing left to train: the checkpoints and the output stay as they are
            return TrainResult(
                status="finished",
                step=done["step"],
                total_steps=done["total_steps"],
                run_dir=run_dir,
                output_dir=done["output_dir"],
            )
    try:
        world = make_world()
        check_world(config.spec.gpus, config.spec.shard, world.placement)
    except DistributedError as err:
        raise TrainError(str(err)) from None
    try:
        return _run(
            config,
            world,
            resume=resume,
            model=model,
            console=console,
            progress=progress,
            conformance_steps=conformance_steps,
            clock=clock,
        )
    except OSError as err:
        world.discard_run_dir()
        run_dir = Path(config.output_dir or "runs/train")
        # A write to an open file (metrics, memory) names none; run.json, written whole, names itself.
        if err.errno in FULL_DISK_ERRNOS and (err.filename is None or _within(Path(str(err.filename)), run_dir)):
            then = after_full_disk(run_dir, latest_checkpoint(run_dir) if run_dir.is_dir() else None)
            raise DiskFull(full_disk_message(run_dir, "the run's files", None, then)) from None
        raise
    except BaseException:
        world.discard_run_dir()  # a run that failed before writing anything leaves no empty folder
        raise
    finally:
        world.leave()


def _within(path: Path, folder: Path) -> bool:
    """Whether ``path`` is in ``folder`` (or is it)."""
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


# ------------------------------------------------------------------------------------------------
# The run's state


@dataclass
class _Data:
    """What the data phase made: the model's config (overrides included), the tokenizer, the
    examples (or the stream) and the padding id."""

    model_config: dict[str, Any]
    tokenizer: Any
    prepared: RunData
    pad_id: int
    rewards: list = field(default_factory=list)  # grpo: the reward functions, loaded and checked
    processor: Any = None  # a vision-language model's processor (saved with the deliverable)


@dataclass
class _Configuration:
    """What the configuration phase decided before any weight was read, and what a step down after
    running out of memory changes while the run goes on (``config``, ``step_fn``, ``planned_len``,
    ``plan``)."""

    config: TrainConfig  # the configuration in effect: as given, resumed, fitted or stepped down
    step_fn: Any  # the step it runs (wrapped for the world once the model is sharded)
    planner: RunPlanner  # the run's model against the run's one Target
    given: dict[str, Any]  # the searched knobs the config gave at the start
    fit_record: dict[str, Any] | None  # fit: auto's choice and why
    longest_len: int  # the data's longest example (the length a search over micro-batch sizes plans)
    planned_len: int  # the data's longest micro-batch at this configuration's micro-batch size
    preflight: Preflight
    plan: Any = None  # the plan of the configuration in effect (None: not planned)


@dataclass
class _Training:
    """What the optimizer phase made: the optimizer, its schedule, the loss scaler, the data order."""

    optimizer: torch.optim.Optimizer
    scheduler: Any
    grad_scaler: Any
    batches: Any  # BatchIterator, or a stream's batches
    steps: int


@dataclass
class _Run:
    """The run's state: where it runs, then what each phase made (filled in by :func:`_run`)."""

    world: Any
    device: torch.device
    run_dir: Path
    console: Any
    progress: bool
    resume: bool
    start_config: TrainConfig  # as loaded, the Hub model's files fetched
    hub: Any = None
    conformance_steps: int | None = None
    data: _Data | None = None
    configuration: _Configuration | None = None
    model: Any = None
    setup: dict[str, Any] = field(default_factory=dict)
    training: _Training | None = None
    record: RunRecord | None = None
    clock: Callable[[], float] = time.perf_counter
    # The sum of the step losses from the run's first step (across resumes: checkpoints keep it), for
    # the end-of-run train_loss; None when a checkpoint written without it was resumed.
    loss_sum: float | None = 0.0

    @property
    def config(self) -> TrainConfig:
        return self.configuration.config if self.configuration is not None else self.start_config

    @property
    def spec(self):
        return self.config.spec

    def collate(self, examples: list) -> dict[str, Any]:
        return self.configuration.step_fn.collate(examples, self.data.pad_id)

    def write_generations(self, log, step: int) -> None:
        """The greedy replies to ``eval_prompts`` at ``step``, one ``metrics.jsonl`` record (none without prompts)."""
        if self.config.eval_prompts:
            log.write(
                eval_generations(
                    self.model,
                    self.data.tokenizer,
                    self.config.eval_prompts,
                    step=step,
                    max_new_tokens=self.config.eval_max_new_tokens,
                    device=self.device,
                )
            )

    def checkpoint_now(self, step: int, reason: str, data_state=None, rng_state=None) -> Path:
        """A checkpoint of the run at ``step`` (the data position and RNG now, unless given)."""
        training = self.training
        data = data_state if data_state is not None else training.batches.state_dict()
        # Examples per optimizer step: a resume may cut them into other micro-batches, never other steps.
        data = {
            **data,
            "examples_per_step": data["batch_size"] * self.record.fields["active_knobs"]["grad_accum"],
            "train_loss_sum": self.loss_sum,
        }
        return self.world.save_checkpoint(
            self.run_dir,
            step,
            model=self.model,
            optimizer=training.optimizer,
            scheduler=training.scheduler,
            grad_scaler=training.grad_scaler,
            data_state=data,
            rng_state=rng_state if rng_state is not None else capture_rng(self.device),
            reason=reason,
            keep=self.config.keep_checkpoints,
        )


# ------------------------------------------------------------------------------------------------
# The phases


def _run(
    config: TrainConfig,
    world,
    *,
    resume: bool,
    model,
    console,
    progress: bool,
    conformance_steps: int | None,
    clock: Callable[[], float],
) -> TrainResult:
    run = _start(config, world, resume=resume, model=model, console=console, progress=progress)
    run.conformance_steps, run.clock = conformance_steps, clock
    run.data = _data(run)
    run.configuration = _configuration(run)
    run.model, run.setup, run.configuration.step_fn = _model(run, model)
    run.training = _optimizer(run)
    start_step, checkpoint = _resume(run)
    run.record = _record(run, start_step)
    _reference(run, may_compute=checkpoint is None)
    result = TrainResult(
        status="completed",
        step=start_step,
        total_steps=run.training.steps,
        run_dir=run.run_dir,
        setup=run.setup,
        model=run.model,
    )
    _loop_and_outputs(run, result)
    result.first_loss = first_logged_loss(run.run_dir) if start_step else (result.losses[0] if result.losses else None)
    run.record.write(
        status=result.status,
        step=result.step,
        tokens_per_second=result.tokens_per_second,
        peak=step_peak_reading(run.device),
    )
    return result


def _start(config: TrainConfig, world, *, resume: bool, model, console, progress: bool) -> _Run:
    """Where the run runs: its console (rank 0 speaks), device and run folder; a Hub model's small
    files (config, tokenizer, the weights index) fetched now, its weights once the run is known to fit
    and the data is read (:mod:`memfit.train.hub_model`)."""
    if not world.is_main:  # one voice: rank 0 prints
        console, progress = Console(stderr=True, quiet=True), False
    console = console or make_console(stderr=True)
    run_dir = Path(config.output_dir or "runs/train")
    device = world.join(config.device, model)
    _warn_slow_on_cpu(config, device, console)
    for leftover in world.prepare_run_dir(run_dir, resume):
        console.print(f"removed {leftover}: the temporary folder of a save that was interrupted", highlight=False)
    config, hub = fetch_small_files(config, world=world, console=console, resume=resume, run_dir=run_dir)
    return _Run(
        world=world,
        device=device,
        run_dir=run_dir,
        console=console,
        progress=progress,
        resume=resume,
        start_config=config,
        hub=hub,
    )


def _data(run: _Run) -> _Data:
    """Data: tokenized up front (a stream: its first rows), so that a bad file or dataset fails
    before anything is planned or loaded."""
    config = run.start_config
    model_dict = model_config_dict(config)
    seed_everything(config.seed)
    processor = load_run_processor(config)  # a vision-language model's; None for a text model
    tokenizer = processor.tokenizer if processor is not None else load_tokenizer(config)
    data = prepare_data(
        config, tokenizer, console=run.console, resume_from=run.run_dir if run.resume else None, processor=processor
    )
    if data.pair_stats is not None:
        run.console.print(f"data: {data.pair_stats.summary(config.seq_len)}", highlight=False)
    if data.prompt_stats is not None:
        run.console.print(f"data: {data.prompt_stats.summary()}", highlight=False)
    check_vocab(data.checked_examples, int(model_dict.get("vocab_size") or 0), tokenizer)
    rewards = _rewards(config, data) if config.spec.is_grpo else []
    return _Data(
        model_config=model_dict,
        tokenizer=tokenizer,
        prepared=data,
        pad_id=pad_token_id(tokenizer),
        rewards=rewards,
        processor=processor,
    )


def _rewards(config: TrainConfig, data: RunData) -> list:
    """grpo's reward functions, loaded and called once on the first prompt: one that cannot be
    loaded, raises or returns what is not one number a completion fails before any weight is read."""
    from memfit.train.rewards import check_rewards, load_rewards

    rewards = load_rewards(config.reward_funcs, config.reward_weights)
    check_rewards(rewards, data.train_examples[0])
    return rewards


def _configuration(run: _Run) -> _Configuration:
    """The configuration, and whether it fits: decided before any weight is read. A resumed run keeps
    the configuration it was training with; fit: auto chooses the knobs left open; preflight checks
    the result against the run's Target (read once: :func:`memfit.train.fitting.run_target`)."""
    config, console, model_dict = run.start_config, run.console, run.data.model_config
    given = {k: config.spec.knobs()[k] for k in SEARCHED}
    kept, first_given = recorded_knobs(run.run_dir) if run.resume else (None, None)
    if kept is not None and first_given not in (None, given):
        kept = None  # the config was changed on purpose since the run began: it wins
        console.print(
            f"resuming with the config's {describe(given)}, not the run's {describe(first_given)}", highlight=False
        )
    elif kept is not None and kept != given:
        config = config.model_copy(update=kept)
        console.print(f"resuming with the configuration the run was training with: {describe(kept)}", highlight=False)
    given = first_given or given
    try:
        # The step this configuration runs (its loss, clipping, batch layout), settled before any work.
        step_fn = build_step(config.spec, make_config(model_dict), config.objective_params)
    except ValueError as err:
        raise TrainError(str(err)) from None
    examples = run.data.prepared.train_examples  # a stream's are not known: plan at seq_len

    def length_for(batch_size: int) -> int:
        if config.spec.is_grpo:  # completions are not known before they are generated: the longest is planned
            return config.seq_len
        return planned_seq_len(examples, batch_size, config.seq_len, step_fn.layout, config.packing)

    # A search over micro-batch sizes plans every candidate at the longest single example: no
    # micro-batch of the data has longer examples (on average) than that, whatever its size.
    longest_len = length_for(1)
    planner = RunPlanner(model_dict, run_target(config, run.device))
    fit_record = None
    if config.fit == "auto" and kept is None and not run.resume:
        config, fit_record = fit_configuration(config, planner, longest_len, console)
        step_fn = build_step(config.spec, make_config(model_dict), config.objective_params)
    planned_len = length_for(config.batch_size)
    preflight = preflight_run(config, planner, console, seq_len=planned_len, fit_seq_len=longest_len)
    return _Configuration(
        config=config,
        step_fn=step_fn,
        planner=planner,
        given=given,
        fit_record=fit_record,
        longest_len=longest_len,
        planned_len=planned_len,
        preflight=preflight,
        plan=preflight.plan,
    )


def _model(run: _Run, model) -> tuple[Any, dict[str, Any], Any]:
    """Model: meta -> weights on the device -> adapters -> the memory-lean step, then checked; then
    sharded (several processes). The model, its setup, and the step this configuration runs as the
    world runs it."""
    config, spec, world, device = run.config, run.spec, run.world, run.device
    if model is None:
        weights = config.model if config.init == "pretrained" else None
        if run.hub is not None and weights is not None:
            weights = fetch_weights(config, run.hub, world=world, console=run.console, progress=run.progress)
        loaded = load_model(
            run.data.model_config,
            spec,
            world.load_device(spec, device),
            init=config.init,
            weights_dir=weights,
            seed=config.seed,
        )
        model, setup = loaded.model, loaded.setup
    else:
        model = prepare_given_model(model, spec)
        setup = verify_setup(model, spec)
    where = f"{world.world_size} processes ({spec.shard}), one on {device} each" if world.distributed else str(device)
    run.console.print(
        f"model: {setup['total_params']:,} parameters, {setup['trainable_params']:,} trainable "
        f"({setup['trainable_percent']:.2f}%, {spec.method}), checkpointing in "
        f"{setup['checkpointed_layers']}/{setup['decoder_layers']} decoder layers, on {where}",
        highlight=False,
    )
    if needs_reference_copy(spec):
        # The reference of full fine-tuning (DPO, grpo with beta): the starting weights, kept before any update.
        keep_reference_copy(model)
        keeps_none = "beta: 0 keeps none" if spec.is_grpo else "precompute_reference: true keeps none"
        run.console.print(
            f"reference: a frozen copy of the model's {setup['total_params']:,} parameters "
            f"({spec.objective}, full fine-tuning; {keeps_none})",
            highlight=False,
        )
    model = world.shard(model, spec, device, run.console)
    return model, setup, world.training_step(run.configuration.step_fn, model)


def _optimizer(run: _Run) -> _Training:
    """Optimizer, schedule, data order and the loss scaler fp16 needs."""
    config, spec = run.config, run.spec
    optimizer = build_optimizer(
        run.model.parameters(),
        spec.optimizer,
        lr=config.lr,
        weight_decay=config.weight_decay,
        step_in_backward=spec.step_in_backward,
    )
    if spec.is_grpo:
        batches = _completion_batches(run)
    else:
        batches = run.data.prepared.batches(run.world.global_batch_size(spec), config, run.data.tokenizer.eos_token_id)
    steps = total_steps(config, batches.batches_per_epoch())
    warmup = warmup_steps(config, steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(s, total=steps, warmup=warmup, schedule=config.schedule, min_ratio=config.min_lr_ratio),
    )
    return _Training(
        optimizer=optimizer,
        scheduler=scheduler,
        grad_scaler=run.configuration.step_fn.grad_scaler(run.device),
        batches=batches,
        steps=steps,
    )


def _completion_batches(run: _Run):
    """grpo's batch order: its prompts in the data's seeded order, each step's completions generated
    and scored before the step (:mod:`memfit.train.rollouts`)."""
    from memfit.step.rollout import Sampling
    from memfit.train.data import BatchIterator
    from memfit.train.generation import stop_token_ids
    from memfit.train.rollouts import CompletionBatches, Rollout, prompts_per_step

    config, spec = run.config, run.spec
    rollout = Rollout(
        sampling=Sampling.of(spec),
        rewards=run.data.rewards,
        scale_rewards=config.objective_params.scale_rewards,
        num_iterations=spec.num_iterations,
        tokenizer=run.data.tokenizer,
        step=run.configuration.step_fn,
        pad_id=run.data.pad_id,
        eos_ids=stop_token_ids(run.model, run.data.tokenizer),
        micro_batch=spec.batch_size,
    )
    order = BatchIterator(run.data.prepared.train_examples, batch_size=prompts_per_step(spec), seed=config.seed)
    return CompletionBatches(
        order=order,
        rollout=rollout,
        batch_size=spec.batch_size,
        num_iterations=spec.num_iterations,
        grad_accum=spec.grad_accum,
    )


def _resume(run: _Run) -> tuple[int, Path | None]:
    """Resume: tensors and optimizer now, RNG and data position right before the next step. The step
    to start from (0 for a new run) and the checkpoint it was read from (None for a new run, or one
    that stopped in its reference pass, before its first step: :func:`_resume_checkpoint`)."""
    run_dir, console, training = run.run_dir, run.console, run.training
    checkpoint = _resume_checkpoint(run_dir, run.spec, console) if run.resume else None
    if checkpoint is None:
        return 0, None
    try:
        state = run.world.load_checkpoint(
            checkpoint,
            model=run.model,
            optimizer=training.optimizer,
            scheduler=training.scheduler,
            grad_scaler=training.grad_scaler,
            device=run.device,
        )
        per_step = run.world.global_batch_size(run.spec) * run.spec.grad_accum
        training.batches.load_state_dict(state.data, rebatch=state.data.get("examples_per_step") == per_step)
    except ValueError as err:  # CheckpointError, or data / batch settings that changed
        raise TrainError(f"--resume from {checkpoint}: {err}") from None
    restore_rng(state.rng, run.device)
    run.loss_sum = state.data.get("train_loss_sum")
    if run.world.is_main:
        truncate_metrics(run_dir, state.step)
    console.print(f"resuming from {checkpoint} (step {state.step} of {training.steps})", highlight=False)
    return state.step, checkpoint


def _record(run: _Run, start_step: int) -> RunRecord:
    """The run's ``run.json``, written now: the checkpoints written from here on say how many
    examples a step takes (see :meth:`_Run.checkpoint_now`)."""
    configuration, spec, pair_stats = run.configuration, run.spec, run.data.prepared.pair_stats
    extra = {
        **run.world.run_fields(spec),
        **({"hub": run.hub.record()} if run.hub is not None else {}),
        "data": run.data.prepared.record,
        "planned_seq_len": configuration.planned_len,
        "fit": configuration.fit_record,
        **({"pairs": pair_stats.to_dict()} if pair_stats is not None else {}),
        **({"prompts": run.data.prepared.prompt_stats.to_dict()} if run.data.prepared.prompt_stats is not None else {}),
        "active_knobs": {k: spec.knobs()[k] for k in SEARCHED},
        "given_knobs": configuration.given,
        "config_changes": _recorded_changes(run.run_dir) if run.resume else [],
    }
    record = RunRecord.for_run(
        run.run_dir,
        config=run.config,
        model_config=run.data.model_config,
        preflight=configuration.preflight,
        setup=run.setup,
        device=run.device,
        total_steps=run.training.steps,
        enabled=run.world.is_main,
        extra=extra,
    )
    record.write(status="running", step=start_step)
    return record


def _reference(run: _Run, *, may_compute: bool) -> None:
    """Reference: DPO's reference log-probs of every pair, computed once before training where the
    run says ``precompute_reference`` (:mod:`memfit.train.reference`). Run once ``run.json`` is
    written, so that a pass that stops part way is continued by ``--resume``; ``may_compute`` is
    False for a run resumed from a checkpoint (its weights have moved: the log-probs must be stored)."""
    spec = run.spec
    if spec.reference != "precomputed":
        return
    dtype = autocast_dtype(spec)
    for split, pairs in (("train", run.data.prepared.train_examples), ("eval", run.data.prepared.eval_examples)):
        if pairs:
            precompute_reference(
                pairs,
                split=split,
                run_dir=run.run_dir,
                model=run.model,
                collate=run.collate,
                batch_size=spec.batch_size,
                device=run.device,
                adapters=spec.uses_adapters,
                dtype=dtype,
                may_compute=may_compute,
                world=run.world,
                say=lambda line: run.console.print(line, highlight=False),
            )


# ------------------------------------------------------------------------------------------------
# The loop, then the outputs


def _loop_and_outputs(run: _Run, result: TrainResult) -> None:
    """The loop (:func:`_loop`), then the outputs (:func:`_outputs`) once it completed (a signal
    during the last step included: that step is done). A signal stops the run after the step it
    arrives in; from then on until the outputs are written it only asks, so the last checkpoint and
    the deliverable are never cut short. A full disk is recorded in ``run.json``."""
    try:
        with StopOnSignal() as stop:
            _loop(run, result, stop)
            _outputs(run, result, stop)
    except DiskFull:
        with contextlib.suppress(OSError):  # a few hundred bytes: there is room once the failed save is gone
            run.record.write(status="disk_full", step=result.step)
        raise


def _outputs(run: _Run, result: TrainResult, stop: StopOnSignal) -> None:
    """The deliverable of a completed run (the adapter or the model, with the tokenizer), with the
    trained model's own attention back (document attention is for training rows)."""
    restore_attention(run.model)
    if result.status == "completed":
        result.output_dir = run.world.save_outputs(
            run.model, run.data.processor or run.data.tokenizer, result.run_dir, run.spec.uses_adapters
        )
        result.signal_name = stop.signal_name  # arrived once there was nothing left to stop


@dataclass
class _Taken:
    """One optimizer step taken: its loss, tokens and gradient norm (totals over the ranks), the lr it
    used, and whether the run is asked to stop after it."""

    loss: float
    tokens: int
    grad_norm: float | None
    lr: float
    stopping: bool
    pair_metrics: list = field(default_factory=list)  # a preference step's summed rewards and log-probs, on the device
    samples: int = 0  # the examples (pairs, packed rows) the step trained on, over every process
    rollout_metrics: dict = field(default_factory=dict)  # grpo: the rewards and lengths of the completions trained on
    longest: int | None = None  # grpo: the step's longest prompt and completion, in tokens


def _loop(run: _Run, result: TrainResult, stop: StopOnSignal) -> None:
    """The optimizer steps from ``result.step`` to the end, watched: memory is recorded every step
    (``memory.jsonl``) and checked for leaks, stray devices and switched-off optimizations. A step that
    runs out of memory is taken again one configuration down (:func:`_step_down`), where it can be.
    A signal (``stop``) ends the run after its step with an ``interrupt`` checkpoint, unless that step
    was the last: then the run completes, without its final evaluation. A completed run ends
    ``metrics.jsonl`` with the Trainer's end-of-run record (:func:`_end_of_run`)."""
    steps = result.total_steps
    recorder = _memory_recorder(run, result)
    meter = Throughput()
    started = run.clock()
    session = _Session()
    # One voice: rank 0 writes metrics.jsonl and reports to the trackers, with what run.json holds.
    metrics_log = (
        MetricsLog(result.run_dir, report_to=run.config.report_to, run_config=run.record.fields, console=run.console)
        if run.world.is_main
        else NullLog()
    )
    stopping = False  # asked to stop by the end of the last step (several processes: as they all agreed at its end)
    with recorder, metrics_log as log, LiveProgress(run.console, steps, result.step, enabled=run.progress) as bar:
        log.epoch = _epoch(run, result.step, steps)
        while result.step < steps:
            taken = _step(run, result.step, recorder, meter, stop)
            if taken is None:
                continue  # the same step again, one configuration down, on the same examples
            stopping = taken.stopping
            session.steps, session.samples = session.steps + 1, session.samples + taken.samples
            _after_step(run, result, taken, recorder, log, bar, meter, started)
            if stopping and result.step < steps:
                result.checkpoint = run.checkpoint_now(result.step, "interrupt")
                result.status, result.signal_name = "interrupted", stop.signal_name
                break
        if result.status == "completed":
            _final_evaluation(run, result, log, stop.signal_name if stopping else None)
            result.checkpoint = run.checkpoint_now(result.step, "final")
            result.metrics = _end_of_run(run, result, session, log, started)
        for finding in recorder.close(status=result.status):
            warn(run.console, finding)
    for line in comparison_lines(recorder.comparison()):
        run.console.print(line, highlight=False)
    result.tokens_per_second = meter.overall_rate()


def _memory_recorder(run: _Run, result: TrainResult) -> MemoryRecorder:
    """What watches the loop's memory, compared with the plan of the configuration in effect; the
    model inspected for what the plan assumed, memory attributed where the world can."""
    world, spec, model, device = run.world, run.spec, run.model, run.device
    recorder = MemoryRecorder(
        result.run_dir,
        plan=run.configuration.preflight.plan,
        expected_device=device,
        total_steps=result.total_steps,
        spec=spec,
        source="memfit-train",
        resumed_from_step=result.step or None,
        file_name=memory_file_name(world.rank),
        rank=world.recorder_rank,
    )
    for finding in recorder.inspect(model, spec):
        warn(run.console, finding)
    if run.conformance_steps is not None:
        recorder.attribute(model, run.training.optimizer, steps=run.conformance_steps, cuda_parity=True)
    elif world.attributes_memory:
        recorder.attribute(model, run.training.optimizer)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return recorder


def _step(run: _Run, step: int, recorder: MemoryRecorder, meter: Throughput, stop: StopOnSignal) -> _Taken | None:
    """Optimizer step ``step`` (0-based), or None when it ran out of memory and the run stepped down
    to take it again; an out-of-memory error that cannot be stepped down from ends the run."""
    world, device, training = run.world, run.device, run.training
    # Where the run stands before this step: an emergency checkpoint taken if the step fails
    # must replay this step's batches, not skip them.
    data_before, rng_before = training.batches.state_dict(), capture_rng(device)
    meter.start()
    # grpo: the step's completions, generated and scored now (a phase of the step's memory).
    before_step = getattr(training.batches, "before_step", None)
    rollout_metrics = before_step(run.model, device, recorder.observer) if before_step is not None else {}
    handed_out = training.batches.handed_out
    micro_batches = world.micro_batches(training.batches, run.spec.grad_accum, run.collate, device)
    samples = training.batches.handed_out - handed_out
    tokens = count_step_tokens(micro_batches)
    longest = longest_sequence(micro_batches) if run.spec.is_grpo else None
    pair_metrics: list = []  # a preference step's per-pair rewards and log-probs (grpo's: its loss metrics)
    try:
        loss, grad_norm = run.configuration.step_fn(
            run.model,
            micro_batches,
            training.optimizer,
            grad_scaler=training.grad_scaler,
            observer=recorder.observer,
            metrics=pair_metrics,
        )
    except torch.OutOfMemoryError:
        del micro_batches
        if _step_down(run, step, data_before, rng_before):
            return None
        recorder.close(status="oom")
        raise _out_of_memory(run, step, lambda: run.checkpoint_now(step, "oom", data_before, rng_before)) from None
    step_lr = training.optimizer.param_groups[0]["lr"]  # what this step used: scheduler.step() sets the next one's
    training.scheduler.step()
    loss_value, tokens, stop_requested, grad_norm = world.step_totals(
        loss, tokens, stop.signal_name is not None, grad_norm, device
    )
    pair_metrics = world.metric_totals(pair_metrics, device)
    if stop_requested and stop.signal_name is None:
        stop.signal_name = "SIGTERM"  # another rank was asked to stop
    meter.stop(tokens)
    del micro_batches, loss  # nothing of this step is held into the next
    # On several processes only what they agreed on counts (a signal may reach one rank later
    # than the others); one process also stops for a signal that came after the step's end.
    return _Taken(
        loss=loss_value,
        tokens=tokens,
        grad_norm=float(grad_norm) if grad_norm is not None else None,
        lr=step_lr,
        stopping=stop_requested if world.distributed else stop.signal_name is not None,
        pair_metrics=pair_metrics,
        samples=samples,
        rollout_metrics=rollout_metrics,
        longest=longest,
    )


def _after_step(
    run: _Run, result: TrainResult, taken: _Taken, recorder: MemoryRecorder, log, bar, meter: Throughput, started: float
) -> None:
    """The bookkeeping of a step taken: the divergence check, metrics, the memory findings, the
    evaluations and checkpoints due at this step."""
    config, steps = run.config, result.total_steps
    done = result.step = result.step + 1
    if not math.isfinite(taken.loss):
        run.checkpoint_now(done, "nonfinite")
        run.record.write(status="diverged", step=done)
        raise TrainError(
            f"the loss is {taken.loss} at step {done}: training diverged. Lower lr (now {config.lr:g}), "
            "keep max_grad_norm set, or use bf16 instead of fp16."
        )
    if run.loss_sum is not None:
        run.loss_sum += taken.loss
    log.epoch = _epoch(run, done, steps)  # on this step's records and those after it, until the next step
    metrics = {
        "step": done,
        "loss": taken.loss,
        "lr": taken.lr,
        "grad_norm": taken.grad_norm,
        "tokens": taken.tokens,
        "tokens_per_second": meter.rate(),
        "elapsed_s": round(run.clock() - started, 4),  # since this process's loop began
        **step_peak_reading(run.device),
        **(summarize_grpo_metrics if run.spec.is_grpo else summarize_metrics)(taken.pair_metrics),
        **taken.rollout_metrics,
    }
    taken.pair_metrics.clear()  # nothing of this step is held into the next
    result.losses.append((done, taken.loss))
    extra = {
        "loss": taken.loss,
        "tokens": taken.tokens,
        **({"longest_sequence": taken.longest} if taken.longest else {}),
    }
    for finding in recorder.end_step(done, extra):
        warn(run.console, finding)
    if done % config.log_every == 0 or done == steps:
        log.write(metrics)
    if run.data.prepared.eval_examples and config.eval_every and done % config.eval_every == 0 and done != steps:
        _evaluate(run, result, log, done)
    if config.eval_every and done % config.eval_every == 0 and done != steps:
        run.write_generations(log, done)
    bar.update(done, metrics)
    if config.save_every and done % config.save_every == 0 and done != steps:
        result.checkpoint = run.checkpoint_now(done, "interval")


def _final_evaluation(run: _Run, result: TrainResult, log, stopped_by: str | None) -> None:
    """Evaluate the trained model at the end of the run (the eval loss, the replies to
    ``eval_prompts``), unless ``stopped_by`` a signal during the last step: then the outputs matter
    more than waiting for the evaluation (say so)."""
    eval_examples = run.data.prepared.eval_examples
    if not eval_examples and not run.config.eval_prompts:
        return
    if stopped_by is not None:
        run.console.print(
            f"{stopped_by} during the last step: the step is done, so the run completes; "
            "its final evaluation is skipped",
            highlight=False,
        )
        return
    if eval_examples:
        _evaluate(run, result, log, result.step)
    run.write_generations(log, result.step)


def _evaluate(run: _Run, result: TrainResult, log, step: int) -> None:
    """One evaluation at ``step``: ``eval_loss`` and, for a preference objective, its metrics under
    TRL's evaluation names (``eval_rewards/accuracies``...), one ``metrics.jsonl`` record."""
    record = evaluation_metrics(
        run.model,
        run.data.prepared.eval_examples,
        run.spec.batch_size,
        run.collate,
        run.device,
        run.configuration.step_fn.loss_and_metrics,
        lambda values: run.world.sum_over_ranks(values, run.device),
    )
    result.eval_losses.append((step, record["eval_loss"]))
    log.write({"step": step, **record})


def _epoch(run: _Run, step: int, steps: int) -> float:
    """The run's epoch after ``step`` of ``steps``, as the Trainer counts it: epochs and batches of
    the data handed out; for a stream (no length), the share of ``max_steps`` done, as the Trainer
    counts it for data without a length."""
    done = run.training.batches.epochs_done()
    return done if done is not None else step / steps


@dataclass
class _Session:
    """What this process trained since its loop began (a resumed run: since the resume): optimizer
    steps and examples, for the end-of-run speeds."""

    steps: int = 0
    samples: int = 0


def _end_of_run(run: _Run, result: TrainResult, session: _Session, log, started: float) -> dict[str, float]:
    """The end-of-run record of a completed run, as the Trainer logs it when training ends (after the
    final evaluation and checkpoint): ``train_runtime`` and the speeds of this process's part of the
    run, and ``train_loss``, the mean step loss of the whole run (:func:`memfit.train.progress.end_of_run_metrics`)."""
    figures = end_of_run_metrics(
        runtime_s=run.clock() - started,
        samples=session.samples,
        steps=session.steps,
        loss_sum=run.loss_sum,
        steps_done=result.step,
    )
    log.write({"step": result.step, **figures})
    return figures


# ------------------------------------------------------------------------------------------------
# Out of memory


def _step_down(run: _Run, step: int, data_before: dict[str, Any], rng_before: dict[str, Any]) -> bool:
    """After step ``step`` ran out of memory: free, take the next configuration down at the same
    effective batch (:meth:`memfit.planner.search.run.RunPlanner.step_down`, against the run's one Target),
    put the data and the random state back to where the step began, save, and say so. False when the
    run cannot go on that way (one process, ``on_oom: continue``, no optimizer step in backward,
    something smaller that fits)."""
    configuration, device, console, training = run.configuration, run.device, run.console, run.training
    config = configuration.config
    training.optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if config.on_oom != "continue" or run.world.distributed:
        return False
    if config.spec.step_in_backward:
        console.print(
            "out of memory: the optimizer step in backward had already updated some weights, so the step "
            "cannot be taken again with another configuration",
            highlight=False,
        )
        return False
    # The configurations down are planned at the longest example (micro-batch sizes change), so the
    # one that failed is compared at that length too.
    knobs = {**config.spec.knobs(), "seq_len": configuration.longest_len}
    failed = configuration.plan
    if failed is None or configuration.planned_len != configuration.longest_len:
        failed = configuration.planner.check(knobs)
    found = configuration.planner.step_down(knobs, failed)
    if found is None:
        return False
    new_config = config.model_copy(update={k: found.knobs[k] for k in SEARCHED})
    lean_step_changes(run.model, config.spec, new_config.spec)
    training.batches.batch_size = run.world.global_batch_size(new_config.spec)
    training.batches.load_state_dict(data_before, rebatch=True)
    restore_rng(rng_before, device)
    step_fn = run.world.training_step(
        build_step(new_config.spec, make_config(run.data.model_config), new_config.objective_params), run.model
    )
    run.configuration = dataclasses.replace(
        configuration, config=new_config, step_fn=step_fn, plan=found.plan, planned_len=configuration.longest_len
    )
    active = {k: new_config.spec.knobs()[k] for k in SEARCHED}
    record = run.record
    change = {
        "step": step + 1,
        "reason": "out of memory",
        "moves": found.moves,
        "from": record.fields["active_knobs"],
        "to": active,
        "plan_bytes": found.plan.device_total_bytes,
    }
    record.fields["config_changes"] = list(record.fields.get("config_changes") or []) + [change]
    record.fields["active_knobs"] = active
    record.write(status="running", step=step)
    run.checkpoint_now(step, "oom", {**data_before, "batch_size": training.batches.batch_size}, rng_before)
    console.print(
        f"[yellow]out of memory[/] at step {step + 1}: continuing with {describe(active)} "
        f"({'; '.join(found.moves)}; plan {format_bytes(found.plan.device_total_bytes)}), the same examples in the same order",
        highlight=False,
    )
    return True


def _out_of_memory(run: _Run, step: int, save_before_step) -> OutOfMemory:
    """Free, save (where the world can), explain; record the run as ended by running out of memory."""
    config, world = run.config, run.world
    error = handle_oom(
        optimizer=run.training.optimizer,
        step=step,
        save_before_step=save_before_step if world.saves_on_oom else (lambda: None),
        knobs=config.spec.knobs(),
        step_in_backward=config.spec.step_in_backward,
        preflight=run.configuration.preflight,
        replan=lambda: run.configuration.planner.replan(config.knobs()),
        device=run.device,
        console=run.console,
    )
    run.record.write(status="oom", step=step)
    return error


def _resume_checkpoint(run_dir: Path, spec, console) -> Path | None:
    """The checkpoint a resumed run continues from; None when the run stopped in its reference pass
    (``precompute_reference``), before its first step. Raises TrainError when there is neither."""
    damaged: list[tuple[Path, str]] = []
    checkpoint = latest_checkpoint(run_dir, damaged)
    for path, why in damaged:
        console.print(f"[yellow]skipping[/] damaged checkpoint {path}: {why}", highlight=False)
    if (
        checkpoint is None
        and not damaged
        and spec.reference == "precomputed"
        and reference_file(run_dir, "train").is_file()
    ):
        console.print("resuming the reference pass: training starts once it is done", highlight=False)
        return None
    if checkpoint is None:
        raise TrainError(
            f"--resume: {run_dir} has no {'whole ' if damaged else ''}checkpoint to resume from "
            f"({'every one is damaged' if damaged else 'the run stopped before saving one'}). "
            "Start again in another output_dir, or delete this one first."
        )
    return checkpoint


def _recorded_changes(run_dir: Path) -> list:
    """The configuration changes an earlier run in ``run_dir`` recorded (kept when it resumes)."""
    import json

    try:
        changes = json.loads((run_dir / "run.json").read_text(encoding="utf-8")).get("config_changes")
    except (OSError, ValueError, AttributeError):
        return []
    return list(changes) if isinstance(changes, list) else []


def _warn_slow_on_cpu(config: TrainConfig, device: torch.device, console) -> None:
    """Say once, before any work, that a QLoRA or lora-8bit run on the CPU goes through
    bitsandbytes' CPU path for quantized layers, much slower than LoRA there (and fewer bits save
    GPU memory, not host memory)."""
    if device.type == "cpu" and config.spec.base_bits is not None:
        bits = config.spec.base_bits
        console.print(
            f"[yellow]warning:[/] method: {config.method} on the CPU runs bitsandbytes' CPU path for {bits}-bit layers, "
            f"much slower than LoRA; on a CPU use method: lora (with precision: fp32), or train {config.method} on a GPU.",
            highlight=False,
        )
