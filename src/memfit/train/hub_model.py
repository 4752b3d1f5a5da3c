"""``model: org/name`` in a training config: the Hub model, fetched in two steps around the checks.

1. :func:`fetch_small_files`, right after the config is validated: config.json, the generation
   config, the tokenizer and the weights index (a few MB at most). The repo, the revision, access
   and the weights' format are all settled here; the config then points at the snapshot folder, so
   the preflight plan, the data checks and the tokenizer read local files.
2. :func:`fetch_weights`, once the plan says the run fits and the data is tokenized: the weights,
   at the commit step 1 resolved (a branch that moves meanwhile does not mix two commits).

With ``init: random`` only config.json is fetched, once, in step 1. A resumed run uses the commit
its ``run.json`` recorded, so it continues on the weights it started from. With several
processes, rank 0 downloads and the others then read the cache.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memfit.models.catalog import suggestions
from memfit.models.hub import HubError, Snapshot, fetch_config, fetch_model, is_hub_id
from memfit.train.config import TrainConfig


def fetch_small_files(
    config: TrainConfig, *, world, console, resume: bool, run_dir: Path
) -> tuple[TrainConfig, Snapshot | None]:
    """The config with ``model`` pointing at the Hub snapshot, and the snapshot (None for a local model).

    ``init: random`` needs config.json alone; it is fetched once here, so the run reads the
    snapshot's copy from then on and asks the Hub nothing more.
    """
    if not is_hub_id(config.model):
        return config, None
    revision = config.revision
    pinned = recorded_commit(run_dir, config.model) if resume else None
    if pinned is not None and pinned != revision:
        console.print(
            f"resuming on {config.model} at commit {pinned[:12]}, the commit this run started from", highlight=False
        )
        revision = pinned

    def fetch(local_only: bool) -> Snapshot:
        if config.init != "pretrained":
            return fetch_config(config.model, revision, local_only=local_only, suggest=suggestions)
        return fetch_model(
            config.model,
            revision,
            weights=False,
            allow_pickle=config.allow_pickle_weights,
            opt_in="allow_pickle_weights: true",
            local_only=local_only,
            console=console,
            suggest=suggestions,
        )

    snapshot = _rank_zero_first(world, fetch)
    if snapshot.note:
        console.print(f"[yellow]note:[/] {snapshot.note}", highlight=False)
    if pinned is not None:  # the record keeps the revision the config asked for
        snapshot = Snapshot(
            snapshot.repo_id, config.revision or "main", snapshot.commit, snapshot.folder, snapshot.note
        )
    return config.model_copy(update={"model": str(snapshot.folder), "revision": None}), snapshot


def fetch_weights(config: TrainConfig, snapshot: Snapshot, *, world, console, progress: bool = True) -> Path:
    """Download the weights of ``snapshot``'s commit; return the folder the loader reads."""

    def fetch(local_only: bool) -> Snapshot:
        return fetch_model(
            snapshot.repo_id,
            snapshot.commit,
            weights=True,
            allow_pickle=config.allow_pickle_weights,
            opt_in="allow_pickle_weights: true",
            local_only=local_only,
            console=console,
            progress=True if progress else "plain",
        )

    return _rank_zero_first(world, fetch).folder


def recorded_commit(run_dir: Path, repo_id: str) -> str | None:
    """The Hub commit an earlier run in ``run_dir`` trained ``repo_id`` at (from its run.json)."""
    try:
        record = json.loads((Path(run_dir) / "run.json").read_text()).get("hub") or {}
    except (OSError, ValueError, AttributeError):
        return None
    return record.get("commit") if str(record.get("repo_id", "")).lower() == repo_id.lower() else None


def _rank_zero_first(world, fetch: Callable[[bool], Any]):
    """Run ``fetch`` on rank 0 (downloading), then on the other ranks from the cache only.

    Every rank raises the same TrainError when rank 0's fetch fails.
    """
    from memfit.train import distributed as dist_module
    from memfit.train.errors import TrainError

    result, problem = None, None
    if world.is_main:
        try:
            result = fetch(False)
        except HubError as err:
            problem = str(err)
    if world.distributed:
        problem = dist_module.first_error(problem)  # a collective: the other ranks wait for rank 0 here
    if problem:
        raise TrainError(f"model: {problem}")
    if not world.is_main:
        try:
            result = fetch(True)
        except HubError as err:
            raise TrainError(f"model: {err}") from None
    return result
