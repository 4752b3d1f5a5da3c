"""Mixed precision in plans: the model states it costs, and autocast on the planner's CPU device.

``bf16-mixed`` full fine-tuning keeps fp32 weights, gradients and AdamW states (16 bytes a
parameter) where pure ``bf16`` keeps 8; a LoRA base stays 16-bit. The planner runs the step under
the CPU's autocast: what it casts must be what CUDA's autocast casts for the models memfit ships.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memfit
from memfit.models.build import DTYPES, build_meta_model, make_config
from memfit.planner.exact.simulate import simulate
from memfit.planner.exact.tracker import round_block_bytes
from memfit.spec import make_spec
from memfit.step import losses
from memfit.step.prepare import prepare_for_method


def _at_optimizer_start(result) -> dict[str, int]:
    marks = [index for name, index in result.phase_marks if name == "optimizer"]
    return result.categories_at(marks[-1])


def _params(config: dict, spec) -> list[torch.nn.Parameter]:
    return list(
        prepare_for_method(build_meta_model(make_config(config), DTYPES[spec.weight_precision]), spec).parameters()
    )


def test_full_bf16_mixed_is_sixteen_bytes_a_parameter(tiny_llama):
    spec = make_spec(method="full", precision="bf16-mixed", seq_len=32)
    params = _params(tiny_llama, spec)
    assert {p.dtype for p in params} == {torch.float32}
    at_step = _at_optimizer_start(simulate(tiny_llama, spec).tracker)
    fp32_bytes = sum(round_block_bytes(4 * p.numel()) for p in params)
    assert at_step["trainable"] == fp32_bytes  # fp32 weights: 4 bytes a parameter
    assert at_step["gradients"] == fp32_bytes  # fp32 gradients: 4
    assert at_step["optimizer"] == 2 * fp32_bytes + 512 * len(params)  # two fp32 AdamW states (+ step counts): 8


def test_lora_under_mixed_precision_keeps_a_16_bit_base_and_fp32_adapters(tiny_llama):
    params = _params(tiny_llama, make_spec(method="lora", precision="bf16-mixed"))
    assert {p.dtype for p in params if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in params if p.requires_grad} == {torch.float32}


def test_plan_of_full_fine_tuning_in_bf16_mixed_needs_16_bytes_a_parameter_and_pure_bf16_8():
    states = {}
    for precision in ("bf16", "bf16-mixed"):
        plan = memfit.plan("smollm2-135m", method="full", precision=precision, seq_len=256)
        params = plan.details["total_params"]
        states[precision] = sum(plan.categories[name] for name in ("trainable", "gradients", "optimizer")) / params
        assert plan.details["precision_regime"] == make_spec(method="full", precision=precision).precision_regime
    assert states["bf16-mixed"] >= 16.0
    assert 8.0 <= states["bf16"] < 8.1  # (the 512-byte blocks of small tensors: a little over 8)


@pytest.mark.parametrize(
    "knobs",
    [
        dict(method="full", precision="bf16-mixed", tiling="on", checkpointing="offload"),
        dict(method="full", precision="bf16-mixed", checkpointing="off", padding_free="off", batch_size=2),
        dict(method="full", precision="bf16-mixed", step_in_backward=True),
        dict(method="full", precision="fp16-mixed"),
        dict(method="lora", precision="fp16-mixed", tiling="on"),
        dict(method="full", precision="bf16-mixed", recipe="hf"),
    ],
    ids=lambda k: "-".join(str(v) for v in k.values()),
)
def test_fake_and_real_mixed_precision_runs_count_the_same_bytes(tiny_llama, knobs):
    spec = make_spec(seq_len=64, **knobs)
    fake = simulate(tiny_llama, spec, fake=True).tracker
    real = simulate(tiny_llama, spec, fake=False).tracker
    assert fake.peak.allocated_bytes == real.peak.allocated_bytes
    assert fake.peak.categories == real.peak.categories


# ------------------------------------------------------------------------------------------------
# Autocast on the CPU and on CUDA

#: Ops that CUDA's autocast runs in fp32 (its ``fp32`` and ``fp32_set_opt_dtype`` policies), as the
#: dispatcher sees them (``softmax`` arrives as ``_softmax``, ``layer_norm`` as
#: ``native_layer_norm``). The CPU's autocast leaves most of them in 16 bits: a 16-bit input to one
#: of them inside an autocast forward is where a plan made on the CPU would differ from CUDA.
CUDA_AUTOCAST_FP32_OPS = frozenset(
    {
        "acos",
        "asin",
        "cosh",
        "sinh",
        "tan",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
        "pow",
        "softplus",
        "native_layer_norm",
        "native_group_norm",
        "norm",
        "linalg_vector_norm",
        "logsumexp",
        "_softmax",
        "_log_softmax",
        "sum",
        "prod",
        "cumsum",
        "cumprod",
        "nll_loss_forward",
        "mse_loss",
        "l1_loss",
        "binary_cross_entropy_with_logits",
        "kl_div",
    }
)


class _CudaAutocastDifferences(TorchDispatchMode):
    """Records ops of :data:`CUDA_AUTOCAST_FP32_OPS` called on a 16-bit input without a dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.found: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        half = (torch.bfloat16, torch.float16)
        if func.overloadpacket.__name__ in CUDA_AUTOCAST_FP32_OPS and kwargs.get("dtype") is None:
            if any(isinstance(a, torch.Tensor) and a.dtype in half for a in args):
                self.found.add(str(func))
        return func(*args, **kwargs)


_SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
)

#: One tiny model of each architecture in memfit's catalog.
_ARCHITECTURES = {
    "llama": dict(model_type="llama", **_SMALL),
    "qwen2": dict(model_type="qwen2", **_SMALL),
    "qwen3": dict(model_type="qwen3", head_dim=16, **_SMALL),
    "mistral": dict(model_type="mistral", **_SMALL),
    "phi3": dict(model_type="phi3", pad_token_id=0, **_SMALL),
    "gemma2": dict(model_type="gemma2", head_dim=16, **_SMALL),
}


def test_the_check_sees_what_cuda_autocast_would_cast():
    check = _CudaAutocastDifferences()
    with torch.autocast("cpu", dtype=torch.bfloat16), check:
        scores = torch.randn(4, 4) @ torch.randn(4, 4)  # bf16 under autocast
        torch.softmax(scores, -1)
    assert check.found == {"aten._softmax.default"}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("architecture", list(_ARCHITECTURES))
def test_cpu_autocast_computes_the_catalog_architectures_as_cuda_autocast(architecture, method, monkeypatch):
    # Every op of a bf16-mixed forward (padded batches: transformers' own attention path too) that
    # CUDA's autocast would run in fp32 already gets fp32 inputs on the CPU: the formats, hence the
    # bytes, of the planned step are those of the CUDA step.
    check = _CudaAutocastDifferences()
    autocast_loss = losses.autocast_loss

    def checked(model, batch, *, loss_fn, dtype):
        def forward(model, batch):
            with check:
                return loss_fn(model, batch)

        return autocast_loss(model, batch, loss_fn=forward, dtype=dtype)

    monkeypatch.setattr(losses, "autocast_loss", checked)
    spec = make_spec(method=method, precision="bf16-mixed", seq_len=32, batch_size=2, padding_free="off")
    simulate(_ARCHITECTURES[architecture], spec, fake=False)
    assert not check.found, f"ops CUDA's autocast runs in fp32 got 16-bit inputs on the CPU: {sorted(check.found)}"
