"""A run fitted to its card: ``fit: auto`` before loading, the next configuration down when a step
runs out of memory, and the data's longest micro-batch as the length planned."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_helpers import step_losses, tiny_config

from memfit.step import train_step as step_module
from memfit.step.batch import DOCUMENTS, PADDED
from memfit.train.errors import OutOfMemory
from memfit.train.fitting import planned_seq_len
from memfit.train.recipe import train

#: The step itself, before any test stands in for it.
REAL_STEP = step_module.train_step
#: Plans of the tiny model need about 530 MiB, the estimated CUDA context included.
BUDGET = "2GiB"


def _run_json(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


class _StepLog:
    """Stands in for the step: records the examples of every step that completed, and raises an
    out-of-memory error at chosen calls (a call of the step with ``accumulated`` micro-batches)."""

    def __init__(
        self, monkeypatch, oom_at_call: int | None = None, accumulated: int = 1, signal_after: int | None = None
    ):
        self.real = REAL_STEP
        self.calls = 0
        self.completed = 0
        self.steps: list[list[tuple[int, ...]]] = []
        self.oom_at_call, self.accumulated, self.signal_after = oom_at_call, accumulated, signal_after
        monkeypatch.setattr(step_module, "train_step", self)

    def __call__(self, model, micro_batches, optimizer, **kwargs):
        from torch._subclasses.fake_tensor import is_fake

        batches = list(micro_batches)
        if is_fake(batches[0]["input_ids"]):  # the planner's simulation of the step: not a step of the run
            return self.real(model, batches, optimizer, **kwargs)
        self.calls += 1
        if self.calls == self.oom_at_call and len(batches) == self.accumulated:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        out = self.real(model, batches, optimizer, **kwargs)
        self.completed += 1
        self.steps.append(sorted(ex for b in batches for ex in _split(b)))
        if self.signal_after == self.completed:
            os.kill(os.getpid(), signal.SIGTERM)
        return out


def _split(batch) -> list[tuple[int, ...]]:
    """The examples of a one-row micro-batch, as tuples of token ids."""
    ids = batch["input_ids"][0].tolist()
    out, start = [], 0
    for length in batch["documents"].lengths:
        out.append(tuple(ids[start : start + length]))
        start += length
    return out


SETTINGS = dict(batch_size=4, grad_accum=1, max_steps=6, budget=BUDGET, warmup_steps=1, dropout=0.1)


def test_out_of_memory_continues_one_configuration_down_on_the_same_examples(tmp_path, monkeypatch):
    clean_log = _StepLog(monkeypatch)
    clean = train(tiny_config(tmp_path / "clean", **SETTINGS), progress=False)
    assert clean.status == "completed"

    # The third step runs out of memory: the run frees, steps down to micro-batch 2 x 2 accumulated
    # (the same effective batch), and takes step 3 again on the same examples.
    log = _StepLog(monkeypatch, oom_at_call=3, accumulated=1)
    result = train(tiny_config(tmp_path / "run", **SETTINGS), progress=False)
    assert result.status == "completed" and result.step == 6
    info = _run_json(tmp_path / "run")
    [change] = info["config_changes"]
    assert change["step"] == 3 and change["reason"] == "out of memory"
    assert change["from"]["batch_size"] == 4 and change["to"]["batch_size"] == 2 and change["to"]["grad_accum"] == 2
    assert info["active_knobs"]["batch_size"] == 2 and info["status"] == "completed"
    # No example lost or repeated: every step trained the examples the uninterrupted run trained.
    assert log.steps == clean_log.steps and len(log.steps) == 6
    assert sorted(ex for step in log.steps for ex in step) == sorted(ex for step in clean_log.steps for ex in step)

    # From the step it switched, the trajectory is that of the smaller configuration: a run stopped
    # after step 2 and resumed with micro-batch 2 x 2 gives the same losses.
    _StepLog(monkeypatch, signal_after=2)
    stopped = train(tiny_config(tmp_path / "resumed", **SETTINGS), progress=False)
    assert stopped.status == "interrupted" and stopped.step == 2
    _StepLog(monkeypatch)
    resumed = train(
        tiny_config(tmp_path / "resumed", **dict(SETTINGS, batch_size=2, grad_accum=2)), resume=True, progress=False
    )
    assert resumed.status == "completed"
    switched, again = step_losses(tmp_path / "run"), step_losses(tmp_path / "resumed")
    assert switched.keys() == again.keys() == set(range(1, 7))
    for step in range(1, 7):
        assert switched[step] == pytest.approx(again[step], rel=1e-6, abs=1e-7), step


def test_resume_keeps_the_configuration_the_run_was_training_with(tmp_path, monkeypatch):
    _StepLog(monkeypatch, oom_at_call=2, accumulated=1, signal_after=3)
    first = train(tiny_config(tmp_path / "run", **SETTINGS), progress=False)
    assert first.status == "interrupted" and _run_json(tmp_path / "run")["active_knobs"]["batch_size"] == 2
    log = _StepLog(monkeypatch)
    # The YAML still says micro-batch 4: the resumed run goes on with 2 x 2, as it was.
    resumed = train(tiny_config(tmp_path / "run", **SETTINGS), resume=True, progress=False)
    assert resumed.status == "completed" and resumed.step == 6
    assert all(len(step) == 4 for step in log.steps) and log.calls == 3
    assert len(_run_json(tmp_path / "run")["config_changes"]) == 1


def test_nothing_smaller_gives_up_with_the_advice(tmp_path, monkeypatch):
    _StepLog(monkeypatch, oom_at_call=1, accumulated=1)
    settings = dict(SETTINGS, batch_size=1, checkpointing="offload", tiling="on")
    with pytest.raises(OutOfMemory) as info:
        train(tiny_config(tmp_path / "run", **settings), progress=False)
    assert "out of device memory at step 1" in str(info.value) and info.value.checkpoint is not None
    assert _run_json(tmp_path / "run")["status"] == "oom"


def test_step_in_backward_stops_as_it_cannot_take_the_step_again(tmp_path, monkeypatch):
    _StepLog(monkeypatch, oom_at_call=1, accumulated=1)
    with pytest.raises(OutOfMemory):
        train(tiny_config(tmp_path / "run", **dict(SETTINGS, method="full", step_in_backward=True)), progress=False)


def test_fit_auto_chooses_records_and_says_why(tmp_path):
    from memfit.planner.api import plan
    from memfit.train.config import model_config_dict
    from memfit.train.examples import load_tokenizer, prepare_examples

    given = dict(SETTINGS, checkpointing="off", tiling="off")
    config = tiny_config(tmp_path / "probe", **given)
    examples, _ = prepare_examples(config, load_tokenizer(config))
    length = planned_seq_len(examples, 4, config.seq_len, DOCUMENTS, packing=False)

    def planned(**changes):
        return plan(model_config_dict(config), **{**config.knobs(), "seq_len": length, **changes})

    # A budget below the given configuration (checkpointing off, micro-batch 4, no tiling) and above
    # the leanest: fit must change something (micro-batch, checkpointing or tiling), keeping the
    # effective batch.
    off, on = planned(), planned(checkpointing="on", batch_size=1, grad_accum=4)
    assert on.device_total_bytes < off.device_total_bytes
    budget = str((on.device_total_bytes + off.device_total_bytes) // 2)
    result = train(
        tiny_config(tmp_path / "run", **dict(given, budget=budget, fit="auto", tiling="auto")), progress=False
    )
    assert result.status == "completed"
    info = _run_json(tmp_path / "run")
    chosen = info["fit"]["chosen"]
    assert chosen["batch_size"] * chosen["grad_accum"] == 4 and chosen["device_total_bytes"] <= int(budget)
    assert (chosen["checkpointing"], chosen["batch_size"], chosen["tiling"]) != ("off", 4, "off")  # something leaner
    assert info["fit"]["given"]["checkpointing"] == "off" and "fastest (estimated)" in info["fit"]["why"]
    assert info["active_knobs"] == {k: chosen[k] for k in info["active_knobs"]} and info["planned_seq_len"] == length
    assert info["fit"]["candidates"] > 2


def test_fit_auto_on_a_cpu_without_a_target_says_what_to_give(tmp_path):
    from memfit.train.errors import TrainError

    with pytest.raises(TrainError, match="fit: auto needs a device to fit"):
        train(tiny_config(tmp_path / "run", fit="auto", max_steps=1), progress=False)
    assert not (tmp_path / "run").exists()


def test_the_length_planned_is_the_datas_longest_micro_batch():
    examples = [{"input_ids": [0] * n} for n in (10, 50, 20, 40, 30)]
    assert planned_seq_len(examples, 1, 64, PADDED, packing=False) == 50
    assert planned_seq_len(examples, 2, 64, PADDED, packing=False) == 50  # padded to the longest
    assert planned_seq_len(examples, 2, 64, DOCUMENTS, packing=False) == 45  # 50 + 40 in one row
    assert planned_seq_len(examples, 2, 32, DOCUMENTS, packing=False) == 32  # never above seq_len
    assert planned_seq_len(examples, 2, 64, DOCUMENTS, packing=True) == 64  # packed rows are full


class _CudaDevice:
    """Where a run would train, as the run's Target reads it: CUDA device 0."""

    type, index = "cuda", 0


def test_preflight_and_fit_auto_judge_a_live_device_by_the_same_free_memory(tmp_path, monkeypatch):
    from memfit.planner.search.run import SEARCHED, RunPlanner
    from memfit.planner.target import DeviceReading, device_target
    from memfit.train import recipe
    from memfit.train.config import model_config_dict
    from memfit.train.examples import load_tokenizer, prepare_examples
    from memfit.train.fitting import run_target
    from memfit.train.preflight import PreflightError
    from memfit.units import format_bytes

    given = dict(SETTINGS, budget=None, checkpointing="off", tiling="auto")
    config = tiny_config(tmp_path / "probe", **given)
    examples, _ = prepare_examples(config, load_tokenizer(config))
    length = planned_seq_len(examples, 4, config.seq_len, DOCUMENTS, packing=False)
    # What the run needs on the card, its CUDA context spent (as on a live device): as given, and leanest.
    roomy = RunPlanner(
        model_config_dict(config), device_target(DeviceReading("NVIDIA GeForce RTX 4090", 1 << 40, 1 << 40))
    )
    knobs = {**config.knobs(), "seq_len": length}
    off = roomy.check(knobs).device_total_bytes
    on = roomy.check(dict(knobs, checkpointing="on", batch_size=1, grad_accum=4)).device_total_bytes
    assert on < off
    # The card has room for the run as given; what other processes leave free has not.
    free, total = (on + off) // 2, 24 << 30
    readings = []

    def probe(index):
        readings.append(index)
        return DeviceReading("NVIDIA GeForce RTX 4090", free, total)

    monkeypatch.setattr(recipe, "run_target", lambda config, device: run_target(config, _CudaDevice(), probe))
    with pytest.raises(PreflightError) as refused:
        train(tiny_config(tmp_path / "given", **given), progress=False)
    assert readings == [0]  # the device is read once, before anything is planned
    assert f"more than the {format_bytes(free)} of NVIDIA GeForce RTX 4090 (free memory)" in str(refused.value)
    best = refused.value.fitting[0]
    assert best.device_total_bytes <= free

    fitted = train(tiny_config(tmp_path / "fitted", **dict(given, fit="auto")), progress=False)
    assert fitted.status == "completed" and readings == [0, 0]
    info = _run_json(tmp_path / "fitted")
    # fit: auto chose what the refusal named first, and preflight accepted it against the same memory.
    assert {k: info["fit"]["chosen"][k] for k in SEARCHED} == {k: best.spec[k] for k in SEARCHED}
    assert info["preflight"]["fits"] is True and info["preflight"]["target_bytes"] == free
