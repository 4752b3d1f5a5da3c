"""``precompute_reference``: DPO's reference log-probs in one pass before training, kept in the run folder.

Each pair's reference log-probs (chosen, rejected) come from the starting model: the base with its
adapters disabled (LoRA, QLoRA) or the model before any update (full fine-tuning, which then keeps
no frozen copy). They are appended to ``reference_logps-<split>.jsonl`` in the run folder a
micro-batch at a time, so that a pass that stops part way continues where it stopped
(``memfit train --resume``), and a resumed run reads them instead of computing them again (it
could not: its weights have moved). The file names the data it was computed for (a fingerprint of
the pairs' tokens): other data is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memfit.step.batch import to_device
from memfit.step.preference import starting_logps
from memfit.train.distributed import rank_slice
from memfit.train.errors import TrainError

#: The file of a split's reference log-probs, in the run folder.
REFERENCE_FILE = "reference_logps-{split}.jsonl"


def reference_file(run_dir: Path, split: str) -> Path:
    return Path(run_dir) / REFERENCE_FILE.format(split=split)


def fingerprint(pairs: list[dict[str, Any]]) -> str:
    """A digest of the pairs' token ids and labels, in order: the data the log-probs belong to."""
    digest = hashlib.sha256()
    for pair in pairs:
        for name in ("chosen", "rejected"):
            digest.update(json.dumps([pair[name]["input_ids"], pair[name]["labels"]]).encode())
    return digest.hexdigest()[:32]


def stored_logps(path: Path, pairs: list[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    """The reference log-probs already in ``path`` for ``pairs``, by pair index ({} when there is no file).

    Raises TrainError when the file was computed for other data."""
    if not path.is_file():
        return {}
    found: dict[int, tuple[float, float]] = {}
    expected = fingerprint(pairs)
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                record = json.loads(line)
            except ValueError:
                break  # a line cut short by a stop: computed again
            if number == 1:
                if record.get("fingerprint") != expected or record.get("pairs") != len(pairs):
                    raise TrainError(
                        f"{path} holds the reference log-probs of other data ({record.get('pairs')} pairs, not "
                        f"{len(pairs)}, or other tokens): the data or seq_len changed since it was computed. Train "
                        "with the data the run started with, or start a new run in another output_dir."
                    )
                continue
            found[int(record["index"])] = (float(record["chosen"]), float(record["rejected"]))
    return found


def precompute_reference(
    pairs: list[dict[str, Any]],
    *,
    split: str,
    run_dir: Path,
    model: torch.nn.Module,
    collate: Callable[[list], dict[str, Any]],
    batch_size: int,
    device: torch.device,
    adapters: bool,
    dtype: torch.dtype | None,
    may_compute: bool = True,
    world: Any,
    say: Callable[[str], None] = print,
) -> int:
    """Give every pair its ``ref_logps`` (chosen, rejected): read from the run folder, the rest
    computed with ``model`` as it starts (``adapters``: with them disabled) and stored. Returns how
    many pairs were computed now. ``may_compute`` is False once training changed the weights: then
    every value must be stored already.

    ``world``: the run's (:mod:`memfit.train.world`). On the ranks of a sharded run each rank
    computes every ``world_size``-th pair of each round of ``batch_size x world_size``, through the
    sharded model's root; every rank gets every value, and rank 0 writes the file."""
    path = reference_file(run_dir, split)
    stored = stored_logps(path, pairs)
    # Every rank has read the file before rank 0 writes to it.
    world.gather_objects(None)
    missing = [i for i in range(len(pairs)) if i not in stored]
    if missing and not may_compute:
        raise TrainError(
            f"{path} lacks the reference log-probs of {len(missing)} of {len(pairs)} {split} pairs, and the run's "
            "weights have moved since they were computed. Start a new run in another output_dir."
        )
    if missing:
        say(
            f"reference log-probs: computing {len(missing)} of {len(pairs)} {split} pairs before training"
            + (f" ({len(stored)} already in {path.name})" if stored else "")
        )
        logps = world.root_forward(
            model,
            "memfit_starting_logps",
            lambda root, batch: starting_logps(root, batch, adapters=adapters, dtype=dtype),
        )
        _compute(
            pairs,
            missing,
            path=path,
            fresh=not stored,
            model=model,
            logps=logps,
            collate=collate,
            batch_size=batch_size,
            device=device,
            stored=stored,
            world=world,
        )
    for index, pair in enumerate(pairs):
        pair["ref_logps"] = stored[index]
    return len(missing)


def _compute(pairs, missing, *, path, fresh, model, logps, collate, batch_size, device, stored, world) -> None:
    was_training = model.training
    model.eval()  # the starting model as a reference: no dropout
    try:
        with (
            open(path, "w" if fresh else "a", encoding="utf-8") if world.is_main else contextlib.nullcontext()
        ) as handle:
            if fresh and handle is not None:
                handle.write(json.dumps({"fingerprint": fingerprint(pairs), "pairs": len(pairs)}) + "\n")
            per_round = batch_size * world.world_size
            for start in range(0, len(missing), per_round):
                indices = missing[start : start + per_round]
                mine = rank_slice(indices, world.rank, world.world_size)
                # A rank without pairs in the last round still runs the forward (a collective), on a
                # pair whose values it drops.
                batch = to_device(collate([pairs[i] for i in mine or indices[:1]]), device)
                chosen, rejected = logps(batch).float().cpu().chunk(2)
                for part in world.gather_objects(list(zip(mine, chosen.tolist(), rejected.tolist()))):
                    for index, c, r in part:
                        stored[index] = (c, r)
                        if handle is not None:
                            handle.write(json.dumps({"index": index, "chosen": c, "rejected": r}) + "\n")
                # On disk after every round: a pass that stops continues from here.
                if handle is not None:
                    handle.flush()
    finally:
        model.train(was_training)
