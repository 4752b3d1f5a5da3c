"""The training run, top to bottom: plan, data, model, optimizer, steps, checkpoints, outputs.

:func:`train` is the whole recipe. Each optimizer step is :func:`memfit.train.step.train_step`, the
same function the planner simulates, so the memory the plan predicted is the memory of this loop.
Everything else here is bookkeeping around it: the learning-rate schedule, evaluation, metrics,
checkpoints, signals and out-of-memory handling.

Started by ``torchrun`` with ``gpus: N`` (N processes), the same recipe runs on every rank with a
sharded model (:mod:`memfit.train.distributed`): each rank trains its slice of every global batch,
rank 0 prints and writes the run's files, every rank records its own memory.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memfit.files import write_atomic
from memfit.train import step as step_module
from memfit.train.checkpointing import (
    capture_rng,
    latest_checkpoint,
    load_checkpoint,
    load_sharded_checkpoint,
    replace_dir,
    restore_rng,
    save_checkpoint,
    save_sharded_checkpoint,
)
from memfit.train.config import TrainConfig, lr_factor, model_config_dict, tokenizer_path, total_steps, warmup_steps
from memfit.train.preflight import PreflightResult, oom_advice, run_preflight

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
ADAPTER_DIR = "adapter"
MODEL_DIR = "model"


class TrainError(RuntimeError):
    """The run cannot start or continue; the message says why and what to do."""


class OutOfMemory(TrainError):
    """The device ran out of memory; an emergency checkpoint was saved (``checkpoint``)."""

    def __init__(self, message: str, checkpoint: Path | None, plan: Any):
        self.checkpoint = checkpoint
        self.plan = plan
        super().__init__(message)


@dataclass
class TrainResult:
    """How a run ended. ``status``: completed, or interrupted (by SIGINT / SIGTERM: resumable)."""

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
) -> TrainResult:
    """Train as ``config`` says and return how it ended.

    Args:
        config: a validated :class:`~memfit.train.config.TrainConfig` (see :func:`load_config`).
        resume: continue from the latest checkpoint in ``config.output_dir``; the result is the
            same as if the run had never stopped (model, optimizer, schedule, RNG, data order).
        model: use this model instead of loading ``config.model`` (a transformers PreTrainedModel
            or a PeftModel, already on its device; custom wrappers are refused, see
            :func:`memfit.train.loading.refuse_wrapped_model`).
        console: a Rich console for the progress bar and messages (default: stderr).
        progress: show the live progress bar.

    Raises:
        TrainError: the output folder holds another run, the data or model do not fit, or the device
            ran out of memory (:class:`OutOfMemory`, after saving a checkpoint).
        PreflightError: the plan says the run does not fit the GPU or budget (``force`` overrides).

    With ``gpus`` > 1 every process torchrun started calls this; the process group is joined here
    (and left at the end) unless the caller joined it already.
    """
    import torch.distributed as dist

    from memfit.train import distributed as dist_module

    world = dist_module.world_from_env()
    spec = config.spec
    try:
        dist_module.check_world(spec.gpus, spec.shard, world)
    except dist_module.DistributedError as err:
        raise TrainError(str(err)) from None
    if world.distributed and model is not None:
        raise TrainError("train(model=...): a given model trains on one process only; let memfit load it for gpus > 1")
    owns_group = world.distributed and not dist.is_initialized()
    try:
        return _train(config, world, resume=resume, model=model, console=console, progress=progress)
    finally:
        if owns_group:
            dist_module.teardown()


def _train(config: TrainConfig, world, *, resume: bool, model, console, progress: bool) -> TrainResult:
    from rich.console import Console

    from memfit.train import distributed as dist_module
    from memfit.train.loading import load_model, prepare_given_model, resolve_device, verify_setup
    from memfit.train.optim import build_optimizer

    spec = config.spec
    sharded = world.distributed
    if not world.is_main:  # one voice: rank 0 prints
        console = Console(stderr=True, quiet=True)
        progress = False
    console = console or Console(stderr=True)
    run_dir = Path(config.output_dir or "runs/train")
    if sharded:
        device = dist_module.init_distributed(world, config.device)
        # Every rank checks the folder before rank 0 writes into it; the first error stops them all.
        problem = None
        try:
            check_run_dir(run_dir, resume)
        except TrainError as err:
            problem = str(err)
        problem = dist_module.first_error(problem)
        if problem:
            raise TrainError(problem)
        if world.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
        dist_module.barrier()
    else:
        prepare_run_dir(run_dir, resume)

    # 0. A Hub model (model: org/name): its config, tokenizer and weights index now, the weights once
    # the run is known to fit and the data is read (memfit.train.hub_model).
    from memfit.train.hub_model import fetch_small_files, fetch_weights

    config, hub = fetch_small_files(config, world=world, console=console, resume=resume, run_dir=run_dir)

    # 1. Where, and whether it fits: decided before any weight is read.
    if not sharded:
        device = resolve_device(config.device) if model is None else next(model.parameters()).device
    model_dict = model_config_dict(config)
    preflight = plan_per_rank(config, model_dict, device, console)
    if preflight.plan is not None:
        from memfit.planner.runtime import format_bytes

        console.print(
            f"plan: {format_bytes(preflight.plan.device_total_bytes)} at the peak, "
            f"{format_bytes(preflight.target_bytes)} available ({preflight.target})", highlight=False,
        )
    if preflight.forced:
        console.print("[yellow]warning:[/] the plan says this run does not fit; training anyway (force)", highlight=False)

    # 2. Data: tokenized up front, so that a bad file fails before the model loads.
    seed_everything(config.seed)
    tokenizer = load_tokenizer(config)
    train_examples, eval_examples = prepare_examples(config, tokenizer)
    check_vocab(train_examples + eval_examples, int(model_dict.get("vocab_size") or 0), tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    loss_fn = packed_causal_lm_loss if config.packing else step_module.causal_lm_loss

    # 3. Model: meta -> weights on the device -> adapters -> checkpointing, then checked.
    if model is None:
        load_device = dist_module.load_device(spec, device) if sharded else device
        weights_dir = config.model if config.init == "pretrained" else None
        if hub is not None and config.init == "pretrained":
            weights_dir = fetch_weights(config, hub, world=world, console=console, progress=progress)
        loaded = load_model(model_dict, spec, load_device, init=config.init, weights_dir=weights_dir, seed=config.seed)
        model, setup = loaded.model, loaded.setup
    else:
        model = prepare_given_model(model, spec)
        setup = verify_setup(model, spec)
    where = f"{world.world_size} processes ({spec.shard}), one on {device} each" if sharded else str(device)
    console.print(
        f"model: {setup['total_params']:,} parameters, {setup['trainable_params']:,} trainable "
        f"({setup['trainable_percent']:.2f}%, {spec.method}), checkpointing in "
        f"{setup['checkpointed_layers']}/{setup['decoder_layers']} decoder layers, on {where}",
        highlight=False,
    )
    if sharded:
        model = dist_module.shard_model(model, spec, device, world)
        dist_module.check_placed(model, device)
        loss_fn = dist_module.sharded_loss_fn(model, loss_fn)
        if dist_module.frozen_4bit_params(model):
            console.print("note: the 4-bit base weights stay whole on every rank; adapters and the rest are sharded", highlight=False)

    # 4. Optimizer, schedule, and the loss scaler fp16 needs (bf16 and fp32 have the range).
    optimizer = build_optimizer(model.parameters(), spec.optimizer, lr=config.lr, weight_decay=config.weight_decay,
                                step_in_backward=spec.step_in_backward)
    from memfit.train.data import BatchIterator

    # One global micro-batch of batch_size x world_size examples; each rank takes its slice.
    batches = BatchIterator(train_examples, batch_size=spec.batch_size * world.world_size, seed=config.seed)
    steps = total_steps(config, batches.batches_per_epoch())
    warmup = warmup_steps(config, steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total=steps, warmup=warmup, schedule=config.schedule, min_ratio=config.min_lr_ratio)
    )
    grad_scaler = torch.amp.GradScaler(device.type) if spec.precision == "fp16" else None
    step_loss_fn = dist_module.weighted_loss_fn(loss_fn) if sharded else loss_fn

    # 5. Resume: tensors and optimizer now, RNG and data position right before the next step.
    start_step = 0
    if resume:
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            raise TrainError(
                f"--resume: {run_dir} has no checkpoint to resume from (the run stopped before saving one). "
                "Start again in another output_dir, or delete this one first."
            )
        try:
            if sharded:
                state = load_sharded_checkpoint(checkpoint, model=model, optimizer=optimizer, scheduler=scheduler,
                                                rank=world.rank, world_size=world.world_size)
            else:
                state = load_checkpoint(checkpoint, model=model, optimizer=optimizer, scheduler=scheduler, grad_scaler=grad_scaler, device=device)
            batches.load_state_dict(state.data)
        except ValueError as err:  # CheckpointError, or data / batch settings that changed
            raise TrainError(f"--resume from {checkpoint}: {err}") from None
        restore_rng(state.rng, device)
        start_step = state.step
        if world.is_main:
            truncate_metrics(run_dir / METRICS_FILE, start_step)
        console.print(f"resuming from {checkpoint} (step {start_step} of {steps})", highlight=False)

    def save_run(**status) -> None:
        if world.is_main:  # rank 0 alone writes run.json
            write_run_json(run_dir, config, preflight, setup, device, steps, **status, **_world_fields(world, spec),
                           **({"hub": hub.record()} if hub is not None else {}))

    save_run(status="running", step=start_step)

    result = TrainResult(status="completed", step=start_step, total_steps=steps, run_dir=run_dir, setup=setup, model=model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    meter = Throughput()
    loop_started = time.perf_counter()

    def checkpoint_now(step: int, reason: str, data_state=None, rng_state=None) -> Path:
        if sharded:
            return save_sharded_checkpoint(
                run_dir, step, model=model, optimizer=optimizer, scheduler=scheduler,
                data_state=data_state if data_state is not None else batches.state_dict(),
                rng_state=rng_state if rng_state is not None else capture_rng(device),
                reason=reason, keep=config.keep_checkpoints, rank=world.rank, world_size=world.world_size,
            )
        return save_checkpoint(
            run_dir, step, model=model, optimizer=optimizer, scheduler=scheduler, grad_scaler=grad_scaler,
            data_state=data_state if data_state is not None else batches.state_dict(),
            rng_state=rng_state if rng_state is not None else capture_rng(device),
            reason=reason, keep=config.keep_checkpoints,
        )

    # 6. The loop, watched: memory is recorded every step (memory.jsonl) and checked for leaks,
    # stray devices and switched-off optimizations; the first steps are measured by category.
    from memfit.watch.compare import comparison_lines
    from memfit.watch.recorder import MemoryRecorder

    from memfit.watch.recorder import memory_file_name

    recorder = MemoryRecorder(run_dir, plan=preflight.plan, expected_device=device, total_steps=steps, spec=spec,
                              source="memfit-train", resumed_from_step=start_step or None,
                              file_name=memory_file_name(world.rank), rank=world.rank if sharded else None)
    for finding in recorder.inspect(model, spec):
        _warn(console, finding)
    if not sharded:
        # The category tracker follows plain tensors; sharded parameters (DTensors) it cannot attribute.
        recorder.attribute(model, optimizer)
    metrics_log = MetricsLog(run_dir) if world.is_main else NullLog()
    with recorder, StopOnSignal() as stop, metrics_log as log, LiveProgress(console, steps, start_step, enabled=progress) as bar:
        for step in range(start_step, steps):
            # Where the run stands before this step: an emergency checkpoint taken if the step fails
            # must replay this step's batches, not skip them.
            data_before, rng_before = batches.state_dict(), capture_rng(device)
            meter.start()
            if sharded:
                micro_batches = rank_micro_batches(batches, spec.grad_accum, pad_id, device, world)
            else:
                micro_batches = [to_device(collate_batch(next(batches), pad_id), device) for _ in range(spec.grad_accum)]
            tokens = sum(int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel() for b in micro_batches)
            try:
                loss, grad_norm = step_module.train_step(
                    model, micro_batches, optimizer, loss_fn=step_loss_fn,
                    max_grad_norm=config.max_grad_norm, grad_scaler=grad_scaler, observer=recorder.observer,
                )
            except torch.OutOfMemoryError:
                del micro_batches
                recorder.close(status="oom")
                # A sharded emergency checkpoint needs every rank, and the others are stuck in a
                # collective: no checkpoint then (torchrun stops them when this rank exits).
                save = (lambda *a, **k: None) if sharded else checkpoint_now
                error = handle_oom(model, optimizer, step, save, data_before, rng_before, config, preflight, device, console)
                save_run(status="oom", step=step)
                raise error from None
            scheduler.step()
            # Reading the loss syncs with the device: once a step is cheap next to the step itself.
            if sharded:
                # Rank losses are pre-weighted (see distributed.loss_weights): their mean is the global loss.
                # The stop flag travels along, so that every rank stops after the same step.
                summed = dist_module.all_reduce_sum([float(loss), tokens, 1.0 if stop.signal_name else 0.0], device)
                loss_value, tokens = summed[0] / world.world_size, int(summed[1])
                if summed[2] and stop.signal_name is None:
                    stop.signal_name = "SIGTERM"
                grad_norm = dist_module.local_value(grad_norm) if grad_norm is not None else None
            else:
                loss_value = float(loss)
            meter.stop(tokens)
            del micro_batches, loss
            done = step + 1
            result.step = done
            if not math.isfinite(loss_value):
                checkpoint_now(done, "nonfinite")
                save_run(status="diverged", step=done)
                raise TrainError(
                    f"the loss is {loss_value} at step {done}: training diverged. Lower lr (now {config.lr:g}), "
                    "keep max_grad_norm set, or use bf16 instead of fp16."
                )
            record = {
                "step": done,
                "loss": loss_value,
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "tokens": tokens,
                "tokens_per_second": meter.rate(),
                "elapsed_s": round(time.perf_counter() - loop_started, 4),  # since this process's loop began
                **memory_reading(device),
            }
            result.losses.append((done, loss_value))
            for finding in recorder.end_step(done, {"loss": loss_value, "tokens": tokens}):
                _warn(console, finding)
            if done % config.log_every == 0 or done == steps:
                log.write(record)
            if eval_examples and config.eval_every and done % config.eval_every == 0 and done != steps:
                eval_loss = evaluate(model, eval_examples, spec.batch_size, pad_id, device, loss_fn)
                result.eval_losses.append((done, eval_loss))
                log.write({"step": done, "eval_loss": eval_loss})
            bar.update(done, record)
            if config.save_every and done % config.save_every == 0 and done != steps:
                result.checkpoint = checkpoint_now(done, "interval")
            if stop.signal_name is not None:
                result.checkpoint = checkpoint_now(done, "interrupt")
                result.status, result.signal_name = "interrupted", stop.signal_name
                break

        if result.status == "completed":
            if eval_examples:
                eval_loss = evaluate(model, eval_examples, spec.batch_size, pad_id, device, loss_fn)
                result.eval_losses.append((result.step, eval_loss))
                log.write({"step": result.step, "eval_loss": eval_loss})
            result.checkpoint = checkpoint_now(result.step, "final")
            if sharded:
                result.output_dir = save_sharded_outputs(model, tokenizer, run_dir, spec.uses_adapters, world)
            else:
                result.output_dir = save_outputs(model, tokenizer, run_dir, spec.uses_adapters)
        for finding in recorder.close(status=result.status):
            _warn(console, finding)
    for line in comparison_lines(recorder.comparison()):
        console.print(line, highlight=False)

    result.tokens_per_second = meter.overall_rate()
    save_run(status=result.status, step=result.step,
             tokens_per_second=result.tokens_per_second, peak=memory_reading(device))
    return result


def _world_fields(world, spec) -> dict[str, Any]:
    if not world.distributed:
        return {}
    return {"world_size": world.world_size, "shard": spec.shard}


def plan_per_rank(config: TrainConfig, model_dict: dict[str, Any], device: torch.device, console) -> PreflightResult:
    """The preflight plan (per rank for gpus > 1); skipped with a note when the planner cannot plan
    several GPUs yet."""
    try:
        preflight = run_preflight(
            model_dict, config.knobs(), device_type=device.type, device_index=device.index,
            gpu=config.gpu, budget=config.budget, force=config.force,
        )
    except ValueError as err:  # PlanError: a SpecError, so a ValueError
        if config.gpus > 1 and "--gpus" in str(err):
            console.print(f"note: no preflight plan for gpus: {config.gpus} ({str(err).strip().splitlines()[-1].strip(' -')})", highlight=False)
            return PreflightResult(plan=None, target=None, target_bytes=None, fits=None)
        raise
    if preflight.plan is not None:
        from memfit.planner.runtime import format_bytes

        per = " per GPU" if config.gpus > 1 else ""
        console.print(
            f"plan: {format_bytes(preflight.plan.device_total_bytes)} at the peak{per}, "
            f"{format_bytes(preflight.target_bytes)} available ({preflight.target})", highlight=False,
        )
    if preflight.forced:
        console.print("[yellow]warning:[/] the plan says this run does not fit; training anyway (force)", highlight=False)
    return preflight


def rank_micro_batches(batches, grad_accum: int, pad_id: int, device: torch.device, world) -> list[dict[str, Any]]:
    """This rank's slices of the next ``grad_accum`` global micro-batches, each with its ``loss_weight``.

    Every rank draws the same global batches (same seed and position) and keeps its slice; the
    labelled-token counts are summed over ranks so each slice's loss is weighted by its share.
    """
    from memfit.train import distributed as dist_module

    slices = []
    for _ in range(grad_accum):
        examples = dist_module.rank_slice(next(batches), world.rank, world.world_size)
        if not examples:  # fewer examples than ranks at the end of an epoch: a slice that scores nothing
            examples = [_unscored(next(iter(batches.examples)))]
        slices.append(collate_batch(examples, pad_id))
    local = [dist_module.labelled_tokens(b["labels"]) for b in slices]
    total = dist_module.all_reduce_sum(local, device)
    weights = dist_module.loss_weights(local, total, world.world_size)
    out = []
    for batch, weight in zip(slices, weights):
        moved = to_device(batch, device)
        moved["loss_weight"] = weight
        out.append(moved)
    return out


def _unscored(example: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``example`` whose labels are all ignored: a forward for the collectives, no loss."""
    return {**example, "labels": [-100] * len(example["labels"])}


# ------------------------------------------------------------------------------------------------
# Pieces of the recipe


def _warn(console, finding) -> None:
    color = "red" if finding.severity == "error" else "yellow"
    console.print(f"[{color}]{finding.severity}:[/] {finding.message} {finding.fix}", highlight=False)


def prepare_run_dir(run_dir: Path, resume: bool) -> None:
    """Create the run folder; refuse to start a new run on top of an existing one."""
    check_run_dir(run_dir, resume)
    if not resume:
        run_dir.mkdir(parents=True, exist_ok=True)


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """Raise TrainError unless ``run_dir`` can hold this run (a new one, or one to resume)."""
    if resume:
        if not (run_dir / RUN_FILE).is_file():
            raise TrainError(f"--resume: {run_dir} holds no run to resume (no {RUN_FILE}); check output_dir")
        return
    if run_dir.exists() and any(run_dir.iterdir()):
        if (run_dir / RUN_FILE).is_file() and latest_checkpoint(run_dir) is None:
            raise TrainError(
                f"output_dir {str(run_dir)!r} holds an earlier run that saved no checkpoint, so it cannot be "
                "resumed. Choose another output_dir (--output-dir), or delete that folder first."
            )
        raise TrainError(
            f"output_dir {str(run_dir)!r} already holds files. Continue that run with --resume, or choose "
            "another output_dir (--output-dir); memfit never writes over an earlier run."
        )


def seed_everything(seed: int) -> None:
    """Seed python, numpy (when loaded) and torch (CPU and every CUDA device)."""
    random.seed(seed)
    if "numpy" in sys.modules:
        import numpy as np

        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_tokenizer(config: TrainConfig):
    from transformers import AutoTokenizer

    path = tokenizer_path(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as err:
        raise TrainError(f"tokenizer: cannot load a tokenizer from {str(path)!r}: {err}") from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise TrainError(f"tokenizer: {path} has neither a pad nor an EOS token; training batches need padding")
    return tokenizer


def prepare_examples(config: TrainConfig, tokenizer) -> tuple[list, list]:
    """Load, validate and tokenize the training data; split off (or load) the evaluation set."""
    from memfit.train.data import load_records, tokenize_records

    records, fmt = load_records(config.data, config.data_format)
    eval_records: list = []
    if config.eval_data:
        eval_records, _ = load_records(config.eval_data, config.data_format)
    elif config.eval_split > 0:
        order = list(range(len(records)))
        random.Random(f"memfit-eval-{config.seed}").shuffle(order)
        n_eval = max(1, round(config.eval_split * len(records)))
        if n_eval >= len(records):
            raise TrainError(f"eval_split: {config.eval_split} of {len(records)} records leaves nothing to train on")
        held = set(order[:n_eval])
        eval_records = [records[i] for i in sorted(held)]
        records = [r for i, r in enumerate(records) if i not in held]
    kwargs = dict(seq_len=config.seq_len, train_on_inputs=config.train_on_inputs, packing=config.packing)
    train_examples = tokenize_records(records, tokenizer, **kwargs)
    eval_examples = tokenize_records(eval_records, tokenizer, **kwargs) if eval_records else []
    return train_examples, eval_examples


def check_vocab(examples: list, vocab_size: int, tokenizer) -> None:
    """Every token id must have an embedding row; a tokenizer/model mismatch fails here, clearly."""
    if not vocab_size:
        return
    largest = max((max(e["input_ids"]) for e in examples if e["input_ids"]), default=-1)
    if largest >= vocab_size:
        raise TrainError(
            f"tokenizer: the data has token id {largest} but the model's vocab_size is {vocab_size} "
            f"(the tokenizer has {len(tokenizer)} tokens). Use the model's own tokenizer, or with init: random "
            f"set model_overrides: {{vocab_size: {len(tokenizer)}}}."
        )


def collate_batch(examples: list, pad_id: int) -> dict[str, torch.Tensor]:
    from memfit.train.data import collate

    return collate(examples, pad_token_id=pad_id)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def packed_causal_lm_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    """Loss for packed rows: position ids restart per example and no attention mask is passed, so
    transformers keeps attention within each example (see memfit.train.data.pack_examples)."""
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"], use_cache=False)
    return out.loss


@torch.no_grad()
def evaluate(model, examples: list, batch_size: int, pad_id: int, device: torch.device, loss_fn) -> float:
    """Mean loss over every trained token of ``examples`` (dropout off, no gradients)."""
    was_training = model.training
    model.eval()
    total_loss = 0.0
    total_tokens = 0
    for start in range(0, len(examples), batch_size):
        batch = to_device(collate_batch(examples[start : start + batch_size], pad_id), device)
        # Tokens scored: labels shifted by one, so the first position never counts.
        n = int((batch["labels"][:, 1:] != -100).sum())
        if n == 0:
            continue
        total_loss += float(loss_fn(model, batch)) * n
        total_tokens += n
    if was_training:
        model.train()
    return total_loss / max(total_tokens, 1)


def memory_reading(device: torch.device) -> dict[str, int]:
    """Peak allocated bytes on CUDA; on CPU the process's resident memory and its peak."""
    if device.type == "cuda":
        return {
            "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
        }
    import psutil

    reading = {"rss_bytes": int(psutil.Process().memory_info().rss)}
    try:
        import resource

        reading["peak_rss_bytes"] = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
    except ImportError:  # pragma: no cover - Windows
        pass
    return reading


class Throughput:
    """Tokens per second of the steps (batch collation and the step; logging and evaluation not)."""

    def __init__(self) -> None:
        self._t0 = 0.0
        self._last = (0, 0.0)
        self.tokens = 0
        self.seconds = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self, tokens: int) -> None:
        elapsed = time.perf_counter() - self._t0
        self._last = (tokens, elapsed)
        self.tokens += tokens
        self.seconds += elapsed

    def rate(self) -> float:
        tokens, seconds = self._last
        return tokens / seconds if seconds > 0 else 0.0

    def overall_rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


def handle_oom(model, optimizer, step, checkpoint_now, data_before, rng_before, config, preflight: PreflightResult, device, console) -> OutOfMemory:
    """Free what the failed step held, save the run as it was before that step, explain what to change."""
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    path = None
    if config.step_in_backward:
        # Some parameters were already updated inside the failed backward: the weights are neither
        # before nor after this step, so they are not saved; the last regular checkpoint stands.
        console.print("step_in_backward: the failed step had already updated some weights; no emergency checkpoint "
                      "is saved (continue from the last checkpoint with --resume)", highlight=False)
    else:
        try:
            path = checkpoint_now(step, "oom", data_before, rng_before)
        except Exception as err:  # the checkpoint is a courtesy; the OOM is the error to report
            console.print(f"[red]could not save an emergency checkpoint:[/] {err}", highlight=False)
    plan = preflight.plan
    if plan is None:
        try:
            from memfit.planner.api import plan as make_plan

            plan = make_plan(model_config_dict(config), **config.knobs())
        except Exception:  # planning is advice here; never mask the OOM
            plan = None
    if plan is not None:
        plan.render(console)
    lines = [f"out of device memory at step {step + 1} on {device}."]
    if path is not None:
        lines.append(f"Saved the run as it was before this step to {path}; after changing the config, continue with --resume")
        lines.append("(changing batch_size or grad_accum changes the data order: then start a new run instead).")
    if plan is not None:
        from memfit.planner.runtime import format_bytes

        lines.append(f"The plan predicts {format_bytes(plan.device_total_bytes)} at the peak ({plan.phase}).")
    lines.append("To use less memory:")
    lines += [f"  - {a}" for a in oom_advice(config.knobs())]
    return OutOfMemory("\n".join(lines), path, plan)


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics lines after ``step`` (written after the checkpoint a resume starts from)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    write_atomic(path, "".join(line + "\n" for line in kept))


def write_run_json(run_dir: Path, config: TrainConfig, preflight: PreflightResult, setup, device, steps, **status) -> None:
    """``run.json``: the resolved config, the plan and the run's state, rewritten atomically."""
    import platform

    import transformers

    payload = {
        "config": config.to_json(),
        "spec": config.spec.knobs(),
        "model_config": model_config_dict(config),
        "device": str(device),
        "total_steps": steps,
        "setup": setup,
        "preflight": preflight.to_json(),
        "plan": preflight.plan.to_json() if preflight.plan is not None else None,
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__},
        **status,
    }
    write_atomic(run_dir / RUN_FILE, json.dumps(payload, indent=2, default=str) + "\n")


def save_outputs(model, tokenizer, run_dir: Path, adapters: bool) -> Path:
    """The deliverable: ``adapter/`` (PEFT format) or ``model/`` (full weights), with the tokenizer.

    Written to a temporary folder and renamed into place, replacing an earlier one only once
    complete.
    """
    final = run_dir / (ADAPTER_DIR if adapters else MODEL_DIR)
    tmp = run_dir / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    replace_dir(tmp, final)
    return final


def save_sharded_outputs(model, tokenizer, run_dir: Path, adapters: bool, world) -> Path:
    """:func:`save_outputs` for a sharded model: every rank helps gather the full state dict onto
    rank 0's host, rank 0 writes the folder (temporary name, then renamed)."""
    from memfit.train import distributed as dist_module

    final = run_dir / (ADAPTER_DIR if adapters else MODEL_DIR)
    state = dist_module.full_state_dict(model, trainable_only=adapters)
    if world.is_main:
        tmp = run_dir / f".tmp-{final.name}-{os.getpid()}"
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        model.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        replace_dir(tmp, final)
    del state
    dist_module.barrier()
    return final


class NullLog:
    """Stands in for :class:`MetricsLog` on ranks other than 0."""

    def __enter__(self) -> "NullLog":
        return self

    def write(self, record: dict[str, Any]) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


class MetricsLog:
    """Appends one JSON object a line to ``metrics.jsonl``; mirrors scalars to TensorBoard when the
    ``tensorboard`` package is installed."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / METRICS_FILE
        self._file = None
        self._tb = None
        self._run_dir = run_dir

    def __enter__(self) -> "MetricsLog":
        self._file = open(self.path, "a", encoding="utf-8")
        import importlib.util

        if importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self._run_dir / "tensorboard"))
        return self

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        # Flushed every line: after a crash the metrics up to the crash are on disk.
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def __exit__(self, *exc) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


class StopOnSignal:
    """SIGINT / SIGTERM ask the loop to stop after the current step (and save); a second SIGINT
    stops at once. Handlers are installed only in the main thread and restored on exit."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None and name == "SIGINT":
            raise KeyboardInterrupt
        self.signal_name = name

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                signum = getattr(signal, name)
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class LiveProgress:
    """A Rich progress bar: step, loss, tokens/s and memory."""

    def __init__(self, console, total: int, start: int, enabled: bool = True):
        self.console, self.total, self.start, self.enabled = console, total, start, enabled
        self._progress = None
        self._task = None

    def __enter__(self) -> "LiveProgress":
        if not self.enabled:
            return self
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=False,
        )
        self._progress.__enter__()
        self._task = self._progress.add_task("train", total=self.total, completed=self.start, info="")
        return self

    def update(self, step: int, record: dict[str, Any]) -> None:
        if self._progress is None:
            return
        from memfit.planner.runtime import format_bytes

        memory = record.get("peak_allocated_bytes", record.get("rss_bytes"))
        label = "peak" if "peak_allocated_bytes" in record else "rss"
        info = f"loss {record['loss']:.4f}  {record['tokens_per_second']:.0f} tok/s  {label} {format_bytes(memory) if memory else '-'}"
        self._progress.update(self._task, completed=step, info=info)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
