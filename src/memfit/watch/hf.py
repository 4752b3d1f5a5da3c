""":class:`MemoryCallback`: memfit's memory recorder inside a Hugging Face ``Trainer``.

::

    import memfit.watch
    trainer = Trainer(..., callbacks=[memfit.watch.MemoryCallback("runs/my-run")])

Works with ``transformers.Trainer`` and the trainers built on it (TRL's ``SFTTrainer``...). Writes
``memory.jsonl`` (and the logged loss to ``metrics.jsonl``) in the run folder, warns through the
``memfit.watch`` logger while training, and leaves the folder ready for ``memfit doctor`` and
``memfit report``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from memfit.run_files import METRICS_FILE, memory_file_name
from memfit.watch.recorder import MemoryRecorder
from memfit.watch.thresholds import Thresholds
from memfit.watch.timeline import Finding

log = logging.getLogger("memfit.watch")


class MemoryCallback(TrainerCallback):
    """Record memory every optimizer step of a ``Trainer`` and warn about leaks, stray devices,
    checkpointing that is off, weights that should be frozen, and fragmentation.

    Args:
        run_dir: where to write ``memory.jsonl`` and ``metrics.jsonl``; default the Trainer's
            ``output_dir``.
        plan: the run's :class:`~memfit.planner.report.MemoryPlan` (``memfit.plan(...)``), for
            predicted-versus-measured; optional.
        expected_device: the device(s) the run should use; default what ``TrainingArguments`` says
            (``args.device``; every GPU for single-process multi-GPU).
        spec: the run's knobs (RunSpec or dict: ``method``, ``checkpointing``...); default
            checkpointing from ``args.gradient_checkpointing`` and the method inferred from the model.
        attribute_steps: steps measured by category at the start (0: none; the tracker slows them).
        check_every, thresholds, devices: as for :class:`~memfit.watch.recorder.MemoryRecorder`.
        inspect: check the model as it trains (:func:`memfit.watch.detectors.inspect_model`), at
            its first training forward pass: the Trainer puts the model in training mode inside its
            first step, after ``on_train_begin`` and ``on_step_begin`` (a model still in eval mode
            there is not a problem).
    """

    def __init__(
        self,
        run_dir: str | Path | None = None,
        *,
        plan: Any = None,
        expected_device: Any = None,
        spec: Any = None,
        attribute_steps: int = 2,
        check_every: int = 10,
        thresholds: Thresholds = Thresholds(),
        devices: list[str | int] | None = None,
        inspect: bool = True,
    ) -> None:
        if attribute_steps < 0:
            raise ValueError(f"attribute_steps: {attribute_steps} must be 0 (off) or more")
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.plan, self.expected_device, self.spec = plan, expected_device, spec
        self.attribute_steps, self.check_every, self.thresholds = attribute_steps, check_every, thresholds
        self.devices, self.inspect = devices, inspect
        self.recorder: MemoryRecorder | None = None
        self.findings: list[Finding] = []
        self._hook = None
        self._inspect_hook = None
        self._spec = None
        self._metrics = None
        self._attributed = False

    # ---------------------------------------------------------------------------- start and end
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        run_dir = self.run_dir or Path(args.output_dir)
        rank = int(getattr(args, "process_index", 0) or 0)
        spec = self.spec if self.spec is not None else {"checkpointing": "on" if args.gradient_checkpointing else "off"}
        self.recorder = MemoryRecorder(
            run_dir,
            devices=self.devices,
            plan=self.plan,
            expected_device=self.expected_device if self.expected_device is not None else _trainer_devices(args),
            total_steps=int(state.max_steps) if state.max_steps and state.max_steps > 0 else None,
            spec=spec,
            config=trainer_config(args, model),
            thresholds=self.thresholds,
            check_every=self.check_every,
            resumed_from_step=int(state.global_step) if state.global_step else None,
            source="hf-trainer",
            file_name=memory_file_name(rank),
        )
        if rank == 0:
            self._metrics = open(run_dir / METRICS_FILE, "a", encoding="utf-8")
        if model is not None:
            if self.inspect:
                self._spec = spec
                self._inspect_hook = model.register_forward_pre_hook(self._first_forward)
            # The Trainer has no callback between forward and backward; the end of the model's
            # forward is that moment (the loss is computed from its output right after).
            self._hook = model.register_forward_hook(self._forward_done)

    def on_train_end(self, args, state, control, **kwargs):
        for hook in (self._hook, self._inspect_hook):
            if hook is not None:
                hook.remove()
        self._hook = self._inspect_hook = None
        if self.recorder is not None:
            self._warn(self.recorder.close())
            self.recorder = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    # ---------------------------------------------------------------------------- the step
    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.recorder is None:
            return
        if not self._attributed and self.attribute_steps and model is not None:
            self._attributed = True
            self.recorder.attribute(model, optimizer, steps=self.attribute_steps)
        self.recorder.observer.on_phase("forward")

    def on_substep_end(self, args, state, control, **kwargs):
        # One micro-batch of a gradient-accumulation step is done; the next one's forward starts.
        if self.recorder is not None:
            self.recorder.observer.on_phase("forward")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.recorder is not None:
            self.recorder.observer.on_phase("optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.recorder is not None:
            self.recorder.observer.on_phase("idle")

    def on_step_end(self, args, state, control, **kwargs):
        if self.recorder is not None:
            self._warn(self.recorder.end_step(int(state.global_step)))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._metrics is None or not logs:
            return
        record = {"step": int(state.global_step)}
        record.update({k: v for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()

    def _first_forward(self, module, inputs) -> None:
        """Inspect the model once, at its first forward pass in training mode: what it trains as."""
        import torch

        if self.recorder is None or not (module.training and torch.is_grad_enabled()):
            return  # an evaluation pass (or none yet): the model as it trains is what counts
        if self._inspect_hook is not None:
            self._inspect_hook.remove()
            self._inspect_hook = None
        self._warn(self.recorder.inspect(module, self._spec))

    def _forward_done(self, module, inputs, output) -> None:
        import torch

        if self.recorder is not None and module.training and torch.is_grad_enabled():
            self.recorder.observer.on_phase("backward")

    def _warn(self, findings: list[Finding]) -> None:
        for finding in findings:
            self.findings.append(finding)
            log.warning("memfit: %s %s", finding.message, finding.fix)


def _trainer_devices(args) -> list[str]:
    """The devices a Trainer uses: ``args.device``, or every GPU when one process drives several
    (``torch.nn.DataParallel``, ``args.n_gpu > 1``)."""
    device = args.device
    if device.type == "cuda" and int(getattr(args, "n_gpu", 1) or 1) > 1:
        return [f"cuda:{i}" for i in range(args.n_gpu)]
    if device.type == "cuda" and device.index is None:
        return ["cuda:0"]
    return [str(device)]


#: The TrainingArguments ``memfit report`` shows, under their own names (where transformers renamed
#: one, the newer name first).
TRAINER_SETTINGS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "warmup_ratio",
    "weight_decay",
    "max_grad_norm",
    "num_train_epochs",
    "max_steps",
    "optim",
    "bf16",
    "fp16",
    ("activation_checkpointing", "gradient_checkpointing"),
    ("eval_strategy", "evaluation_strategy"),
    "eval_steps",
    "seed",
)


def trainer_config(args, model: Any = None) -> dict[str, Any]:
    """The run's configuration under the names its libraries use: the model's name and size, the
    LoRA settings of a PEFT model (``r``, ``lora_alpha``...), and the Trainer's settings."""
    config: dict[str, Any] = {}
    if model is not None:
        name = getattr(getattr(model, "config", None), "_name_or_path", None)
        config["model"] = str(name) if name else type(model).__name__
        parameters = list(model.parameters())
        config["parameters"] = sum(p.numel() for p in parameters)
        config["trainable parameters"] = sum(p.numel() for p in parameters if p.requires_grad)
        peft_config = getattr(model, "peft_config", None)
        adapter = next(iter(peft_config.values()), None) if isinstance(peft_config, dict) else None
        for key in ("peft_type", "r", "lora_alpha", "lora_dropout", "target_modules"):
            value = getattr(adapter, key, None)
            if value is not None:
                config[key] = _plain(value)
    for names in TRAINER_SETTINGS:
        key = next((n for n in ((names,) if isinstance(names, str) else names) if hasattr(args, n)), None)
        value = getattr(args, key, None) if key else None
        if value is not None and not (key == "max_steps" and value <= 0):
            config[key] = _plain(value)
    return config


def _plain(value: Any) -> Any:
    """A JSON value: enums by their value, sets as sorted lists."""
    if isinstance(value, (set, frozenset, list, tuple)):
        return sorted(str(v) for v in value) if isinstance(value, (set, frozenset)) else [str(v) for v in value]
    value = getattr(value, "value", value)  # IntervalStrategy.STEPS -> "steps"
    return value if isinstance(value, (str, int, float, bool)) else str(value)
