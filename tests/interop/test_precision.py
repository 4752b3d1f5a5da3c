"""What the Trainer's stack stores, turned into memfit's precision: the rules every tool's map shares."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from memfit.interop.deepspeed import ZeroSettings
from memfit.interop.keys import Planned
from memfit.interop.precision import settle_zero_precision, trainer_precision, uses_fsdp, zero_half
from memfit.spec import make_spec


def _ctx(shard: str | None = None, zero: ZeroSettings | None = None) -> SimpleNamespace:
    return SimpleNamespace(knobs={"shard": shard} if shard else {}, zero=zero, approximated=[])


@pytest.mark.parametrize(
    "method, weights, half, expected",
    [
        ("full", "fp32", "bf16", "bf16-mixed"),  # fp32 weights under autocast: the Trainer's bf16=True
        ("full", "fp32", "fp16", "fp16-mixed"),
        ("full", "fp32", None, "fp32"),
        ("full", "bf16", "bf16", "bf16"),  # a bf16 model trained as it is: pure bf16 (the hf recipe autocasts)
        ("full", "bf16", None, "bf16"),
        ("lora", "bf16", "bf16", "bf16"),  # a 16-bit base, fp32 adapters
        ("lora", "fp16", "fp16", "fp16"),
        ("lora", "fp32", None, "fp32"),
        ("qlora", "bf16", "bf16", "bf16"),
        ("qlora", "fp32", "bf16", "bf16"),  # fp32 compute dtype, matmuls under bf16 autocast
    ],
)
def test_without_sharding_the_parameters_stay_as_given(method, weights, half, expected):
    assert trainer_precision(method, weights, half, _ctx(), where="dtype: x") == expected


def test_a_lora_base_in_fp32_under_autocast_is_planned_as_fp32_and_not_modelled():
    value = trainer_precision("lora", "fp32", "bf16", _ctx(), where="dtype: float32")
    assert isinstance(value, Planned) and value.value == "fp32" and not value.modelled
    assert "LoRA base kept in fp32 (dtype: float32)" in value.why


def test_qlora_without_autocast_computing_in_fp32_is_not_modelled():
    value = trainer_precision("qlora", "fp32", None, _ctx(), where="dtype: float32")
    assert isinstance(value, Planned) and value.value == "bf16" and not value.modelled


@pytest.mark.parametrize("shard", ["fsdp", "fsdp-offload", "zero2", "ddp"])
def test_fsdp_under_mixed_precision_upcasts_what_trains(shard):
    assert uses_fsdp(_ctx(shard))
    assert trainer_precision("full", "bf16", "bf16", _ctx(shard), where="") == "bf16-mixed"
    assert trainer_precision("full", "bf16", None, _ctx(shard), where="") == "bf16"  # no mixed precision: no upcast
    assert trainer_precision("lora", "bf16", "bf16", _ctx(shard), where="") == "bf16"  # the frozen base stays


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_s_half_casts_the_model_and_keeps_fp32_masters(stage):
    ctx = _ctx("zero2", ZeroSettings(path="ds.json", stage=stage, bf16="auto"))
    settle_zero_precision(ctx, "bf16")
    assert ctx.zero.bf16 is True and zero_half(ctx) == "bf16" and not uses_fsdp(ctx)
    for weights in ("fp32", "bf16"):
        assert trainer_precision("full", weights, "bf16", ctx, where="") == "bf16-mixed"
        assert trainer_precision("lora", weights, "bf16", ctx, where="") == "bf16"  # the base cast to bf16
    # The 16 bytes a parameter are the same; where they sit across the GPUs is said.
    assert {f.key for f in ctx.approximated} == {"deepspeed"} and "fp32 master weights partitioned" in ctx.approximated[
        0
    ].why


def test_zero_keeps_fp32_partitions_of_16_bit_weights_without_a_half_section():
    ctx = _ctx("zero2", ZeroSettings(path="ds.json", stage=2, bf16="auto"))
    settle_zero_precision(ctx, None)
    assert ctx.zero.bf16 is False and zero_half(ctx) is None
    assert trainer_precision("full", "bf16", None, ctx, where="") == "bf16-mixed"
    stage0 = _ctx("ddp", ZeroSettings(path="ds.json", stage=0))
    assert trainer_precision("full", "bf16", None, stage0, where="") == "bf16"


def test_every_precision_given_is_one_memfit_accepts():
    for method in ("full", "lora", "qlora"):
        for weights in ("fp32", "bf16"):
            for half in ("bf16", None):
                value = trainer_precision(method, weights, half, _ctx(), where="")
                precision = value.value if isinstance(value, Planned) else value
                assert make_spec(method=method, precision=precision, recipe="hf").precision == precision
