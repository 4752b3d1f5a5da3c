"""The training run, top to bottom: plan, data, model, optimizer, the loop, outputs.

:func:`train` is the whole recipe. Each optimizer step is the :class:`~memfit.step.builder.TrainingStep`
that :func:`memfit.step.builder.build_step` makes for the configuration, the same one the planner
simulates, so the memory the plan predicted is the memory of this loop. Everything else is
bookkeeping around it, in modules of its own: the run folder (:mod:`~memfit.train.run_folder`),
progress and metrics (:mod:`~memfit.train.progress`), signals and out-of-memory
(:mod:`~memfit.train.guards`), data (:mod:`~memfit.train.examples`, :mod:`~memfit.train.micro_batches`,
:mod:`~memfit.train.evaluation`), checkpoints (:mod:`~memfit.train.checkpointing`). One process and
the ranks of a ``torchrun`` launch run the same code: what differs is asked of the :mod:`world <memfit.train.world>`.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from memfit.run_files import memory_file_name
from memfit.step.attention import restore_attention
from memfit.planner.fit_run import SEARCHED, describe
from memfit.step.builder import build_step
from memfit.step.optim import build_optimizer
from memfit.step.prepare import lean_step_changes, prepare_given_model
from memfit.models.build import make_config
from memfit.train.evaluation import evaluate
from memfit.train.micro_batches import count_step_tokens
from memfit.train.checkpointing import capture_rng, latest_checkpoint, restore_rng
from memfit.train.config import (
    TrainConfig,
    lr_factor,
    model_config_dict,
    total_steps,
    warmup_steps,
)
from memfit.train.distributed import DistributedError, check_world
from memfit.train.disk_space import FULL_DISK_ERRNOS, full_disk_message
from memfit.train.errors import DiskFull, OutOfMemory, TrainError
from memfit.train.examples import (
    check_vocab,
    load_tokenizer,
    pad_token_id,
    prepare_data,
    seed_everything,
)
from memfit.train.fitting import Target, device_target, fit_configuration, planned_seq_len, recorded_knobs, step_down
from memfit.train.generation import eval_generations
from memfit.train.guards import StopOnSignal, handle_oom
from memfit.train.hub_model import fetch_small_files, fetch_weights
from memfit.train.loading import load_model, verify_setup
from memfit.train.preflight import PreflightResult, preflight_run
from memfit.train.progress import LiveProgress, MetricsLog, NullLog, Throughput, warn
from memfit.train.run_folder import RunRecord, finished_run, truncate_metrics
from memfit.train.world import make_world
from memfit.watch.compare import comparison_lines
from memfit.watch.readings import step_peak_reading
from memfit.units import format_bytes
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
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    setup: dict[str, Any] = field(default_factory=dict)
    tokens_per_second: float | None = None
    model: Any = field(default=None, repr=False)  # the trained model, still on its device


def train(
    config: TrainConfig,
    *,
    resume: bool = False,
    model: torch.nn.Module | None = None,
    console: Any = None,
    progress: bool = True,
    conformance_steps: int | None = None,
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
            return TrainResult(status="finished", step=done["step"], total_steps=done["total_steps"], run_dir=run_dir,
                               output_dir=done["output_dir"])
    try:
        world = make_world()
        check_world(config.spec.gpus, config.spec.shard, world.placement)
    except DistributedError as err:
        raise TrainError(str(err)) from None
    try:
        return _run(config, world, resume=resume, model=model, console=console, progress=progress,
                    conformance_steps=conformance_steps)
    except OSError as err:
        world.discard_run_dir()
        if err.errno in FULL_DISK_ERRNOS and err.filename is None:  # a write to an open file (metrics, memory)
            run_dir = Path(config.output_dir or "runs/train")
            raise DiskFull(full_disk_message(run_dir, "the run's files", None, "Free some space there and continue "
                                             "with --resume (from the last checkpoint).")) from None
        raise
    except BaseException:
        world.discard_run_dir()  # a run that failed before writing anything leaves no empty folder
        raise
    finally:
        world.leave()


def _run(config: TrainConfig, world, *, resume: bool, model, console, progress: bool, conformance_steps: int | None) -> TrainResult:
    if not world.is_main:  # one voice: rank 0 prints
        console, progress = Console(stderr=True, quiet=True), False
    console = console or Console(stderr=True)
    run_dir = Path(config.output_dir or "runs/train")
    device = world.join(config.device, model)
    _warn_slow_on_cpu(config, device, console)
    for leftover in world.prepare_run_dir(run_dir, resume):
        console.print(f"removed {leftover}: the temporary folder of a save that was interrupted", highlight=False)
    # A Hub model (model: org/name): its config, tokenizer and weights index now, the weights once
    # the run is known to fit and the data is read (memfit.train.hub_model).
    config, hub = fetch_small_files(config, world=world, console=console, resume=resume, run_dir=run_dir)

    # 1. Data: tokenized up front (a stream: its first rows), so that a bad file or dataset fails
    # before anything is planned or loaded.
    model_dict = model_config_dict(config)
    seed_everything(config.seed)
    tokenizer = load_tokenizer(config)
    data = prepare_data(config, tokenizer, console=console, resume_from=run_dir if resume else None)
    train_examples, eval_examples = data.train_examples, data.eval_examples  # a stream's are not known: plan at seq_len
    check_vocab(data.checked_examples, int(model_dict.get("vocab_size") or 0), tokenizer)
    pad_id = pad_token_id(tokenizer)

    # 2. The configuration, and whether it fits: decided before any weight is read. A resumed run
    # keeps the configuration it was training with; fit: auto chooses the knobs left open.
    fit_record = None
    given = {k: config.spec.knobs()[k] for k in SEARCHED}
    kept, first_given = recorded_knobs(run_dir) if resume else (None, None)
    if kept is not None and first_given not in (None, given):
        kept = None  # the config was changed on purpose since the run began: it wins
        console.print(f"resuming with the config's {describe(given)}, not the run's {describe(first_given)}", highlight=False)
    elif kept is not None and kept != given:
        config = config.model_copy(update=kept)
        console.print(f"resuming with the configuration the run was training with: {describe(kept)}", highlight=False)
    given = first_given or given
    try:
        # The step this configuration runs (its loss, clipping, batch layout), settled before any work.
        step_fn = build_step(config.spec, make_config(model_dict))
    except ValueError as err:
        raise TrainError(str(err)) from None
    def length_for(batch_size: int) -> int:
        return planned_seq_len(train_examples, batch_size, config.seq_len, step_fn.layout, config.packing)

    # A search over micro-batch sizes plans every candidate at the longest single example: no
    # micro-batch of the data has longer examples (on average) than that, whatever its size.
    longest_len = length_for(1)
    if config.fit == "auto" and kept is None and not resume:
        config, fit_record = fit_configuration(config, model_dict, longest_len, device_target(config, device), console)
        step_fn = build_step(config.spec, make_config(model_dict))
    planned_len = length_for(config.batch_size)
    spec = config.spec
    preflight = preflight_run(config, model_dict, device, console, seq_len=planned_len)

    # 3. Model: meta -> weights on the device -> adapters -> the memory-lean step, then checked;
    # then sharded (several processes), and the step this configuration runs.
    if model is None:
        weights = config.model if config.init == "pretrained" else None
        if hub is not None and weights is not None:
            weights = fetch_weights(config, hub, world=world, console=console, progress=progress)
        loaded = load_model(model_dict, spec, world.load_device(spec, device), init=config.init, weights_dir=weights, seed=config.seed)
        model, setup = loaded.model, loaded.setup
    else:
        model = prepare_given_model(model, spec)
        setup = verify_setup(model, spec)
    where = f"{world.world_size} processes ({spec.shard}), one on {device} each" if world.distributed else str(device)
    console.print(
        f"model: {setup['total_params']:,} parameters, {setup['trainable_params']:,} trainable "
        f"({setup['trainable_percent']:.2f}%, {spec.method}), checkpointing in "
        f"{setup['checkpointed_layers']}/{setup['decoder_layers']} decoder layers, on {where}",
        highlight=False,
    )
    model = world.shard(model, spec, device, console)
    step_fn = world.training_step(step_fn, model)

    # 4. Optimizer, schedule, data order and the loss scaler fp16 needs.
    optimizer = build_optimizer(model.parameters(), spec.optimizer, lr=config.lr, weight_decay=config.weight_decay,
                                step_in_backward=spec.step_in_backward)
    batches = data.batches(world.global_batch_size(spec), config, tokenizer.eos_token_id)
    steps = total_steps(config, batches.batches_per_epoch())
    warmup = warmup_steps(config, steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total=steps, warmup=warmup, schedule=config.schedule, min_ratio=config.min_lr_ratio)
    )
    grad_scaler = step_fn.grad_scaler(device)

    def checkpoint_now(step: int, reason: str, data_state=None, rng_state=None) -> Path:
        data = data_state if data_state is not None else batches.state_dict()
        # Examples per optimizer step: a resume may cut them into other micro-batches, never other steps.
        data = {**data, "examples_per_step": data["batch_size"] * record.fields["active_knobs"]["grad_accum"]}
        return world.save_checkpoint(
            run_dir, step, model=model, optimizer=optimizer, scheduler=scheduler, grad_scaler=grad_scaler,
            data_state=data,
            rng_state=rng_state if rng_state is not None else capture_rng(device),
            reason=reason, keep=config.keep_checkpoints,
        )

    # 5. Resume: tensors and optimizer now, RNG and data position right before the next step.
    start_step = 0
    if resume:
        damaged: list[tuple[Path, str]] = []
        checkpoint = latest_checkpoint(run_dir, damaged)
        for path, why in damaged:
            console.print(f"[yellow]skipping[/] damaged checkpoint {path}: {why}", highlight=False)
        if checkpoint is None:
            raise TrainError(
                f"--resume: {run_dir} has no {'whole ' if damaged else ''}checkpoint to resume from "
                f"({'every one is damaged' if damaged else 'the run stopped before saving one'}). "
                "Start again in another output_dir, or delete this one first."
            )
        try:
            state = world.load_checkpoint(checkpoint, model=model, optimizer=optimizer, scheduler=scheduler,
                                          grad_scaler=grad_scaler, device=device)
            per_step = world.global_batch_size(spec) * spec.grad_accum
            batches.load_state_dict(state.data, rebatch=state.data.get("examples_per_step") == per_step)
        except ValueError as err:  # CheckpointError, or data / batch settings that changed
            raise TrainError(f"--resume from {checkpoint}: {err}") from None
        restore_rng(state.rng, device)
        start_step = state.step
        if world.is_main:
            truncate_metrics(run_dir, start_step)
        console.print(f"resuming from {checkpoint} (step {start_step} of {steps})", highlight=False)

    # The checkpoints written from here on say how many examples a step takes (see checkpoint_now).
    record = RunRecord.for_run(run_dir, config=config, model_config=model_dict, preflight=preflight, setup=setup,
                               device=device, total_steps=steps, enabled=world.is_main,
                               extra={**world.run_fields(spec), **({"hub": hub.record()} if hub is not None else {}),
                                      "data": data.record,
                                      "planned_seq_len": planned_len, "fit": fit_record,
                                      "active_knobs": {k: spec.knobs()[k] for k in SEARCHED}, "given_knobs": given,
                                      "config_changes": _recorded_changes(run_dir) if resume else []})
    record.write(status="running", step=start_step)
    result = TrainResult(status="completed", step=start_step, total_steps=steps, run_dir=run_dir, setup=setup, model=model)

    # 6. The loop, then 7. the outputs: the last checkpoint and the deliverable.
    current = _Current(config=config, step_fn=step_fn, pad_id=pad_id, model_config=model_dict, planned_len=planned_len,
                       longest_len=longest_len,
                       plan=preflight.plan, tokenizer=tokenizer)
    _train_and_save(current, world, result, tokenizer, model=model, optimizer=optimizer, scheduler=scheduler,
                    grad_scaler=grad_scaler, batches=batches, eval_examples=eval_examples, device=device,
                    preflight=preflight, record=record, checkpoint_now=checkpoint_now, console=console,
                    progress=progress, conformance_steps=conformance_steps)
    record.write(status=result.status, step=result.step, tokens_per_second=result.tokens_per_second,
                 peak=step_peak_reading(device))
    return result


def _train_and_save(current: _Current, world, result: TrainResult, tokenizer, *, model, record, **loop: Any) -> None:
    """The loop (:func:`_loop`), then the deliverable once it completed (a signal during the last
    step included: that step is done), with the trained model's own attention back (document
    attention is for training rows). A signal stops the run after the step it arrives in; from then
    on until the outputs are written it only asks, so the last checkpoint and the deliverable are
    never cut short. A full disk is recorded in ``run.json``."""
    try:
        with StopOnSignal() as stop:
            _loop(current, world, result, stop, model=model, record=record, **loop)
            restore_attention(model)
            if result.status == "completed":
                result.output_dir = world.save_outputs(model, tokenizer, result.run_dir, current.spec.uses_adapters)
                result.signal_name = stop.signal_name  # arrived once there was nothing left to stop
    except DiskFull:
        with contextlib.suppress(OSError):  # a few hundred bytes: there is room once the failed save is gone
            record.write(status="disk_full", step=result.step)
        raise


def _warn_slow_on_cpu(config: TrainConfig, device: torch.device, console) -> None:
    """Say once, before any work, that a QLoRA run on the CPU goes through bitsandbytes' CPU path
    for 4-bit layers, much slower than LoRA there (and 4 bits save GPU memory, not host memory)."""
    if device.type == "cpu" and config.method == "qlora":
        console.print(
            "[yellow]warning:[/] method: qlora on the CPU runs bitsandbytes' CPU path for 4-bit layers, much slower "
            "than LoRA; on a CPU use method: lora (with precision: fp32), or train QLoRA on a GPU.",
            highlight=False,
        )


@dataclass
class _Current:
    """What a step-down after running out of memory changes while the run goes on."""

    config: TrainConfig
    step_fn: Any
    pad_id: int
    model_config: dict[str, Any]
    planned_len: int  # the data's longest micro-batch at this configuration's micro-batch size
    longest_len: int  # the data's longest example (the length a search over micro-batch sizes plans)
    plan: Any  # the plan of the configuration in effect (None: not planned)
    tokenizer: Any = None  # for the replies to eval_prompts

    def write_generations(self, log, model, step: int, device: torch.device) -> None:
        """The greedy replies to ``eval_prompts`` at ``step``, one ``metrics.jsonl`` record (none without prompts)."""
        if self.config.eval_prompts:
            log.write(eval_generations(model, self.tokenizer, self.config.eval_prompts, step=step,
                                       max_new_tokens=self.config.eval_max_new_tokens, device=device))

    @property
    def spec(self):
        return self.config.spec

    def collate(self, examples: list) -> dict[str, Any]:
        return self.step_fn.collate(examples, self.pad_id)


def _loop(current: _Current, world, result: TrainResult, stop: StopOnSignal, *, model, optimizer, scheduler,
          grad_scaler, batches, eval_examples: list, device: torch.device, preflight: PreflightResult, record,
          checkpoint_now, console, progress: bool, conformance_steps: int | None = None) -> None:
    """The optimizer steps from ``result.step`` to the end, watched: memory is recorded every step
    (``memory.jsonl``) and checked for leaks, stray devices and switched-off optimizations. A step that
    runs out of memory is taken again one configuration down (:func:`_step_down`), where it can be.
    A signal (``stop``) ends the run after its step with an ``interrupt`` checkpoint, unless that step
    was the last: then the run completes, without its final evaluation."""
    config, spec = current.config, current.spec
    steps = result.total_steps
    recorder = MemoryRecorder(result.run_dir, plan=preflight.plan, expected_device=device, total_steps=steps, spec=spec,
                              source="memfit-train", resumed_from_step=result.step or None,
                              file_name=memory_file_name(world.rank), rank=world.recorder_rank)
    for finding in recorder.inspect(model, spec):
        warn(console, finding)
    if conformance_steps is not None:
        recorder.attribute(model, optimizer, steps=conformance_steps, cuda_parity=True)
    elif world.attributes_memory:
        recorder.attribute(model, optimizer)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    meter = Throughput()
    started = time.perf_counter()
    # One voice: rank 0 writes metrics.jsonl and reports to the trackers, with what run.json holds.
    metrics_log = (MetricsLog(result.run_dir, report_to=config.report_to, run_config=record.fields, console=console)
                   if world.is_main else NullLog())
    stopping = False  # asked to stop by the end of the last step (several processes: as they all agreed at its end)
    with recorder, metrics_log as log, LiveProgress(console, steps, result.step, enabled=progress) as bar:
        step = result.step
        while step < steps:
            # Where the run stands before this step: an emergency checkpoint taken if the step fails
            # must replay this step's batches, not skip them.
            data_before, rng_before = batches.state_dict(), capture_rng(device)
            meter.start()
            micro_batches = world.micro_batches(batches, current.spec.grad_accum, current.collate, device)
            tokens = count_step_tokens(micro_batches)
            try:
                loss, grad_norm = current.step_fn(model, micro_batches, optimizer, grad_scaler=grad_scaler, observer=recorder.observer)
            except torch.OutOfMemoryError:
                del micro_batches
                if _step_down(current, world, model, optimizer, batches, step, data_before, rng_before, device, record,
                              checkpoint_now, console):
                    continue  # the same step again, one configuration down, on the same examples
                recorder.close(status="oom")
                raise _out_of_memory(current.config, world, optimizer, step, preflight, device, console,
                                     lambda: checkpoint_now(step, "oom", data_before, rng_before), record) from None
            config, spec = current.config, current.spec
            step_lr = optimizer.param_groups[0]["lr"]  # what this step used: scheduler.step() sets the next one's
            scheduler.step()
            loss_value, tokens, stop_requested, grad_norm = world.step_totals(loss, tokens, stop.signal_name is not None, grad_norm, device)
            if stop_requested and stop.signal_name is None:
                stop.signal_name = "SIGTERM"  # another rank was asked to stop
            # On several processes only what they agreed on counts (a signal may reach one rank later
            # than the others); one process also stops for a signal that came after the step's end.
            stopping = stop_requested if world.distributed else stop.signal_name is not None
            meter.stop(tokens)
            grad_norm = float(grad_norm) if grad_norm is not None else None
            del micro_batches, loss  # nothing of this step is held into the next
            done = result.step = step = step + 1
            if not math.isfinite(loss_value):
                checkpoint_now(done, "nonfinite")
                record.write(status="diverged", step=done)
                raise TrainError(
                    f"the loss is {loss_value} at step {done}: training diverged. Lower lr (now {config.lr:g}), "
                    "keep max_grad_norm set, or use bf16 instead of fp16."
                )
            metrics = {
                "step": done,
                "loss": loss_value,
                "lr": step_lr,
                "grad_norm": grad_norm,
                "tokens": tokens,
                "tokens_per_second": meter.rate(),
                "elapsed_s": round(time.perf_counter() - started, 4),  # since this process's loop began
                **step_peak_reading(device),
            }
            result.losses.append((done, loss_value))
            for finding in recorder.end_step(done, {"loss": loss_value, "tokens": tokens}):
                warn(console, finding)
            if done % config.log_every == 0 or done == steps:
                log.write(metrics)
            if eval_examples and config.eval_every and done % config.eval_every == 0 and done != steps:
                eval_loss = evaluate(model, eval_examples, spec.batch_size, current.collate, device, current.step_fn.loss)
                result.eval_losses.append((done, eval_loss))
                log.write({"step": done, "eval_loss": eval_loss})
            if config.eval_every and done % config.eval_every == 0 and done != steps:
                current.write_generations(log, model, done, device)
            bar.update(done, metrics)
            if config.save_every and done % config.save_every == 0 and done != steps:
                result.checkpoint = checkpoint_now(done, "interval")
            if stopping and done < steps:
                result.checkpoint = checkpoint_now(done, "interrupt")
                result.status, result.signal_name = "interrupted", stop.signal_name
                break

        if result.status == "completed":
            _final_evaluation(current, result, model, eval_examples, device, log, console,
                              stop.signal_name if stopping else None)
            result.checkpoint = checkpoint_now(result.step, "final")
        for finding in recorder.close(status=result.status):
            warn(console, finding)
    for line in comparison_lines(recorder.comparison()):
        console.print(line, highlight=False)
    result.tokens_per_second = meter.overall_rate()


def _final_evaluation(current: _Current, result: TrainResult, model, eval_examples: list, device: torch.device, log,
                      console, stopped_by: str | None) -> None:
    """Evaluate the trained model at the end of the run (the eval loss, the replies to
    ``eval_prompts``), unless ``stopped_by`` a signal during the last step: then the outputs matter
    more than waiting for the evaluation (say so)."""
    if not eval_examples and not current.config.eval_prompts:
        return
    if stopped_by is not None:
        console.print(f"{stopped_by} during the last step: the step is done, so the run completes; "
                      "its final evaluation is skipped", highlight=False)
        return
    if eval_examples:
        eval_loss = evaluate(model, eval_examples, current.spec.batch_size, current.collate, device, current.step_fn.loss)
        result.eval_losses.append((result.step, eval_loss))
        log.write({"step": result.step, "eval_loss": eval_loss})
    current.write_generations(log, model, result.step, device)


def _step_down(current: _Current, world, model, optimizer, batches, step: int, data_before: dict[str, Any],
               rng_before: dict[str, Any], device: torch.device, record, checkpoint_now, console) -> bool:
    """After step ``step`` ran out of memory: free, take the next configuration down at the same
    effective batch (:func:`memfit.train.fitting.step_down`), put the data and the random state back
    to where the step began, save, and say so. False when the run cannot go on that way (one process,
    ``on_oom: continue``, no optimizer step in backward, something smaller that fits)."""
    config = current.config
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if config.on_oom != "continue" or world.distributed:
        return False
    if config.spec.step_in_backward:
        console.print("out of memory: the optimizer step in backward had already updated some weights, so the step "
                      "cannot be taken again with another configuration", highlight=False)
        return False
    target = device_target(config, device) if (config.gpu or config.budget or device.type == "cuda") else Target(None, None, None, "")
    # The configurations down are planned at the longest example (micro-batch sizes change), so the
    # one that failed is compared at that length too.
    failed = current.plan
    if failed is None or current.planned_len != current.longest_len:
        from memfit.planner.api import plan

        failed = plan(current.model_config, gpu=target.gpu, budget=target.budget, context_bytes=target.context_bytes,
                      **{**config.spec.knobs(), "seq_len": current.longest_len})
    found = step_down(config, current.model_config, current.longest_len, failed, target)
    if found is None:
        return False
    new_config, new_plan, moves = found
    lean_step_changes(model, config.spec, new_config.spec)
    batches.batch_size = world.global_batch_size(new_config.spec)
    batches.load_state_dict(data_before, rebatch=True)
    restore_rng(rng_before, device)
    current.config, current.plan, current.planned_len = new_config, new_plan, current.longest_len
    current.step_fn = world.training_step(build_step(new_config.spec, make_config(current.model_config)), model)
    knobs = {k: new_config.spec.knobs()[k] for k in SEARCHED}
    change = {"step": step + 1, "reason": "out of memory", "moves": moves, "from": record.fields["active_knobs"],
              "to": knobs, "plan_bytes": new_plan.device_total_bytes}
    record.fields["config_changes"] = list(record.fields.get("config_changes") or []) + [change]
    record.fields["active_knobs"] = knobs
    record.write(status="running", step=step)
    checkpoint_now(step, "oom", {**data_before, "batch_size": batches.batch_size}, rng_before)
    console.print(f"[yellow]out of memory[/] at step {step + 1}: continuing with {describe(knobs)} "
                  f"({'; '.join(moves)}; plan {format_bytes(new_plan.device_total_bytes)}), the same examples in the same order",
                  highlight=False)
    return True


def _recorded_changes(run_dir: Path) -> list:
    """The configuration changes an earlier run in ``run_dir`` recorded (kept when it resumes)."""
    import json

    try:
        changes = json.loads((run_dir / "run.json").read_text(encoding="utf-8")).get("config_changes")
    except (OSError, ValueError, AttributeError):
        return []
    return list(changes) if isinstance(changes, list) else []


def _out_of_memory(config: TrainConfig, world, optimizer, step: int, preflight: PreflightResult, device, console,
                   save_before_step, record) -> OutOfMemory:
    """Free, save (where the world can), explain; record the run as ended by running out of memory."""

    def replan():
        from memfit.planner.api import plan

        return plan(model_config_dict(config), **config.knobs())

    error = handle_oom(
        optimizer=optimizer, step=step, save_before_step=save_before_step if world.saves_on_oom else (lambda: None),
        knobs=config.spec.knobs(), step_in_backward=config.spec.step_in_backward, preflight=preflight, replan=replan,
        device=device, console=console,
    )
    record.write(status="oom", step=step)
    return error
