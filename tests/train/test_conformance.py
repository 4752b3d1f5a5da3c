"""Plan equals run: the trainer's real steps, measured as the planner counts, equal their plan.

Every cell of the matrix (two tiny transformers, a Mamba-2 and a Falcon-H1 hybrid, mixture-of-experts models of each expert layout
with LoRA on their experts and 4-bit experts; full, LoRA, QLoRA; fp32, bf16, fp16, and bf16-mixed and
fp16-mixed under autocast, which the CPU runs in both formats; checkpointing off, on, offloaded;
tiling; gradient accumulation; clipping on and off; the step in backward; padded, padding-free and
packed batches; evaluation between steps; the first steps after a resume; the preference objectives
DPO, ORPO and SimPO on pairs, with DPO's reference pass, frozen copy or precomputed log-probs; grpo,
its generation phase and its training phase each against its plan; DoRA,
rsLoRA, modules trained whole on tied and untied models, an 8-bit base) runs ``memfit train``'s own
code on the CPU and must peak at exactly the bytes its plan predicts.
"""

from __future__ import annotations

import pytest

from memfit.train import conformance
from memfit.train.conformance import MATRIX, measure


@pytest.mark.slow
@pytest.mark.parametrize("name, settings", MATRIX, ids=[name for name, _ in MATRIX])
def test_run_peaks_at_its_plan(name, settings, tmp_path):
    cell = measure(name, settings, tmp_path)
    assert not cell.error, cell.error
    assert cell.measured_bytes > 0 and cell.planned_bytes > 0
    assert cell.difference_bytes == 0, (
        f"{name}: the run peaked at {cell.measured_bytes:,} B ({cell.measured_phase}), the plan at "
        f"{cell.planned_bytes:,} B ({cell.planned_phase}); by category, run {cell.measured_categories} "
        f"plan {cell.planned_categories}"
    )
    assert cell.measured_phase == cell.planned_phase
    for phase, (planned, measured) in cell.phase_bytes.items():  # grpo: the generation and the training, each
        assert measured == planned, f"{name}: {phase} measured {measured:,} B, planned {planned:,} B"


def test_a_run_that_leaves_the_planned_path_is_caught(tmp_path, monkeypatch):
    # A trainer that keeps each step's first micro-batch (a stray reference, say) is not the step
    # the plan simulated: the harness must see the difference.
    from memfit.train.world import World

    real = World.micro_batches
    kept = []

    def keeping(self, batches, grad_accum, collate, device):
        made = real(self, batches, grad_accum, collate, device)
        kept.append(made[0])
        return made

    monkeypatch.setattr(World, "micro_batches", keeping)
    cell = measure("llama lora bf16, a kept batch", {"model": "llama", "method": "lora", "precision": "bf16"}, tmp_path)
    assert not cell.error and kept
    assert cell.difference_bytes > 0 and not cell.agrees


def test_the_data_gives_the_shapes_the_plan_assumes(tmp_path):
    from transformers import AutoTokenizer

    from memfit.train.data import BatchIterator, load_records, tiny_tokenizer_path, tokenize_records

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_path()))
    path = conformance.write_data(
        tmp_path / "d.jsonl", seq_len=40, batch_size=3, grad_accum=2, steps=2, packing=False, padded=True
    )
    records, _ = load_records(path)
    examples = tokenize_records(records, tokenizer, seq_len=40)
    assert sorted({len(e["input_ids"]) for e in examples}) == [39, 40]
    order = BatchIterator(examples, batch_size=3, seed=0)
    for _ in range(4):  # every micro-batch: longest 40, one example a token shorter
        lengths = sorted(len(e["input_ids"]) for e in next(order))
        assert lengths == [39, 40, 40]
