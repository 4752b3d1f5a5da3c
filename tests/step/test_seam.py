"""The step's seam (memfit.step.seam): without a runner, or on real tensors, every call is the plain thing."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.step import seam


def test_every_chunk_runs_without_a_runner_on_real_and_fake_tensors():
    assert seam.chunks_to_run(10, 2, torch.empty(10, 2)) == [0, 2, 4, 6, 8]
    assert seam.chunks_to_run(10, 2) == [0, 2, 4, 6, 8]
    with FakeTensorMode():
        fake = torch.empty(10, 2)
    assert seam.chunks_to_run(10, 2, fake) == [0, 2, 4, 6, 8]


class _Runner:
    def __init__(self):
        self.units, self.loops = [], []

    def chunk_starts(self, starts, total, chunk):
        self.loops.append((total, chunk))
        return starts[:1]

    def run(self, unit):
        self.units.append(unit.what)
        return unit.run(unit.observer)


def test_a_runner_answers_for_fake_tensors_only():
    runner = _Runner()
    with FakeTensorMode():
        fake = torch.empty(10, 2)
    with seam.running(runner):
        assert seam.chunks_to_run(10, 2, fake) == [0]
        assert seam.chunks_to_run(10, 2, torch.empty(10, 2)) == [0, 2, 4, 6, 8]
        assert seam.run_region(None, "test", lambda a: a + 1, torch.ones(2)).tolist() == [2.0, 2.0]
        assert seam.run_region(None, "test", lambda a: a, fake) is fake
    assert runner.loops == [(10, 2)] and runner.units == ["test"]
    assert seam.chunks_to_run(10, 2, fake) == [0, 2, 4, 6, 8]  # gone with its block


def test_without_a_runner_a_micro_batch_is_a_plain_call():
    phases = []

    class Observer:
        def on_phase(self, name):
            phases.append(name)

    def micro_batch(model, batch, totals, count, observer):
        observer.on_phase("forward")
        loss = model(batch["x"]).sum() / count
        loss.backward()
        return loss.detach(), totals

    model = torch.nn.Linear(2, 1)
    loss, totals = seam.run_micro_batch(model, micro_batch, {"x": torch.ones(3, 2)}, None, 1, Observer())
    assert totals is None and not loss.requires_grad and model.weight.grad is not None and phases == ["forward"]


def test_the_questions_a_simulation_answers_otherwise():
    real = torch.ones(3)
    with FakeTensorMode():
        fake = torch.ones(3)
    assert seam.token_count_known(real) and not seam.token_count_known(fake)
    assert seam.keeps_dropout_masks(real) and not seam.keeps_dropout_masks(fake)
    assert seam.host_copy_pinnable(fake)
    assert seam.host_copy_pinnable(real) == torch.cuda.is_available()


def test_module_attributes_that_decide_memory_are_declared_beside_the_code_that_sets_them():
    from memfit.step.preference import ADAPTERS_DISABLED
    from memfit.step.tiling import TILE_TOKENS

    assert {TILE_TOKENS, ADAPTERS_DISABLED} <= seam.memory_attributes()
    assert (TILE_TOKENS, ADAPTERS_DISABLED) == ("_memfit_tile_tokens", "_disable_adapters")


def test_only_the_seam_knows_fake_tensors_and_the_planner():
    from pathlib import Path

    step = Path(seam.__file__).parent
    knowing = [
        path.name
        for path in step.glob("*.py")
        if path.name != "seam.py" and ("fake_tensor" in (text := path.read_text()) or "is_fake" in text)
    ]
    assert knowing == []
