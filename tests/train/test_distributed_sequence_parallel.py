"""Sequence parallelism on CPU (gloo, 2 processes sharing each row): the losses and the update of one
process, and each rank's memory equal to its plan to the byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
if not torch.distributed.is_available():  # pragma: no cover - depends on the build
    pytest.skip("this PyTorch has no torch.distributed", allow_module_level=True)

from trainer_helpers import read_metrics, save_tiny_pretrained, step_losses, tiny_config, tiny_settings  # noqa: E402

from memfit.train.recipe import train  # noqa: E402

WORKER = Path(__file__).with_name("distributed_worker.py")
RANK_WORKER = Path(__file__).with_name("sequence_parallel_worker.py")
TOLERANCE = 1e-4
LORA = dict(max_steps=4)
# Plain SGD: the weights after a step are the starting weights less lr x the gradient.
FULL_SGD = dict(method="full", optimizer="sgd", lr=0.5, warmup_steps=0, max_steps=1, max_grad_norm=None)


def _torchrun(worker: Path, *args: Path) -> None:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(worker.parent), os.environ.get("PYTHONPATH", "")]),
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(worker)]
    done = subprocess.run(
        [*command, *map(str, args)], env=env, capture_output=True, text=True, timeout=1800
    )  # a hang guard only
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One torchrun launch (2 processes, one group sharing each row), and the same runs on one process."""
    root = tmp_path_factory.mktemp("sequence-parallel")
    base = save_tiny_pretrained(root / "base")
    common = dict(model=str(base), init="pretrained", model_overrides={}, batch_size=3)
    sharded = dict(common, gpus=2, shard="fsdp", sequence_parallel=2)
    jobs = [
        {"settings": tiny_settings(root / "sp-lora", **sharded, **LORA)},
        {"settings": tiny_settings(root / "sp-full", **sharded, **FULL_SGD)},
    ]
    (root / "jobs.json").write_text(json.dumps(jobs))
    _torchrun(WORKER, root / "jobs.json")
    train(tiny_config(root / "one-lora", **common, **LORA), progress=False)
    train(tiny_config(root / "one-full", **common, **FULL_SGD), progress=False)
    return root


def test_two_ranks_sharing_each_row_log_the_losses_of_one_process(runs):
    got, want = step_losses(runs / "sp-lora"), step_losses(runs / "one-lora")
    assert got.keys() == want.keys() == set(range(1, LORA["max_steps"] + 1))
    assert max(abs(got[k] - want[k]) for k in want) <= TOLERANCE, (got, want)
    # every example's tokens are counted once (not once per rank, nor the shards' filler)
    assert [r["tokens"] for r in read_metrics(runs / "sp-lora") if "loss" in r] == [
        r["tokens"] for r in read_metrics(runs / "one-lora") if "loss" in r
    ]


def test_two_ranks_sharing_each_row_take_the_gradient_of_one_process(runs):
    from safetensors.torch import load_file

    base = load_file(runs / "base" / "model.safetensors")
    got = load_file(runs / "sp-full" / "model" / "model.safetensors")
    want = load_file(runs / "one-full" / "model" / "model.safetensors")
    assert set(want) <= set(got)  # (the sharded run writes the tied head's tensor too)
    lr = FULL_SGD["lr"]
    for name in want:
        grad_one, grad_two = (base[name] - want[name]) / lr, (base[name] - got[name]) / lr
        assert torch.allclose(grad_two, grad_one, atol=TOLERANCE, rtol=1e-3), name
    moved = sum(float((base[n] - want[n]).abs().sum()) for n in want)
    assert moved > 0  # the step did change the weights
    assert abs(step_losses(runs / "sp-full")[1] - step_losses(runs / "one-full")[1]) <= TOLERANCE


# ------------------------------------------------------------------------------------------------
# Each rank against its plan

#: The planner's tiny Llama (4 query heads, 2 key / value heads: one each per rank) on 2 GPUs.
PLANNED = dict(gpus=2, shard="fsdp", sequence_parallel=2, seq_len=64, precision="fp32")
RANK_JOBS = [
    {"name": "lora", "spec": dict(PLANNED, method="lora")},
    {"name": "full-accum", "spec": dict(PLANNED, method="full", grad_accum=2)},
]


@pytest.fixture(scope="module")
def rank_peaks(tmp_path_factory):
    """Each rank's planned and measured peaks, by job name and rank."""
    root = tmp_path_factory.mktemp("sequence-parallel-ranks")
    (root / "jobs.json").write_text(json.dumps(RANK_JOBS))
    _torchrun(RANK_WORKER, root / "jobs.json", root)
    return {
        (job["name"], rank): json.loads((root / f"{job['name']}-rank{rank}.json").read_text())
        for job in RANK_JOBS
        for rank in (0, 1)
    }


@pytest.mark.parametrize("job", [job["name"] for job in RANK_JOBS])
def test_each_rank_of_the_group_peaks_at_its_plan_to_the_byte(rank_peaks, job):
    for rank in (0, 1):
        got = rank_peaks[job, rank]
        assert got["real"] == got["planned"], (rank, got)
        assert got["exchanges"] > 0  # the real run's all-to-alls went through gloo
        assert got["real"]["categories"]["gradients"] > 0 and got["real"]["categories"]["activations"] > 0
