"""Preference training on several processes (gloo, 2 processes on CPU): DPO, ORPO and SimPO,
each rank on its own pairs, equal to one process on the same global batch."""

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

from trainer_helpers import REPO, read_metrics, save_tiny_pretrained, tiny_config, tiny_settings  # noqa: E402

from memfit.step.preference import PAIR_METRICS  # noqa: E402
from memfit.train.recipe import train  # noqa: E402

WORKER = Path(__file__).with_name("distributed_worker.py")
PAIRS = REPO / "src" / "memfit" / "assets" / "data" / "tiny-preferences.jsonl"
TOLERANCE = 1e-5  # as the SFT runs on two processes (test_distributed.py)
STEPS = 4
#: The runs compared with one process: name -> settings (each also run on one process, batch_size 4).
COMPARED = {
    "dpo-lora": dict(shard="fsdp"),
    "dpo-full": dict(method="full", shard="zero2", lr=2e-3),
    "dpo-precomputed": dict(shard="ddp", precompute_reference=True, eval_split=0.05),
    "dpo-short-batch": dict(shard="fsdp", max_steps=2),  # 5 pairs: the second global batch holds one
}


def _settings(base: Path, out: Path, **changes):
    """A 2-process preference run of the tiny model: 2 pairs a rank = 4 a step, the one-process batch below."""
    values = dict(
        model=str(base),
        init="pretrained",
        model_overrides={},
        data=[str(PAIRS)],
        objective="dpo",
        gpus=2,
        batch_size=2,
        max_steps=STEPS,
        lr=1e-2,
        log_every=1,
    )
    values.update(changes)
    return tiny_settings(out, **values)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One torchrun launch (2 processes) for every sharded run, then the one-process runs with the same global batch."""
    root = tmp_path_factory.mktemp("distributed-preference")
    base = save_tiny_pretrained(root / "base")
    five = root / "five-pairs.jsonl"
    five.write_text("".join(PAIRS.read_text().splitlines(keepends=True)[:5]))
    compared = {
        name: dict(changes, data=[str(five)]) if name == "dpo-short-batch" else changes
        for name, changes in COMPARED.items()
    }
    jobs = [{"settings": _settings(base, root / name, **changes)} for name, changes in compared.items()]
    jobs += [
        {"settings": _settings(base, root / "orpo", objective="orpo", shard="fsdp", beta=0.2)},
        {
            "settings": _settings(
                base,
                root / "simpo",
                objective="simpo",
                method="full",
                shard="fsdp-offload",
                lr=2e-3,
                beta=2.0,
                cpo_alpha=0.5,
            )
        },
    ]
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")]),
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(WORKER),
        str(root / "jobs.json"),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)  # a hang guard only
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    for job, name in zip(jobs, compared):
        single = {
            **job["settings"],
            "gpus": 1,
            "shard": "none",
            "batch_size": 4,
            "output_dir": str(root / f"{name}-single"),
        }
        train(tiny_config(root / f"{name}-single", **single), progress=False)
    return root


def _assert_same(got: list[dict], want: list[dict], names) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for name in names:
        worst = max(abs(a[name] - b[name]) for a, b in zip(got, want))
        assert worst <= TOLERANCE, (name, [a[name] for a in got], [b[name] for b in want])


def _steps(run: Path) -> list[dict]:
    return [r for r in read_metrics(run) if "loss" in r]


# ------------------------------------------------------------------------------------------------
# Two processes against one


def test_dpo_lora_on_two_processes_matches_one_process_losses_metrics_and_adapter(runs):
    from safetensors.torch import load_file

    got, want = _steps(runs / "dpo-lora"), _steps(runs / "dpo-lora-single")
    assert len(got) == STEPS
    # A fresh adapter is the reference: the first step's loss is log 2 on both.
    assert got[0]["loss"] == pytest.approx(0.693147, abs=1e-5)
    _assert_same(got, want, ["loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins"])
    # Sums of log-probs (about -80 a sequence) in fp32, and shares of the same 4 pairs.
    for name in ("logps/chosen", "logps/rejected"):
        assert max(abs(a[name] - b[name]) for a, b in zip(got, want)) <= 1e-4
    assert [r["rewards/accuracies"] for r in got] == [r["rewards/accuracies"] for r in want]
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]  # the global batch's
    sharded = load_file(runs / "dpo-lora" / "adapter" / "adapter_model.safetensors")
    single = load_file(runs / "dpo-lora-single" / "adapter" / "adapter_model.safetensors")
    assert sharded.keys() == single.keys()
    assert max(float((sharded[k] - single[k]).abs().max()) for k in single) <= TOLERANCE
    assert max(float(single[k].abs().max()) for k in single) > 1e-3  # the adapter holds what was trained


def test_dpo_full_fine_tuning_shards_its_frozen_reference_copy_and_matches(runs):
    _assert_same(_steps(runs / "dpo-full"), _steps(runs / "dpo-full-single"), ["loss", "rewards/margins"])
    assert (runs / "dpo-full" / "model" / "model.safetensors").is_file()


def test_precomputed_reference_is_split_over_the_ranks_and_written_once(runs):
    def values(run: Path, split: str) -> tuple[dict, dict]:
        lines = (run / f"reference_logps-{split}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines[1:]]
        return json.loads(lines[0]), {r["index"]: (r["chosen"], r["rejected"]) for r in records}

    for split in ("train", "eval"):
        (head, sharded), (single_head, single) = (
            values(runs / "dpo-precomputed", split),
            values(runs / "dpo-precomputed-single", split),
        )
        assert head == single_head and sharded.keys() == single.keys() == set(range(head["pairs"]))
        assert max(abs(a - b) for k in single for a, b in zip(sharded[k], single[k])) <= TOLERANCE
    got, want = read_metrics(runs / "dpo-precomputed"), read_metrics(runs / "dpo-precomputed-single")
    _assert_same([r for r in got if "loss" in r], [r for r in want if "loss" in r], ["loss", "rewards/margins"])
    evals = [(r["eval_loss"], w["eval_loss"]) for r, w in zip(got, want) if "eval_loss" in r]
    assert evals and all(abs(a - b) <= TOLERANCE for a, b in evals)


def test_a_rank_without_pairs_at_the_end_of_an_epoch_adds_nothing(runs):
    got, want = _steps(runs / "dpo-short-batch"), _steps(runs / "dpo-short-batch-single")
    assert len(got) == 2
    # The second step's global batch holds one pair: rank 1 runs a filler pair that weighs nothing.
    _assert_same(got, want, ["loss", "rewards/chosen", "rewards/rejected", "rewards/margins"])
    assert [r["rewards/accuracies"] for r in got] == [r["rewards/accuracies"] for r in want]


# ------------------------------------------------------------------------------------------------
# The objectives without a reference


@pytest.mark.parametrize("name, extra", [("orpo", ("nll_loss",)), ("simpo", ("nll_loss",))])
def test_orpo_and_simpo_run_on_two_processes_and_log_once(runs, name, extra):
    steps = _steps(runs / name)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))  # rank 0 alone writes metrics.jsonl
    for record in steps:
        assert all(key in record for key in PAIR_METRICS + extra), record
        assert 0.0 <= record["rewards/accuracies"] <= 1.0 and record["loss"] == record["loss"]
    info = json.loads((runs / name / "run.json").read_text())
    assert info["status"] == "completed" and info["world_size"] == 2 and info["spec"]["objective"] == name
