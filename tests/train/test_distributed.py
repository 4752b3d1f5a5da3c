"""Multi-process training on CPU (gloo, 2 processes): same losses as one process, resume, export."""

from __future__ import annotations

import importlib.util
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

from trainer_helpers import (  # noqa: E402
    read_metrics,
    save_tiny_pretrained,
    step_losses,
    tiny_config,
    tiny_settings,
)

from memfit.run_files import memory_file_name  # noqa: E402
from memfit.train import distributed  # noqa: E402
from memfit.train.config import ConfigError  # noqa: E402
from memfit.train.distributed import DistributedError, Placement  # noqa: E402
from memfit.train.recipe import TrainError, train  # noqa: E402

WORKER = Path(__file__).with_name("distributed_worker.py")
TOLERANCE = 1e-5
STEPS = 6
FULL = dict(method="full", lr=2e-3)
QLORA = dict(method="qlora", precision="bf16", max_steps=3, lr=1e-2)
MOE_LORA = dict(targets=["experts", "q_proj"], max_steps=4)
MOE_QLORA = dict(method="qlora", precision="bf16", targets=["experts"], max_steps=3, lr=1e-2)


def _settings(base: Path, out: Path, **changes):
    """A 2-process run of the tiny model: 2 examples a rank = 4 a step, the one-process batch below."""
    values = dict(
        model=str(base), init="pretrained", model_overrides={}, gpus=2, shard="fsdp", batch_size=2, max_steps=STEPS
    )
    values.update(changes)
    return tiny_settings(out, **values)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One torchrun launch (2 processes) for every sharded run the tests look at, and the
    one-process runs with the same global batch (batch_size 4)."""
    root = tmp_path_factory.mktemp("distributed")
    base = save_tiny_pretrained(root / "base")
    moe = _save_tiny_moe(root / "moe-base")
    jobs = [
        {"settings": _settings(base, root / "lora", save_every=3), "logits": str(root / "lora-logits.pt")},
        {"settings": _settings(base, root / "resumed"), "interrupt_at": 3},
        {"settings": _settings(base, root / "resumed"), "resume": True},
        {"settings": _settings(base, root / "full", shard="zero2", **FULL), "logits": str(root / "full-logits.pt")},
        {"settings": _settings(base, root / "ddp", shard="ddp")},
        {"settings": _settings(base, root / "qlora", **QLORA)},
        {"settings": _settings(moe, root / "moe-lora", **MOE_LORA)},
        {"settings": _settings(moe, root / "moe-qlora", **MOE_QLORA)},
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
    single = dict(model=str(base), init="pretrained", model_overrides={}, batch_size=4, max_steps=STEPS)
    train(tiny_config(root / "single-lora", **single), progress=False)
    train(tiny_config(root / "single-full", **single, **FULL), progress=False)
    if importlib.util.find_spec("bitsandbytes") is not None:
        train(tiny_config(root / "single-qlora", **{**single, **QLORA}), progress=False)
    moe_single = dict(single, model=str(moe))
    train(tiny_config(root / "single-moe-lora", **{**moe_single, **MOE_LORA}), progress=False)
    if importlib.util.find_spec("bitsandbytes") is not None:
        train(tiny_config(root / "single-moe-qlora", **{**moe_single, **MOE_QLORA}), progress=False)
    return root


def _save_tiny_moe(folder: Path) -> Path:
    """A tiny Qwen3-MoE (a dense first layer, then experts) saved with the shipped tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memfit.models.build import make_config
    from memfit.train.conformance import TINY_MODELS
    from memfit.train.data import tiny_tokenizer_path

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(make_config(TINY_MODELS["qwen3_moe"]), dtype=torch.float32).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(tiny_tokenizer_path())).save_pretrained(folder)
    return folder


def _assert_same_losses(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() == set(range(1, STEPS + 1))
    worst = max(abs(got[k] - want[k]) for k in want)
    assert worst <= TOLERANCE, (got, want)


# ------------------------------------------------------------------------------------------------
# Two processes against one


def test_lora_on_two_processes_matches_one_process(runs):
    _assert_same_losses(step_losses(runs / "lora"), step_losses(runs / "single-lora"))
    _assert_same_losses(step_losses(runs / "ddp"), step_losses(runs / "single-lora"))
    # tokens are counted over both ranks: the global batch's
    two = [r["tokens"] for r in read_metrics(runs / "lora") if "loss" in r]
    one = [r["tokens"] for r in read_metrics(runs / "single-lora") if "loss" in r]
    assert two == one


def test_full_fine_tuning_on_two_processes_matches_and_saves_a_loadable_model(runs):
    from transformers import AutoModelForCausalLM

    _assert_same_losses(step_losses(runs / "full"), step_losses(runs / "single-full"))
    saved = torch.load(runs / "full-logits.pt", weights_only=True)
    reloaded = AutoModelForCausalLM.from_pretrained(str(runs / "full" / "model")).eval()
    with torch.no_grad():
        got = reloaded(input_ids=saved["ids"]).logits
    assert torch.allclose(got, saved["logits"], atol=1e-5, rtol=0)


def test_qlora_on_two_processes_keeps_the_4bit_base_whole_and_matches(runs):
    if not (runs / "single-qlora").exists():
        pytest.skip("bitsandbytes is not installed")
    got, want = step_losses(runs / "qlora"), step_losses(runs / "single-qlora")
    assert got.keys() == want.keys() == {1, 2, 3}
    # bf16 base and activations: rows computed in other batch shapes round differently
    assert max(abs(got[k] - want[k]) for k in want) < 1e-2, (got, want)
    assert (runs / "qlora" / "adapter" / "adapter_model.safetensors").is_file()


def test_lora_on_experts_sharded_by_fsdp_matches_one_process(runs):
    # the fused expert weights are sharded like any parameter; PEFT folds each expert's update into
    # the gathered weight
    got, want = step_losses(runs / "moe-lora"), step_losses(runs / "single-moe-lora")
    assert got.keys() == want.keys() == {1, 2, 3, 4}
    assert max(abs(got[k] - want[k]) for k in want) <= TOLERANCE, (got, want)


def test_qlora_keeps_4bit_experts_whole_on_each_rank_and_matches(runs):
    if not (runs / "single-moe-qlora").exists():
        pytest.skip("bitsandbytes is not installed")
    got, want = step_losses(runs / "moe-qlora"), step_losses(runs / "single-moe-qlora")
    assert got.keys() == want.keys() == {1, 2, 3}
    assert max(abs(got[k] - want[k]) for k in want) < 1e-2, (got, want)


def test_resume_from_a_sharded_checkpoint_equals_an_uninterrupted_run(runs):
    from memfit.train.checkpointing import list_checkpoints

    _assert_same_losses(step_losses(runs / "resumed"), step_losses(runs / "lora"))
    steps = {p.name: json.loads((p / "meta.json").read_text()) for p in list_checkpoints(runs / "resumed")}
    assert steps["step-00000003"]["reason"] == "interrupt"  # rank 0 got the signal; both stopped after step 3
    assert steps["step-00000003"]["format"] == "dcp" and steps["step-00000003"]["world_size"] == 2
    assert json.loads((runs / "resumed" / "run.json").read_text())["status"] == "completed"


def test_the_exported_adapter_loads_with_peft_and_gives_the_sharded_model_logits(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    saved = torch.load(runs / "lora-logits.pt", weights_only=True)
    base = AutoModelForCausalLM.from_pretrained(str(runs / "base"))
    model = PeftModel.from_pretrained(base, str(runs / "lora" / "adapter")).eval()
    with torch.no_grad():
        got = model(input_ids=saved["ids"]).logits
        untrained = AutoModelForCausalLM.from_pretrained(str(runs / "base"))(input_ids=saved["ids"]).logits
    assert torch.allclose(got, saved["logits"], atol=1e-5, rtol=0)
    assert not torch.allclose(got, untrained, atol=1e-4)  # the adapter holds what was trained


def test_rank_zero_writes_the_run_files_and_every_rank_its_memory(runs):
    run = runs / "lora"
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, STEPS + 1))  # once, not per rank
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "completed" and info["world_size"] == 2 and info["shard"] == "fsdp"
    for rank in (0, 1):
        lines = [json.loads(line) for line in (run / memory_file_name(rank)).read_text().splitlines()]
        assert lines[0]["kind"] == "start" and lines[0]["rank"] == rank
        assert [r["step"] for r in lines if r["kind"] == "step"] == list(range(1, STEPS + 1))
    assert not list(run.glob(".tmp-*")) and not list((run / "checkpoints").glob(".tmp-*"))


# ------------------------------------------------------------------------------------------------
# The arithmetic


def test_rank_slices_cover_every_example_once():
    batch = list(range(7))
    slices = [distributed.rank_slice(batch, r, 3) for r in range(3)]
    assert slices == [[0, 3, 6], [1, 4], [2, 5]]
    assert distributed.rank_slice([0], 1, 2) == []


def test_loss_weights_make_the_rank_mean_the_global_token_mean():
    # rank 0 scores 30 tokens with mean loss 2.0, rank 1 scores 10 with mean 4.0: global mean 2.5
    w0 = distributed.loss_weights([30, 5], [40, 5], 2)
    w1 = distributed.loss_weights([10, 0], [40, 5], 2)
    assert (w0[0] * 2.0 + w1[0] * 4.0) / 2 == pytest.approx(2.5)
    assert w1[1] == 0.0 and w0[1] == 2.0
    assert distributed.loss_weights([0], [0], 2) == [0.0]


def test_fsdp_settings_by_shard():
    assert (
        distributed.fsdp_settings("zero3")
        == distributed.fsdp_settings("fsdp")
        == {"reshard_after_forward": True, "offload": False, "replicate": False}
    )
    assert distributed.fsdp_settings("zero2")["reshard_after_forward"] is False
    assert distributed.fsdp_settings("fsdp-offload")["offload"] is True
    assert distributed.fsdp_settings("ddp")["replicate"] is True
    with pytest.raises(DistributedError, match="zero1"):
        distributed.fsdp_settings("zero1")


def test_placement_from_env():
    assert distributed.placement_from_env({}) == Placement(0, 0, 1)
    assert distributed.placement_from_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}) == Placement(3, 1, 4)
    with pytest.raises(DistributedError, match="RANK=4 does not fit WORLD_SIZE=4"):
        distributed.placement_from_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(DistributedError, match="WORLD_SIZE='two'"):
        distributed.placement_from_env({"WORLD_SIZE": "two"})
    assert memory_file_name(0) == "memory.jsonl" and memory_file_name(2) == "memory-rank2.jsonl"


# ------------------------------------------------------------------------------------------------
# Bad input


def test_gpus_must_match_the_processes_started():
    with pytest.raises(DistributedError, match="torchrun started 4 processes.*Set gpus: 4.*--nproc-per-node 2"):
        distributed.check_world(2, "fsdp", Placement(0, 0, 4))
    with pytest.raises(DistributedError, match="ddp, zero2, zero3, fsdp, fsdp-offload"):
        distributed.check_world(2, "none", Placement(0, 0, 2))
    distributed.check_world(2, "zero2", Placement(1, 1, 2))


def test_gpus_without_torchrun_is_refused_before_loading(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(TrainError, match="torchrun --nproc-per-node 2 -m memfit train"):
        train(tiny_config(tmp_path / "run", gpus=2, shard="fsdp"), progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(gpus=2, shard="zero1"), "shard: 'zero1'.*use zero2"),
        (dict(gpus=2), "shard: 'none' with gpus: 2.*shard: fsdp"),
        (dict(gpus=2, shard="fsdp", precision="fp16"), "precision: 'fp16' with gpus: 2.*bf16"),
        (dict(gpus=2, shard="fsdp", device="cuda:1"), "device: 'cuda:1' with gpus: 2"),
        (dict(shard="fsdp"), "shard: fsdp needs gpus: 2"),
        (dict(gpus=2, shard="zero4"), "shard: 'zero4' is not one of"),
    ],
)
def test_unsupported_multi_gpu_settings_are_config_errors(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(tmp_path / "run", **changes)


def test_nproc_must_match_gpus_and_relaunches_through_torchrun(tmp_path, monkeypatch):
    import yaml
    from typer.testing import CliRunner

    from memfit.cli import app
    from memfit.train import command

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_settings(tmp_path / "out", gpus=2, shard="fsdp")))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    runner = CliRunner()
    wrong = runner.invoke(app, ["train", str(config), "--nproc", "4"])
    assert wrong.exit_code == 2
    assert "--nproc 4, but the config says gpus: 2" in " ".join(wrong.output.split())

    launched = []
    monkeypatch.setattr(command, "run_forwarding_signals", lambda cmd: launched.append(cmd) or 7)
    ok = runner.invoke(
        app, ["train", str(config), "--nproc", "2", "--lr", "0.01", "--no-progress", "--set", "eval_split=0.1"]
    )
    assert ok.exit_code == 7, ok.output  # the launched command's exit code
    (cmd,) = launched
    assert cmd[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    assert cmd[6:] == ["memfit", "train", str(config), "--set", "eval_split=0.1", "--no-progress", "--lr", "0.01"]
    assert not (tmp_path / "out").exists()
    assert command.nproc_problem(2, 2, {"WORLD_SIZE": "2"}).startswith(
        "--nproc: this command already runs under torchrun"
    )


def test_ranks_load_on_the_host_and_shard_onto_their_gpu():
    """A model larger than one card is never whole on a GPU: ranks load on the host, FSDP moves shards."""
    import torch

    from memfit.spec import make_spec

    cuda = torch.device("cuda", 1)
    assert distributed.load_device(make_spec(method="lora", gpus=2, shard="fsdp"), cuda) == torch.device("cpu")
    assert distributed.load_device(make_spec(method="full", gpus=2, shard="zero2"), cuda) == torch.device("cpu")
    # QLoRA's 4-bit weights are quantized on the GPU and stay outside FSDP.
    assert distributed.load_device(make_spec(method="qlora", gpus=2, shard="fsdp"), cuda) == cuda
    assert distributed.load_device(make_spec(method="lora", gpus=2, shard="fsdp"), torch.device("cpu")) == torch.device(
        "cpu"
    )
