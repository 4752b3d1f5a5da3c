"""One rank of the per-rank plan check: ``torchrun --nproc-per-node 2 sequence_parallel_worker.py JOBS.json OUT``.

JOBS.json is a list of ``{"name": ..., "spec": {make_spec's keywords}}``. For each, every rank
plans the step (fake tensors, one process standing for the group, as ``memfit plan`` does) and runs
the same step on real CPU tensors under the planner's tracker, placed in the real sequence-parallel
group (its all-to-alls over gloo); it writes both peaks to ``OUT/NAME-rankR.json``.

gloo's worker thread holds a collective's tensors past the call's return and drops them when that
thread gets to it, so a buffer the step frees right after an all-to-all (its input) would die at a
moment another thread decides: one rank's peak held it or not from run to run. The check hands
gloo copies the tracker does not see (:func:`gloo_outside_the_tracker`), so every buffer the step
itself allocates (the exchange's output, the input it drops) lives and dies on the step's thread.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path


@contextlib.contextmanager
def gloo_outside_the_tracker(sent: list):
    """``all_to_all_single`` through staging copies made with the tracker (a dispatch mode) off;
    ``sent`` gets each exchange's bytes."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import _disable_current_modes

    real = dist.all_to_all_single

    def staged(output, input, *args, **kwargs):
        with _disable_current_modes():
            send, received = input.clone(), torch.empty_like(output)
            work = real(received, send, *args, **kwargs)
            output.copy_(received)
        sent.append(input.nbytes)
        return work

    dist.all_to_all_single = staged
    try:
        yield
    finally:
        dist.all_to_all_single = real


def _peak(result) -> dict:
    return {"allocated": result.tracker.peak.allocated_bytes, "categories": result.tracker.peak.categories}


def run_job(job: dict, rank: int, out: Path) -> None:
    import torch.distributed as dist

    from memfit.planner.exact import simulate as simulate_module
    from memfit.spec import make_spec
    from memfit.train.conformance import TINY_MODELS

    spec = make_spec(**job["spec"])
    model = TINY_MODELS["llama"]
    planned = simulate_module.simulate(model, spec, fake=True)
    build_step = simulate_module.build_step
    # The planner's step, placed as the trainer places it (world.py): this rank of the real group.
    simulate_module.build_step = lambda *a, **k: build_step(*a, **k).in_sequence_group(rank, dist.group.WORLD)
    try:
        sent: list[int] = []
        with gloo_outside_the_tracker(sent):
            real = simulate_module.simulate(model, spec, fake=False)
    finally:
        simulate_module.build_step = build_step
    (out / f"{job['name']}-rank{rank}.json").write_text(
        json.dumps({"planned": _peak(planned), "real": _peak(real), "exchanges": len(sent)})
    )


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    from memfit.train.distributed import placement_from_env

    placement = placement_from_env()
    dist.init_process_group("gloo", rank=placement.rank, world_size=placement.world_size)
    try:
        for job in json.loads(Path(argv[0]).read_text()):
            run_job(job, placement.rank, Path(argv[1]))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
