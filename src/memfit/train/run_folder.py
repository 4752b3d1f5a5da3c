"""The run folder: refusing to write over another run, ``run.json``, and the deliverable.

A run folder holds ``run.json`` (the resolved config, the plan and how the run ended),
``metrics.jsonl``, ``memory.jsonl``, ``checkpoints/`` and, once finished, ``adapter/`` (PEFT format)
or ``model/`` (full weights). Every file memfit rewrites is written under a temporary name and
renamed into place.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
from pathlib import Path
from typing import Any

from memfit.files import apply_umask, check_folder_writable, make_folder, write_atomic
from memfit.run_files import METRICS_FILE, RUN_FILE
from memfit.train.checkpointing import (
    latest_checkpoint,
    replace_dir,
    stale_temporary_folders,
)
from memfit.train.errors import TrainError

ADAPTER_DIR = "adapter"
MODEL_DIR = "model"


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """Raise TrainError unless ``run_dir`` can hold this run (a new one, or one to resume), and
    :class:`~memfit.errors.PathError` when it cannot be written (before any work starts)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainError(f"output_dir {str(run_dir)!r} is a file, not a folder: choose a folder path (--output-dir).")
    if resume:
        if not (run_dir / RUN_FILE).is_file():
            raise TrainError(f"--resume: {run_dir} holds no run to resume (no {RUN_FILE}); check output_dir")
        check_folder_writable(run_dir, "output_dir")
        return
    check_folder_writable(run_dir, "output_dir")
    if run_dir.exists() and any(run_dir.iterdir()):
        if not (run_dir / RUN_FILE).is_file():
            raise TrainError(
                f"output_dir {str(run_dir)!r} holds files and is not a memfit run folder (it has no {RUN_FILE}): memfit "
                "will not write into it. Choose a new folder for the run (-o / --output-dir), one that does not exist yet."
            )
        if latest_checkpoint(run_dir) is None:
            raise TrainError(
                f"output_dir {str(run_dir)!r} holds an earlier run that saved no checkpoint, so it cannot be "
                "resumed. Choose another output_dir (--output-dir), or delete that folder first."
            )
        raise TrainError(
            f"output_dir {str(run_dir)!r} already holds files. Continue that run with --resume, or choose "
            "another output_dir (--output-dir); memfit never writes over an earlier run."
        )


def make_run_dir(run_dir: Path, resume: bool) -> list[Path]:
    """Create the run folder for a new run (a resumed one exists already); return the folders
    created, for :func:`memfit.files.remove_if_empty` should the run fail before writing anything."""
    return [] if resume else make_folder(run_dir)


def remove_stale_folders(run_dir: Path) -> list[Path]:
    """Remove the temporary folders that interrupted saves left (their process is gone, see
    :func:`memfit.train.checkpointing.stale_temporary_folders`); return what was removed."""
    removed = stale_temporary_folders(run_dir)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def finished_run(run_dir: Path, config) -> dict[str, Any] | None:
    """What an earlier run in ``run_dir`` delivered, when it completed the same schedule ``config``
    asks for and its output is in place (a ``--resume`` then has nothing to do); None otherwise."""
    try:
        record = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("status") != "completed":
        return None
    recorded = record.get("config") if isinstance(record.get("config"), dict) else {}
    if (recorded.get("max_steps"), recorded.get("epochs")) != (config.max_steps, config.epochs):
        return None  # a longer schedule: the run continues from its last checkpoint
    output = output_dir(run_dir, config.spec.uses_adapters)
    if not output.is_dir():
        return None
    return {"step": record.get("step"), "total_steps": record.get("total_steps"), "output_dir": output}


class RunRecord:
    """``run.json``: what does not change during the run, written again with each status change.

    ``enabled`` is False on ranks other than 0: one process writes the run's shared files.
    """

    def __init__(self, run_dir: Path, fields: dict[str, Any], *, enabled: bool = True) -> None:
        self.path = run_dir / RUN_FILE
        self.fields = fields
        self.enabled = enabled

    @classmethod
    def for_run(
        cls,
        run_dir: Path,
        *,
        config,
        model_config: dict[str, Any],
        preflight,
        setup: dict[str, Any],
        device,
        total_steps: int,
        extra: dict[str, Any],
        enabled: bool,
    ) -> RunRecord:
        import torch
        import transformers

        fields = {
            "config": config.to_dict(),
            "spec": config.spec.knobs(),
            "model_config": model_config,
            "device": str(device),
            "total_steps": total_steps,
            "setup": setup,
            "preflight": preflight.to_dict(),
            "plan": preflight.plan.to_dict() if preflight.plan is not None else None,
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            },
            **extra,
        }
        return cls(run_dir, fields, enabled=enabled)

    def write(self, **status: Any) -> None:
        """Rewrite ``run.json`` (atomically) with the fixed fields and ``status``."""
        if self.enabled:
            write_atomic(self.path, json.dumps({**self.fields, **status}, indent=2, default=str) + "\n")


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop metrics lines after ``step`` (written after the checkpoint a resume starts from)."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    write_atomic(path, "".join(line + "\n" for line in kept))


def first_logged_loss(run_dir: Path) -> tuple[int, float] | None:
    """(step, loss) of the first training loss in ``run_dir``'s ``metrics.jsonl``: where the run
    began, also after it was resumed (a resumed process sees only its own steps). None without one."""
    path = run_dir / METRICS_FILE
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(record, dict) and isinstance(record.get("loss"), (int, float)) and "step" in record:
            return int(record["step"]), float(record["loss"])
    return None


def output_dir(run_dir: Path, adapters: bool) -> Path:
    """Where the deliverable goes: ``adapter/`` for LoRA / QLoRA, ``model/`` for full fine-tuning."""
    return run_dir / (ADAPTER_DIR if adapters else MODEL_DIR)


def write_outputs(model, tokenizer, run_dir: Path, adapters: bool, state_dict: dict[str, Any] | None = None) -> Path:
    """Save the model (PEFT adapter or full weights) with the tokenizer into the run folder.

    Written to a temporary folder and renamed into place, replacing an earlier one only once
    complete; on a full disk the temporary folder is removed and :class:`DiskFull` says how much it
    needed and how much is free. ``state_dict``: the weights to write (a sharded run gathers them first).
    """
    from memfit.train.disk_space import after_full_disk, folder_bytes, saving, tensor_bytes

    final = output_dir(run_dir, adapters)
    tmp = run_dir / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    extra = {"state_dict": state_dict} if state_dict is not None else {}
    if state_dict is not None:
        weights = state_dict
    else:
        weights = [p for p in model.parameters() if p.requires_grad] if adapters else model.state_dict()
    then = after_full_disk(run_dir, latest_checkpoint(run_dir), then=f" to write the {final.name}")
    with saving(tmp, what=f"the {final.name}", needed_bytes=tensor_bytes(weights), then=then) as need:
        tokenizer.save_pretrained(str(tmp))  # first: small, and then its size is known to a full disk's message
        need.bytes += folder_bytes(tmp)
        model.save_pretrained(str(tmp), safe_serialization=True, **extra)
        apply_umask(tmp)  # safetensors writes owner-only files; the deliverable gets the user's usual permissions
    replace_dir(tmp, final)
    return final
