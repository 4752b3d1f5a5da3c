"""Training checkpoints: everything needed to continue a run exactly where it stopped.

A checkpoint is a folder ``<run>/checkpoints/step-00000012/`` holding

- ``trainable.safetensors``: the trainable parameters by name (the LoRA matrices, or every weight
  in full fine-tuning); frozen base weights are not repeated, they come from the model again;
- ``state.pt``: optimizer, lr scheduler and grad scaler state, the RNG states (python, numpy,
  torch CPU, the CUDA device of the run) and the data position (``BatchIterator.state_dict()``);
- ``meta.json``: step, reason (interval, final, interrupt, oom) and time, readable without torch.

It is written under a temporary name (``.tmp-step-<step>-<pid>``) and renamed into place, so a
crash while saving never leaves a half-written checkpoint that ``--resume`` would pick up; the
temporary folders of saves whose process is gone are removed on resume
(:func:`stale_temporary_folders`). A checkpoint whose files were damaged afterwards (a full disk, a
copy cut short) is skipped by :func:`latest_checkpoint`, which falls back to the one before.
Only the last ``keep`` are kept.

A multi-process run (:mod:`memfit.train.distributed`) saves the same folder in another format
(``"format": "dcp"`` in ``meta.json``): the sharded trainable parameters and optimizer states as a
``torch.distributed.checkpoint`` (each rank writes its shards), ``state.pt`` without RNG states, and
``rng-rank<N>.pt`` per rank. Every rank writes into the temporary folder; rank 0 renames it after
a barrier.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.errors import UserError
from memfit.files import apply_umask, process_alive

CHECKPOINTS = "checkpoints"
TRAINABLE_FILE = "trainable.safetensors"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
#: ``meta.json`` format of a sharded (multi-process) checkpoint.
SHARDED_FORMAT = "dcp"
_PREFIX = "step-"


class CheckpointError(UserError, ValueError):
    """A checkpoint is missing, incomplete or does not fit the model being resumed."""


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary folders are ignored)."""
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and (p / META_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def latest_checkpoint(run_dir: str | Path, skipped: list[tuple[Path, str]] | None = None) -> Path | None:
    """The newest checkpoint that is whole (see :func:`checkpoint_problem`), or None.

    Newer ones that are damaged are passed over; each is appended to ``skipped`` with the reason.
    """
    for path in reversed(list_checkpoints(run_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        if skipped is not None:
            skipped.append((path, problem))
    return None


def checkpoint_problem(path: str | Path) -> str | None:
    """Why checkpoint folder ``path`` cannot be resumed from (None when it looks whole).

    Cheap: meta.json is parsed, the safetensors header is read and the file's length checked
    against it, and state.pt must be a complete zip (torch.save's format, whose directory is at the
    end of the file); no tensor is loaded.
    """
    import zipfile

    path = Path(path)
    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
        if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
            return f"{META_FILE} has no step"
    except (OSError, ValueError):
        return f"{META_FILE} is missing or not valid JSON"
    state = path / STATE_FILE
    if not state.is_file() or state.stat().st_size == 0:
        return f"{STATE_FILE} is missing or empty"
    if not zipfile.is_zipfile(state):
        return f"{STATE_FILE} is incomplete (cut short while written or copied)"
    if meta.get("format") == SHARDED_FORMAT:
        return None if (path / ".metadata").is_file() else "the sharded checkpoint's .metadata is missing"
    return _safetensors_problem(path / TRAINABLE_FILE)


def _safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file is damaged: missing, empty, an unreadable header, or shorter than the
    header says (None when whole)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                return f"{path.name} is empty or cut short"
            header_len = int.from_bytes(head, "little")
            if header_len > size - 8:
                return f"{path.name} is cut short (its header runs past the end)"
            header = json.loads(handle.read(header_len))
    except FileNotFoundError:
        return f"{path.name} is missing"
    except (OSError, ValueError):
        return f"{path.name} has an unreadable header"
    ends = [
        entry["data_offsets"][1]
        for key, entry in header.items()
        if key != "__metadata__"
        and isinstance(entry, dict)
        and isinstance(entry.get("data_offsets"), list)
        and len(entry["data_offsets"]) == 2
    ]
    if 8 + header_len + max(ends, default=0) > size:
        return f"{path.name} is cut short ({size:,} bytes, its header describes more)"
    return None


def stale_temporary_folders(run_dir: str | Path) -> list[Path]:
    """Temporary folders that saves of a process now gone left in ``run_dir`` (a checkpoint's
    ``.tmp-step-<step>-<pid>``, an output's ``.tmp-adapter-<pid>``, a replaced folder's
    ``.old-<name>-<pid>``): memfit's by their names, abandoned because no process has that id."""
    run_dir = Path(run_dir)
    found = []
    for folder in (run_dir, run_dir / CHECKPOINTS):
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            match = _TEMPORARY_NAME.match(path.name)
            if match and path.is_dir() and not process_alive(int(match.group(1))):
                found.append(path)
    return sorted(found)


#: ``.tmp-step-00000012-4242``, ``.tmp-adapter-4242``, ``.old-step-00000012-4242``: a pid at the end.
#: (A sharded save's ``.tmp-step-00000012`` has none: every rank writes it; it is replaced by the
#: next save of that step.)
_TEMPORARY_NAME = re.compile(r"^\.(?:tmp|old)-(?:step-\d{8}|adapter|model)-(\d+)$")


# ------------------------------------------------------------------------------------------------
# RNG states


def capture_rng(device: torch.device) -> dict[str, Any]:
    """The state of every random generator the run uses, as plain types (PyTorch's as bytes).

    Plain bytes, not tensors: the loop holds the state of the run before each step all through the
    step, and a tensor there would be memory the step's plan does not have (on a CPU run it is the
    device's memory)."""
    state: dict[str, Any] = {"python": _to_lists(random.getstate()), "torch": _bytes(torch.get_rng_state())}
    if "numpy" in sys.modules:  # only when something already uses numpy: never import it for this
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    if device.type == "cuda":
        state["cuda"] = _bytes(torch.cuda.get_rng_state(device))
    return state


def _bytes(state: torch.Tensor) -> bytes:
    return bytes(state.tolist())


def _state_tensor(state: Any) -> torch.Tensor:
    """An RNG state as PyTorch takes it (checkpoints of earlier versions hold the tensor itself)."""
    if isinstance(state, torch.Tensor):
        return state
    return torch.tensor(list(state), dtype=torch.uint8)


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(_state_tensor(state["torch"]))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(_state_tensor(state["cuda"]), device)


def _to_lists(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_to_lists(v) for v in value]
    return value


# ------------------------------------------------------------------------------------------------
# Saving and loading


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters by name, copied to CPU (tied weights once)."""
    return {name: p.detach().to("cpu").contiguous() for name, p in model.named_parameters() if p.requires_grad}


@dataclass
class TrainingState:
    """What a checkpoint restores besides tensors: the step, data position and RNG states."""

    step: int
    data: dict[str, Any]
    rng: dict[str, Any]
    path: Path


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    grad_scaler: Any,
    data_state: dict[str, Any],
    rng_state: dict[str, Any],
    reason: str,
    keep: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of ``step`` atomically and keep only the last ``keep``; return its folder.

    On a full disk nothing of it is left and the checkpoints before it are whole: :class:`DiskFull`
    says how much it needed and how much is free."""
    from safetensors.torch import save_file

    from memfit.train.disk_space import after_full_disk, folder_bytes, saving, tensor_bytes

    folder = Path(run_dir) / CHECKPOINTS
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / checkpoint_name(step)
    tmp = folder / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    trainable = trainable_state(model)
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "grad_scaler": grad_scaler.state_dict() if grad_scaler is not None else None,
        "data": data_state,
        "rng": rng_state,
    }
    previous = latest_checkpoint(run_dir)
    needed_bytes = max(tensor_bytes(trainable) + tensor_bytes(state), folder_bytes(previous) if previous else 0)
    then = after_full_disk(Path(run_dir), previous, named="The checkpoint before it")
    tmp.mkdir()
    with saving(tmp, what=f"checkpoint {final.name}", needed_bytes=needed_bytes, then=then):
        save_file(trainable, str(tmp / TRAINABLE_FILE))
        # Through a file of ours: closed (and its space freed) however torch.save fails, and a full
        # disk reaches us as the file's OSError (torch's own writer reports a position mismatch).
        with open(tmp / STATE_FILE, "wb") as handle:
            torch.save(state, handle)
        meta = {"step": step, "reason": reason, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")} | (extra or {})
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        apply_umask(tmp)  # safetensors writes owner-only files; give them the user's usual permissions
        _fsync_dir(tmp)
    replace_dir(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def replace_dir(src: Path, dst: Path) -> None:
    """Move folder ``src`` to ``dst``; an existing ``dst`` is removed only once ``src`` is in place."""
    if dst.exists():
        old = dst.with_name(f".old-{dst.name}-{os.getpid()}")
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


def _fsync_dir(folder: Path) -> None:
    for path in folder.iterdir():
        if not path.is_file():
            continue
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    grad_scaler: Any,
    device: torch.device,
) -> TrainingState:
    """Restore the tensors and optimizer/scheduler/scaler states of checkpoint ``path`` in place.

    The RNG states and data position are returned (not applied): the caller restores them at the
    moment the interrupted run had them, right before its next step.
    """
    from safetensors.torch import load_file

    path = Path(path)
    meta = read_meta(path)
    if meta.get("format") == SHARDED_FORMAT:
        n = meta.get("world_size")
        raise CheckpointError(
            f"checkpoint {path} was saved by a run on {n} processes (sharded); resume it the same way: "
            f"set gpus: {n} and start with torchrun --nproc-per-node {n} (or memfit train --nproc {n})"
        )
    for name in (TRAINABLE_FILE, STATE_FILE, META_FILE):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    problem = checkpoint_problem(path)
    if problem:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
    saved = load_file(str(path / TRAINABLE_FILE), device=str(device) if device.type == "cuda" else "cpu")
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    missing = sorted(set(params) - set(saved))
    unexpected = sorted(set(saved) - set(params))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model: {len(missing)} trainable parameters missing "
            f"(first: {missing[:3]}), {len(unexpected)} unknown (first: {unexpected[:3]}). Resume with the "
            "same method, rank, targets and model."
        )
    with torch.no_grad():
        for name, param in params.items():
            if saved[name].shape != param.shape:
                raise CheckpointError(
                    f"checkpoint {path}: {name} has shape {tuple(saved[name].shape)}, the model {tuple(param.shape)}"
                )
            param.copy_(saved[name])
    del saved
    state = torch.load(path / STATE_FILE, map_location=device, weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if grad_scaler is not None and state["grad_scaler"] is not None:
        grad_scaler.load_state_dict(state["grad_scaler"])
    rng = state["rng"]
    # RNG states must be CPU byte tensors whatever map_location did to them.
    rng = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in rng.items()}
    return TrainingState(step=int(state["step"]), data=state["data"], rng=rng, path=path)


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``meta.json`` of checkpoint ``path`` (empty when missing or unreadable)."""
    try:
        return json.loads((Path(path) / META_FILE).read_text())
    except (OSError, ValueError):
        return {}


# ------------------------------------------------------------------------------------------------
# Sharded checkpoints (multi-process runs)


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def _state_dict_options(strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen base weights are not saved (they come from the model again), as in one-process
    # checkpoints; loading then cannot be strict about them (dcp.load already refuses a checkpoint
    # that lacks a trainable tensor).
    return StateDictOptions(ignore_frozen_params=True, strict=strict)


def save_sharded_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    data_state: dict[str, Any],
    rng_state: dict[str, Any],
    reason: str,
    keep: int,
    rank: int,
    world_size: int,
) -> Path:
    """Every rank calls this: write the checkpoint of ``step`` with DCP, atomically; return its folder.

    Rank 0 prepares the temporary folder, every rank writes its shards and RNG state into it, and
    after a barrier rank 0 renames it into place and drops all but the last ``keep``.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = Path(run_dir) / CHECKPOINTS
    final = folder / checkpoint_name(step)
    tmp = folder / f".tmp-{checkpoint_name(step)}"  # one name for every rank
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_state_dict_options())
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(tmp))
    torch.save(rng_state, tmp / _rng_file(rank))
    if rank == 0:
        torch.save(
            {
                "step": step,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "grad_scaler": None,
                "data": data_state,
            },
            tmp / STATE_FILE,
        )
        meta = {
            "step": step,
            "reason": reason,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "format": SHARDED_FORMAT,
            "world_size": world_size,
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    dist.barrier()
    if rank == 0:
        apply_umask(tmp)
        _fsync_dir(tmp)
        replace_dir(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()  # nobody goes on (or reads the folder) before it is in place
    return final


def load_sharded_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    rank: int,
    world_size: int,
) -> TrainingState:
    """Every rank calls this: restore the sharded parameters and optimizer states of ``path`` in place.

    Returns this rank's RNG states and the data position, to be applied right before the next step.
    Raises :class:`CheckpointError` for a one-process checkpoint or another number of processes
    (the global batch, and so the data order, would differ).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    meta = read_meta(path)
    if meta.get("format") != SHARDED_FORMAT:
        raise CheckpointError(
            f"checkpoint {path} was saved by a one-process run; resume it with gpus: 1 (no torchrun), "
            "or start a new run in another output_dir"
        )
    if meta.get("world_size") != world_size:
        raise CheckpointError(
            f"checkpoint {path} was saved by {meta.get('world_size')} processes, this run has {world_size}: "
            f"the global batch and data order would change. Resume with gpus: {meta.get('world_size')}, or start a new run."
        )
    for name in (STATE_FILE, _rng_file(rank)):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_state_dict_options())
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as err:  # noqa: BLE001 - DCP reports missing keys / shapes as a generic CheckpointException
        raise CheckpointError(
            f"checkpoint {path} does not fit this model ({type(err).__name__}: {str(err)[:300]}). Resume with "
            "the same method, rank, targets and model."
        ) from None
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_state_dict_options(strict=False),
    )
    saved = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    if scheduler is not None and saved["scheduler"] is not None:
        scheduler.load_state_dict(saved["scheduler"])
    rng = torch.load(path / _rng_file(rank), map_location="cpu", weights_only=True)
    rng = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in rng.items()}
    return TrainingState(step=int(saved["step"]), data=saved["data"], rng=rng, path=path)
