"""Every shortcut gives the exact plan: one table of configurations, each planned exact (every
layer simulated, every chunk and micro-batch run, nothing remembered) and with the shortcuts
(replay, the chunk shortcut, depth extrapolation, the memo), with every figure of the plan
compared; and at each depth the shortcuts simulate, every tracker event of the simulation with
replay compared with the one that runs every unit.

Reserved memory is equal too: at full depth the caching allocator's model replays the full
depth's events made from the samples' (memfit.planner.shortcuts.depth_stream). One shortcut can
change it: the chunk shortcut, which runs three chunks of a longer loop, can leave the small pool
one 2 MiB segment off (LoRA, offloaded checkpointing and tiling, two layers, 12,416 tokens: a
segment more; equal at the other lengths from 6,272 to 16,384 every 640 tokens, and from 12,032 to
13,312 every 128).
"""

from __future__ import annotations

import pytest
from replay_helpers import events_of

import memfit
from memfit.planner.api import predicted_plan
from memfit.planner.exact.runtime import runtime_overhead
from memfit.planner.exact.simulate import simulate
from memfit.planner.inputs import resolve
from memfit.planner.shortcuts.depths import plan_depths
from memfit.planner.shortcuts.lengths import LengthSampler
from memfit.planner.shortcuts.replay import Replay
from memfit.spec import make_spec

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 16384,
    "tie_word_embeddings": False,
}
#: Deep enough to be cut: two and three layers simulated, six planned.
DEEP = dict(LLAMA, num_hidden_layers=6)
#: Two kinds of layer (sliding and global attention, alternating): a base of each kind and one more of each.
GEMMA = {
    "model_type": "gemma2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 16384,
    "sliding_window": 64,
    "query_pre_attn_scalar": 16,
}

#: (name, config, knobs): every kind of step a plan simulates, each planned both ways.
TABLE = [
    ("lora-deep", DEEP, dict(method="lora", seq_len=256, checkpointing="on", grad_accum=3)),
    ("qlora-deep", DEEP, dict(method="qlora", seq_len=256, checkpointing="on")),
    ("full-deep", DEEP, dict(method="full", seq_len=256, precision="fp32", checkpointing="on", grad_accum=2)),
    ("full-tied", dict(LLAMA, tie_word_embeddings=True), dict(method="full", seq_len=256, grad_accum=4)),
    ("dora", LLAMA, dict(method="lora", dora=True, seq_len=256, grad_accum=3)),
    ("dpo", LLAMA, dict(method="lora", objective="dpo", batch_size=2, seq_len=256, checkpointing="on", grad_accum=2)),
    ("hf-packed", LLAMA, dict(method="lora", recipe="hf", packing=True, batch_size=2, seq_len=256, grad_accum=4)),
    # Reentrant checkpointing: each layer's backward runs its forward again, then a backward of its own.
    ("hf-reentrant", DEEP, dict(method="lora", recipe="hf", use_reentrant="on", seq_len=256, grad_accum=4)),
    # (Their micro-batches make state, so they run: the tiled layers' chunks are replayed.)
    (
        "step-in-backward",
        LLAMA,
        dict(method="full", seq_len=4500, tiling="on", checkpointing="on", step_in_backward=True),
    ),
    ("fp16", LLAMA, dict(method="lora", precision="fp16", seq_len=4500, tiling="on", grad_accum=4)),
    ("offload-tiled", LLAMA, dict(method="lora", seq_len=9000, tiling="on", checkpointing="offload", grad_accum=3)),
    ("full-offload-tiled-deep", DEEP, dict(method="full", seq_len=5000, tiling="on", checkpointing="offload")),
    ("fsdp-2-ranks", DEEP, dict(method="full", seq_len=256, gpus=2, shard="fsdp", checkpointing="on")),
    # A rank's bytes round each category up: a shard of the 4-bit base's odd-sized parts.
    (
        "hf-qlora-fsdp",
        DEEP,
        dict(
            method="qlora",
            recipe="hf",
            kbit_upcast=False,
            gpus=2,
            shard="fsdp",
            packing=True,
            batch_size=2,
            grad_accum=4,
        ),
    ),
    ("two-kinds", GEMMA, dict(method="lora", seq_len=256, checkpointing="on", grad_accum=2)),
]


def _figures(plan) -> dict:
    """Every figure of a plan (flat: ``peak.reserved_bytes``), without what says how it was made."""
    data = plan.to_dict()
    data["details"] = {
        k: v for k, v in data["details"].items() if k not in ("plan_seconds", "simulated_layers", "exact")
    }

    def flat(value, prefix=""):
        if not isinstance(value, dict):
            return {prefix[:-1]: value}
        return {k: v for key, inner in value.items() for k, v in flat(inner, f"{prefix}{key}.").items()}

    return flat(data)


@pytest.mark.parametrize("config, knobs", [(c, k) for _, c, k in TABLE], ids=[name for name, _, _ in TABLE])
def test_a_plan_with_shortcuts_is_the_exact_plan(config, knobs):
    short = memfit.plan(dict(config), cache=False, **knobs)
    exact = memfit.plan(dict(config), exact=True, **knobs)
    assert exact.details["exact"] and "exact" not in short.details
    assert exact.details["simulated_layers"] == [config["num_hidden_layers"]]
    assert _figures(short) == _figures(exact)


@pytest.mark.parametrize("use_reentrant", ["on", "off"])
def test_an_8bit_plan_with_shortcuts_is_the_exact_plan_under_either_checkpointing(use_reentrant):
    # (Not in the table: LLM.int8 layers keep state between micro-batches, so nothing is replayed.)
    knobs = dict(method="lora-8bit", recipe="hf", kbit_upcast=False, use_reentrant=use_reentrant, seq_len=256)
    short = memfit.plan(dict(DEEP), cache=False, **knobs)
    exact = memfit.plan(dict(DEEP), exact=True, **knobs)
    assert _figures(short) == _figures(exact)


def _frees_in_any_order(events: list[tuple]) -> list[tuple]:
    """``events`` with each run of frees that follow each other sorted: PyTorch empties some caches
    (autocast's casts) in the order of their addresses, which is not the same from one run to the
    next, and the allocator is in the same state after a run of frees whatever their order."""
    out, run = [], []
    for event in events + [("end",)]:
        if event[0] == "free":
            run.append(event)
            continue
        out.extend(sorted(run, key=repr))
        run = []
        out.append(event)
    return out[:-1]


class _EveryUnit(Replay):
    """The shortcuts' chunks, every unit run (nothing replayed)."""

    def run(self, unit):
        return unit.run(unit.observer)


def _simulated(config: dict, spec, cut, runner: Replay):
    workspaces = runtime_overhead(None).cublas_workspace_allocs
    result = simulate(config, spec, layers=cut, workspace_allocs=workspaces, runner=runner.bind)
    return result, runner


@pytest.mark.parametrize("config, knobs", [(c, k) for _, c, k in TABLE], ids=[name for name, _, _ in TABLE])
def test_every_event_is_the_same_with_and_without_replay(config, knobs):
    spec = make_spec(**knobs)
    if spec.gpus > 1:
        spec = spec.model_copy(update={"gpus": 2, "shard": "none"})  # the step one rank runs, as the plan simulates it
    depths = plan_depths(config)
    replayed_any = 0
    for cut in depths.samples if depths else [None]:
        replayed, replay = _simulated(config, spec, cut, Replay())
        ran, every = _simulated(config, spec, cut, _EveryUnit())
        replayed_any += replay.replayed
        assert _frees_in_any_order(events_of(replayed.tracker)) == _frees_in_any_order(events_of(ran.tracker))
        outside = [
            [(a.place, a.nbytes, a.role, a.phase) for a in r.tracker.allocations if a.place != "device"]
            for r in (replayed, ran)
        ]
        assert outside[0] == outside[1]
        for name in ("peak", "phase_peaks", "phase_marks", "outside_peaks"):
            assert getattr(replayed.tracker, name) == getattr(ran.tracker, name), name
        assert replayed.attention_kernels == ran.attention_kernels
        assert replay.loops == every.loops
    assert replayed_any, "nothing was replayed"


def test_a_length_the_length_model_predicts_is_the_exact_plan():
    # Learnt from 8,192 and 9,856 tokens (the search's first two lengths), predicted at 12,928: seven
    # tiles of 2,048 tokens and thirteen loss chunks of 1,024, the last of each partial.
    knobs = dict(method="lora", tiling="on", checkpointing="offload", grad_accum=2, seq_len=12928)
    target = resolve(dict(LLAMA), budget="8GiB", **knobs).target
    predicted = predicted_plan(dict(LLAMA), LengthSampler((8192, 9856)), target=target, **knobs)
    exact = memfit.plan(dict(LLAMA), budget="8GiB", exact=True, **knobs)
    assert predicted.details["predicted"]
    assert (predicted.allocated_bytes, predicted.reserved_bytes, predicted.device_total_bytes, predicted.phase) == (
        exact.allocated_bytes,
        exact.reserved_bytes,
        exact.device_total_bytes,
        exact.phase,
    )
    assert predicted.categories == exact.categories
    assert predicted.details["phase_peaks_allocated_bytes"] == exact.details["phase_peaks_allocated_bytes"]
