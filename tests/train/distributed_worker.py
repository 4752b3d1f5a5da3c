"""One rank of multi-process test runs: ``torchrun --nproc-per-node N distributed_worker.py JOBS.json``.

JOBS.json is a list of runs done one after another in the same process group (one launch is
several seconds, so the tests share one). Each job: ``settings`` (a train config dict), and
optionally ``resume`` (continue the run), ``interrupt_at`` (rank 0 receives SIGTERM during that
step: every rank must stop after it, with a checkpoint) and ``logits`` (rank 0 saves the trained
sharded model's logits on fixed ids to that path).
"""

from __future__ import annotations

import json
import os
import signal
import sys


def run_job(job: dict, world) -> None:
    import torch

    from memfit.step import train_step as step_module
    from memfit.train.config import validate_config
    from memfit.train.recipe import train

    real_step = step_module.train_step
    calls = {"n": 0}

    def step_with_interrupt(*args, **kwargs):
        calls["n"] += 1
        if world.is_main and calls["n"] == job.get("interrupt_at"):
            os.kill(os.getpid(), signal.SIGTERM)  # caught by the loop: stop after this step
        return real_step(*args, **kwargs)

    step_module.train_step = step_with_interrupt
    try:
        result = train(validate_config(job["settings"]), resume=bool(job.get("resume")), progress=False)
    finally:
        step_module.train_step = real_step
    if job.get("logits"):
        ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits = result.model.eval()(input_ids=ids).logits  # every rank: the forward is a collective
        if world.is_main:
            torch.save({"ids": ids, "logits": logits}, job["logits"])


def main(argv: list[str]) -> int:
    from memfit.train import distributed

    jobs = json.loads(open(argv[0]).read())
    world = distributed.placement_from_env()
    distributed.init_distributed(world, "cpu")  # joined here, so models stay usable after train()
    try:
        for job in jobs:
            run_job(job, world)
    finally:
        distributed.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
