"""Per-rank model states: the ZeRO formulas, FSDP2's dim-0 padding, and the extra buffers."""

from __future__ import annotations

import pytest

from memfit.planner import sharding
from memfit.planner.sharding import ParamGroup, ParamLayout, per_rank_categories

PARAMS = 1_000_000 * 64  # rows of a 1,000-wide layer, 64 of them


def _layout(elem_bytes: int, *, trainable: bool = True, dim0: int = 1000, count: int = 64) -> ParamLayout:
    group = ParamGroup(dim0=dim0, row_bytes=1000 * elem_bytes, trainable=trainable, count=count)
    layer = dim0 * 1000 * elem_bytes
    return ParamLayout(
        groups=(group,),
        layer_param_bytes=layer,
        layer_grad_bytes=layer if trainable else 0,
        root_param_bytes=0,
        root_grad_bytes=0,
    )


def _states(cats: dict[str, int]) -> int:
    return sum(cats[k] for k in ("weights", "trainable", "gradients", "optimizer"))


def _single(weight_bytes: int, grad_bytes: int, optimizer_bytes: int) -> dict[str, int]:
    return {
        "weights": 0,
        "trainable": weight_bytes * PARAMS,
        "gradients": grad_bytes * PARAMS,
        "optimizer": optimizer_bytes * PARAMS,
        "activations": 10_000,
        "temporaries": 0,
        "runtime": 0,
    }


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_full_sharding_is_16_bytes_a_param_over_n_for_fp32_adamw(gpus):
    layout = _layout(4)
    cats = per_rank_categories(_single(4, 4, 8), "optimizer", shard="fsdp", gpus=gpus, layout=layout)
    assert _states(cats) == pytest.approx(16 * PARAMS / gpus, rel=0.01)
    # in backward the current and prefetched layers are gathered, and two layers of gradients
    back = per_rank_categories(_single(4, 4, 8), "backward", shard="fsdp", gpus=gpus, layout=layout)
    assert back["temporaries"] == 2 * layout.layer_param_bytes + 2 * layout.layer_grad_bytes


@pytest.mark.parametrize("gpus", [2, 8])
def test_zero1_and_zero2_formulas(gpus):
    layout = _layout(4)
    zero1 = per_rank_categories(_single(4, 4, 8), "optimizer", shard="zero1", gpus=gpus, layout=layout)
    assert zero1["trainable"] == 4 * PARAMS and zero1["optimizer"] == pytest.approx(8 * PARAMS / gpus, rel=0.01)
    # gradients whole, plus DDP's buckets (a second copy: gradient_as_bucket_view=False)
    assert zero1["gradients"] == 4 * PARAMS + sharding.ddp_bucket_bytes(4 * PARAMS)
    zero2 = per_rank_categories(_single(4, 4, 8), "optimizer", shard="zero2", gpus=gpus, layout=layout)
    assert zero2["trainable"] == 4 * PARAMS
    assert zero2["gradients"] + zero2["optimizer"] == pytest.approx(12 * PARAMS / gpus, rel=0.01)


def test_pure_bf16_full_fine_tuning_is_8_bytes_a_param_over_n():
    layout = _layout(2)
    cats = per_rank_categories(_single(2, 2, 4), "optimizer", shard="zero3", gpus=4, layout=layout)
    assert _states(cats) == pytest.approx(8 * PARAMS / 4, rel=0.01)


def test_padding_follows_dim0_chunks():
    group = ParamGroup(dim0=10, row_bytes=6, trainable=True)
    assert group.shard_bytes(4) == 3 * 6  # torch.chunk: ceil(10 / 4) rows, every chunk padded to the first
    assert group.shard_bytes(16) == 6  # more ranks than rows: one (padded) row each
    layout = _layout(2, dim0=1001)
    assert layout.shard_ratio(True, 8) == pytest.approx(126 / 1001)


def test_ddp_keeps_everything_and_adds_buckets_and_nccl():
    layout = _layout(2)
    single = _single(2, 2, 4)
    cats = per_rank_categories(single, "backward", shard="ddp", gpus=4, layout=layout)
    assert cats["trainable"] == single["trainable"] and cats["optimizer"] == single["optimizer"]
    assert cats["gradients"] - single["gradients"] >= 2 * PARAMS
    assert cats["runtime"] == sharding.NCCL_RUNTIME_BYTES
    assert per_rank_categories(single, "backward", shard="none", gpus=4, layout=layout) == cats  # none = ddp


def test_offload_leaves_no_states_on_the_gpu_and_frozen_weights_shard():
    frozen = _layout(2, trainable=False)
    single = {
        "weights": 2 * PARAMS,
        "trainable": 0,
        "gradients": 0,
        "optimizer": 0,
        "activations": 0,
        "temporaries": 0,
        "runtime": 0,
    }
    assert per_rank_categories(single, "forward", shard="fsdp", gpus=8, layout=frozen)["weights"] == pytest.approx(
        2 * PARAMS / 8, rel=0.01
    )
    off = per_rank_categories(_single(2, 2, 4), "forward", shard="fsdp-offload", gpus=4, layout=_layout(2))
    assert _states(off) == 0
    states = sharding.model_state_bytes(_single(2, 2, 4), shard="fsdp-offload", gpus=4, layout=_layout(2))
    assert (
        states["per_rank_host_bytes"] == pytest.approx(8 * PARAMS / 4, rel=0.01)
        and states["per_rank_device_bytes"] == 0
    )


def test_8bit_optimizers_are_refused_with_cpu_offload():
    assert sharding.mode_problems("fsdp-offload", 4, "adamw8bit")
    assert not sharding.mode_problems("fsdp", 4, "adamw8bit")


def test_a_tool_config_s_modes_are_refused_by_its_keys():
    spell = lambda knob, value: f"{knob}_key ({value})"  # noqa: E731 - as a tool config names its keys
    (line,) = sharding.mode_problems("fsdp-offload", 2, "paged-adamw8bit", spell)
    assert line.startswith("shard_key (fsdp-offload) with optimizer_key (paged-adamw8bit): ")


# ------------------------------------------------------------------------------------------------
# DPO's reference on several GPUs


def _dpo_full(weights_bytes: int) -> dict[str, int]:
    """Full fine-tuning's DPO on one GPU: its frozen reference copy is the weights."""
    return {**_single(2, 2, 4), "weights": weights_bytes * PARAMS}


@pytest.mark.parametrize(
    "shard, share",
    [("ddp", 1.0), ("zero1", 1.0), ("zero2", 0.25), ("zero3", 0.25), ("fsdp", 0.25), ("fsdp-offload", 0.0)],
)
def test_a_frozen_reference_copy_is_sharded_as_the_trainer_shards_it(shard, share):
    layout = _layout(2)
    cats = per_rank_categories(_dpo_full(2), "optimizer", shard=shard, gpus=4, layout=layout, reference="frozen-copy")
    assert cats["weights"] == pytest.approx(2 * PARAMS * share, rel=0.01)
    # Without a copy, the weights of full fine-tuning are a rank's frozen parameters: as before.
    assert per_rank_categories(_dpo_full(2), "optimizer", shard="zero2", gpus=4, layout=layout)["weights"] == 2 * PARAMS


def test_deepspeed_keeps_the_reference_whole_below_zero3_as_trl_prepares_it():
    from memfit.interop.deepspeed import ZeroSettings

    layout = _layout(2)
    assert sharding.reference_ratio("zero2", 4, layout, ZeroSettings("ds.json", stage=2)) == 1.0
    assert sharding.reference_ratio("zero3", 4, layout, ZeroSettings("ds.json", stage=3)) == pytest.approx(
        0.25, rel=0.01
    )
    assert (
        sharding.reference_ratio("fsdp-offload", 4, layout, ZeroSettings("ds.json", stage=3, offload_param=True)) == 0.0
    )


def test_the_reference_pass_gathers_as_forward_does():
    layout = ParamLayout(
        groups=(ParamGroup(dim0=1000, row_bytes=2000, trainable=True, count=8),),
        layer_param_bytes=4_000_000,
        layer_grad_bytes=4_000_000,
        root_param_bytes=1_000_000,
        root_grad_bytes=1_000_000,
    )
    gathered = 2 * 4_000_000 + 1_000_000  # the current and the prefetched layer, and the root group
    for shard in ("zero3", "fsdp"):
        for reference in ("disabled-adapters", "frozen-copy"):
            extra = sharding.extra_buffers(shard, 4, "reference", layout, reference=reference)
            assert (
                extra["temporaries"] == gathered == sharding.extra_buffers(shard, 4, "forward", layout)["temporaries"]
            )
    # zero2 keeps a model's gathered layers until backward (they count whole in weights); its frozen
    # copy has no backward and is gathered a layer at a time.
    assert sharding.extra_buffers("zero2", 4, "reference", layout, reference="disabled-adapters")["temporaries"] == 0
    assert sharding.extra_buffers("zero2", 4, "reference", layout, reference="frozen-copy")["temporaries"] == gathered
    assert sharding.extra_buffers("ddp", 4, "reference", layout, reference="frozen-copy")["temporaries"] == 0
