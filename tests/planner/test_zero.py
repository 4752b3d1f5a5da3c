"""DeepSpeed ZeRO's buffers per rank: each term from the DeepSpeed config, and the plan that names them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from memfit.interop.deepspeed import ZeroSettings
from memfit.planner import sharding
from memfit.planner.sharding import ParamGroup, ParamLayout
from memfit.planner.zero import ZeroPlan, zero_ratios, zero_terms

#: Four 1,000-element layers of 2-byte weights and a 3,000-element root (embeddings and head), all trained.
LAYOUT = ParamLayout(
    groups=(
        ParamGroup(dim0=1000, row_bytes=2, trainable=True, count=4),
        ParamGroup(dim0=3000, row_bytes=2, trainable=True),
    ),
    layer_param_bytes=2000,
    layer_grad_bytes=2000,
    root_param_bytes=6000,
    root_grad_bytes=6000,
)


def _terms(zero: ZeroSettings, **kwargs):
    args = dict(gpus=4, layout=LAYOUT, num_layers=4, itemsize=2, trainable_itemsize=2) | kwargs
    return {t.name: t for t in zero_terms(zero, **args)}


@pytest.mark.parametrize("overlap, buckets", [(False, 1), (True, 2)])
def test_stage_2_reduce_buckets_live_through_backward(overlap, buckets):
    terms = _terms(ZeroSettings("ds.json", stage=2, reduce_bucket_elements=1_000, overlap_comm=overlap))
    bucket = terms["reduce_bucket_size"]
    assert bucket.nbytes == buckets * 1_000 * 2 and bucket.phases == ("backward",) and bucket.category == "temporaries"
    assert terms["allgather_bucket_size"].nbytes == 0  # gathered in place
    assert "offload_optimizer" not in terms


def test_no_bucket_without_contiguous_gradients():
    assert (
        _terms(ZeroSettings("ds.json", stage=1, reduce_bucket_elements=1_000, contiguous_gradients=False))[
            "reduce_bucket_size"
        ].nbytes
        == 0
    )


def test_a_bucket_is_allocated_whole_however_small_the_model():
    # DeepSpeed allocates reduce_bucket_size elements, not the gradients' size: 5e8 x 2 bytes for any model.
    terms = _terms(ZeroSettings("ds.json", stage=2))
    assert terms["reduce_bucket_size"].nbytes == 500_000_000 * 2


def test_stage_2_optimizer_offload_stages_the_largest_parameter_on_the_device():
    terms = _terms(ZeroSettings("ds.json", stage=2, offload_optimizer=True), trainable_itemsize=4, itemsize=2)
    assert terms["offload_optimizer"].nbytes == 3000 * 2 * 2 // 4  # the root group's 3,000 elements, in 2-byte elements


def test_stage_3_gathers_a_layer_prefetches_and_keeps_what_is_reused_soon():
    zero = ZeroSettings(
        "ds.json",
        stage=3,
        reduce_bucket_elements=500,
        prefetch_bucket_elements=300,
        max_live_parameters=1_000_000,
        max_reuse_distance=5_001,
    )
    terms = _terms(zero)
    assert terms["reduce_bucket_size"].nbytes == 1_000 and terms["reduce_bucket_size"].phases == ()
    assert terms["gathered layer"].nbytes == 2_000
    assert terms["stage3_prefetch_bucket_size"].nbytes == 600
    # Layer i from the end is used again after 2 x i layers (1,000 elements each) and the root (3,000): i = 0 and 1.
    assert terms["stage3_max_reuse_distance"].nbytes == 2 * 2_000 and terms["stage3_max_reuse_distance"].phases == (
        "backward",
    )
    assert terms["root group"].nbytes == 6_000 and terms["fresh gradients"].nbytes == 8_000


def test_stage_3_gathers_no_more_than_max_live_parameters():
    zero = ZeroSettings(
        "ds.json",
        stage=3,
        reduce_bucket_elements=500,
        prefetch_bucket_elements=10_000,
        max_live_parameters=1_500,
        max_reuse_distance=10**9,
    )
    terms = _terms(zero)
    gathered = sum(
        terms[n].nbytes for n in ("gathered layer", "stage3_prefetch_bucket_size", "stage3_max_reuse_distance")
    )
    assert gathered == 1_500 * 2


def test_offload_moves_states_to_the_host():
    ratios = {"weights": 0.25, "trainable": 0.25, "gradients": 0.25, "optimizer": 0.25}
    assert zero_ratios(ZeroSettings("d", stage=2, offload_optimizer=True), ratios) == dict(
        ratios, gradients=0.0, optimizer=0.0
    )
    assert zero_ratios(ZeroSettings("d", stage=1, offload_optimizer=True), ratios) == dict(ratios, optimizer=0.0)
    assert zero_ratios(ZeroSettings("d", stage=3, offload_param=True), ratios) == dict(
        ratios, weights=0.0, trainable=0.0
    )


def test_a_rank_holds_deepspeed_s_buffers_in_place_of_pytorch_s():
    zero = ZeroSettings("ds.json", stage=2, reduce_bucket_elements=1_000, overlap_comm=True)
    plan = ZeroPlan(
        zero, tuple(zero_terms(zero, gpus=4, layout=LAYOUT, num_layers=4, itemsize=2, trainable_itemsize=2))
    )
    single = {
        "weights": 0,
        "trainable": 14_000,
        "gradients": 14_000,
        "optimizer": 28_000,
        "activations": 0,
        "temporaries": 0,
    }
    plain = sharding.per_rank_categories(single, "backward", shard="zero2", gpus=4, layout=LAYOUT)
    deep = sharding.per_rank_categories(single, "backward", shard="zero2", gpus=4, layout=LAYOUT, zero=plan)
    # PyTorch's zero2: a layer's fresh gradients, the previous reduce-scatter input, the root group's gradients.
    assert plain["temporaries"] == 2 * 2_000 + 6_000
    assert deep["temporaries"] == 2 * 1_000 * 2  # DeepSpeed's two reduce buckets, nothing else
    assert deep["gradients"] == plain["gradients"]
    # Another mode than the config's stage gives PyTorch's buffers.
    assert sharding.per_rank_categories(
        single, "backward", shard="fsdp", gpus=4, layout=LAYOUT, zero=plan
    ) == sharding.per_rank_categories(single, "backward", shard="fsdp", gpus=4, layout=LAYOUT)


def test_a_plan_of_a_deepspeed_config_names_its_buffers(tiny_llama):
    from memfit.planner.api import plan

    zero = ZeroSettings(
        "ds.json",
        stage=3,
        reduce_bucket_elements=None,
        prefetch_bucket_elements=None,
        persistence_threshold_elements=None,
        bf16=True,
    )
    knobs = dict(method="full", recipe="hf", seq_len=64, gpus=4, shard="zero3", precision="bf16", cache=False)
    deep = plan(tiny_llama, deepspeed=zero, **knobs)
    terms = {t["name"]: t for t in deep.details["deepspeed"]["terms"]}
    hidden = tiny_llama["hidden_size"]
    assert terms["reduce_bucket_size"]["bytes"] == hidden * hidden * 2  # "auto": hidden_size², in bf16
    assert deep.details["deepspeed"]["stage3_prefetch_bucket_size"] == int(0.9 * hidden * hidden)
    plain = plan(tiny_llama, **knobs)
    assert "deepspeed" not in plain.details
    assert deep.device_total_bytes != plain.device_total_bytes
    # A stage the run is not sharded with (one GPU): DeepSpeed's settings change nothing.
    one = dict(knobs, gpus=1, shard="none")
    assert (
        plan(tiny_llama, deepspeed=replace(zero, stage=2), **one).device_total_bytes
        == plan(tiny_llama, **one).device_total_bytes
    )


def test_under_zero3_a_reference_pass_gathers_as_forward_does():
    zero = ZeroSettings("ds.json", stage=3, offload_param=True)
    plain, dpo = _terms(zero), _terms(zero, reference_pass=True)
    for name in ("gathered layer", "stage3_prefetch_bucket_size", "root group", "offload_param"):
        assert not plain[name].live_in("reference") and dpo[name].live_in("reference") and dpo[name].live_in("forward")
    assert not dpo["stage3_max_reuse_distance"].live_in("reference") and not dpo["fresh gradients"].live_in("reference")
