"""The sequence-tiled MLP equals the untiled one (outputs, gradients, optimizer steps) and keeps
only one chunk of ``[tokens, intermediate_size]`` tensors alive."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.models.build import build_meta_model, materialize
from memfit.models.layers import decoder_layers
from memfit.models.quantize import quantize_linears_on_meta
from memfit.spec import RunSpec
from memfit.step.prepare import attach_lora, enable_checkpointing
from memfit.step.tiling import DEFAULT_TILE_TOKENS, is_tiled, tile_mlps

INTERMEDIATE = 176  # a width no other tensor of the tiny models has (hidden 64, vocab 128)
CHUNK = 64  # does not divide the 2 x 75 = 150 tokens of the default batch
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _config(model_type: str):
    from transformers import Gemma2Config, LlamaConfig, Qwen2Config

    common = dict(
        hidden_size=64,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    if model_type == "llama":
        return LlamaConfig(**common)
    if model_type == "qwen2":
        return Qwen2Config(**common)
    return Gemma2Config(head_dim=16, sliding_window=32, **common)


def _build(
    model_type: str, method: str, dtype: torch.dtype, *, dropout: float = 0.0, checkpointing: bool = False
) -> nn.Module:
    """A tiny model with random weights; LoRA B matrices random too (PEFT starts them at zero,
    which would make every LoRA A gradient zero and the comparison weak)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(model_type), dtype=dtype, attn_implementation="eager")
    if method == "lora":
        model = attach_lora(model, RunSpec(method="lora", rank=4, dropout=dropout, precision="fp32"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.05)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    model.train()
    if checkpointing:
        enable_checkpointing(model)
    return model


def _batch(dtype: torch.dtype, batch: int = 2, seq_len: int = 75) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (batch, seq_len), generator=g)
    embeds = (torch.randn(batch, seq_len, 64, generator=g) * 0.5).to(dtype)
    return ids, embeds


def _step(model: nn.Module, ids: torch.Tensor, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Forward + backward; returns (logits, grad of the input embeddings, trainable grads by name)."""
    model.zero_grad(set_to_none=True)
    x = embeds.clone().requires_grad_(True)
    out = model(inputs_embeds=x, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return out.logits.detach(), x.grad.clone(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def _assert_same(ref: tuple, tiled: tuple, tol: float) -> None:
    logits_ref, xgrad_ref, grads_ref = ref
    logits, xgrad, grads = tiled
    assert _rel(logits, logits_ref) <= tol
    assert _rel(xgrad, xgrad_ref) <= tol
    assert grads.keys() == grads_ref.keys() and grads_ref
    for name, g in grads_ref.items():
        assert g.abs().sum() > 0, name  # a zero gradient would make the comparison vacuous
        assert _rel(grads[name], g) <= tol, name


# ------------------------------------------------------------------------------------------------
# equality with the untiled model


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_outputs_and_gradients_equal_untiled(dtype, method, checkpointing):
    ref_model = _build("llama", method, dtype, checkpointing=checkpointing)
    tiled_model = copy.deepcopy(ref_model)
    assert tile_mlps(tiled_model, CHUNK) == 2
    ids, embeds = _batch(dtype)
    _assert_same(_step(ref_model, ids, embeds), _step(tiled_model, ids, embeds), TOL[dtype])


@pytest.mark.parametrize("model_type", ["qwen2", "gemma2"])
def test_other_architectures_equal_untiled(model_type):
    ref_model = _build(model_type, "lora", torch.float64, checkpointing=True)
    tiled_model = copy.deepcopy(ref_model)
    assert tile_mlps(tiled_model, CHUNK) == 2
    ids, embeds = _batch(torch.float64)
    _assert_same(_step(ref_model, ids, embeds), _step(tiled_model, ids, embeds), TOL[torch.float64])


def test_adamw_steps_equal_untiled():
    ref_model = _build("llama", "full", torch.float32)
    tiled_model = copy.deepcopy(ref_model)
    tile_mlps(tiled_model, CHUNK)
    initial = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    ids, embeds = _batch(torch.float32)
    for model in (ref_model, tiled_model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(3):
            _step(model, ids, embeds)
            opt.step()
    ref = dict(ref_model.named_parameters())
    for name, p in tiled_model.named_parameters():
        if ".mlp." in name:
            assert not torch.equal(p.detach(), initial[name]), name  # the steps did move it
        assert _rel(p.detach(), ref[name].detach()) <= 1e-5, name


@pytest.mark.parametrize("checkpointing", [False, True])
def test_mixed_precision_recomputes_under_the_forwards_autocast(checkpointing):
    # fp32 weights, forward under bf16 autocast (bf16-mixed): the chunks recomputed in backward
    # run in bf16 too, as forward ran them, and the gradients are the untiled model's.
    ref_model = _build("llama", "full", torch.float32, checkpointing=checkpointing)
    tiled_model = copy.deepcopy(ref_model)
    tile_mlps(tiled_model, CHUNK)
    recomputed = []
    decoder_layers(tiled_model)[0].mlp.gate_proj.register_forward_hook(
        lambda module, args, out: recomputed.append(out.dtype) if torch.is_grad_enabled() else None
    )
    ids, embeds = _batch(torch.float32)
    results = []
    for model in (ref_model, tiled_model):
        model.zero_grad(set_to_none=True)
        x = embeds.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(inputs_embeds=x, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert all(g.dtype == torch.float32 for g in grads.values())
        results.append((out.logits.detach(), x.grad.clone(), grads))
    assert recomputed and set(recomputed) == {torch.bfloat16}
    _assert_same(results[0], results[1], 1e-2)  # the same bf16 products, summed over other chunks


def test_qlora_4bit_frozen_weights_equal_untiled():
    torch.manual_seed(0)
    model = build_meta_model(_config("llama"), torch.float32)
    assert quantize_linears_on_meta(model, torch.float32) > 0
    materialize(model, "cpu", random_values=True)
    model = attach_lora(model, RunSpec(method="qlora", rank=4, precision="bf16"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    model.train()
    enable_checkpointing(model)
    mlp = decoder_layers(model)[0].mlp
    assert type(mlp.gate_proj.base_layer).__name__ == "Linear4bit"
    ids, embeds = _batch(torch.float32)
    # The same model before and after tiling: a deepcopy would drop the 4-bit quantization state,
    # which materialize keeps as an attribute of the packed weight.
    untiled = _step(model, ids, embeds)
    assert tile_mlps(model, CHUNK) == 2
    trainable = {n for n, p in decoder_layers(model)[0].mlp.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)  # the 4-bit weights are not inputs
    _assert_same(untiled, _step(model, ids, embeds), 1e-5)


# ------------------------------------------------------------------------------------------------
# dropout: the recompute replays the forward's masks


def _chunked_with_graph(model: nn.Module, chunk_tokens: int) -> None:
    """Reference: each MLP runs chunk by chunk in the same order as the tiled one (so it draws the
    same dropout masks), but as one ordinary autograd graph, without recomputation."""
    for block in decoder_layers(model):
        mlp = block.mlp
        untiled = type(mlp).forward

        def forward(self, x, _untiled=untiled):
            flat = x.reshape(-1, x.shape[-1])
            pieces = [_untiled(self, flat[s : s + chunk_tokens]) for s in range(0, flat.shape[0], chunk_tokens)]
            return torch.cat(pieces).view(*x.shape[:-1], -1)

        mlp.forward = types.MethodType(forward, mlp)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_dropout_masks_replayed_in_backward(checkpointing):
    ref_model = _build("llama", "lora", torch.float64, dropout=0.1, checkpointing=checkpointing)
    tiled_model = copy.deepcopy(ref_model)
    _chunked_with_graph(ref_model, CHUNK)
    tile_mlps(tiled_model, CHUNK)
    ids, embeds = _batch(torch.float64)
    results, rng_after = [], []
    for model in (ref_model, tiled_model):
        torch.manual_seed(123)
        results.append(_step(model, ids, embeds))
        rng_after.append(torch.get_rng_state())
    _assert_same(results[0], results[1], 1e-12)
    # Replaying masks in backward leaves the RNG stream where the forward left it.
    assert torch.equal(rng_after[0], rng_after[1])


def test_dropout_single_chunk_equals_untiled_with_same_seed():
    # One chunk draws the masks in the untiled order, so the untiled model itself is the reference.
    ref_model = _build("llama", "lora", torch.float64, dropout=0.1)
    tiled_model = copy.deepcopy(ref_model)
    tile_mlps(tiled_model, 10_000)
    ids, embeds = _batch(torch.float64)
    results = []
    for model in (ref_model, tiled_model):
        torch.manual_seed(7)
        results.append(_step(model, ids, embeds))
    _assert_same(results[0], results[1], 1e-12)
    # and the masks were really random: another seed gives other gradients
    torch.manual_seed(8)
    other = _step(tiled_model, ids, embeds)
    assert _rel(other[1], results[0][1]) > 1e-6


@pytest.mark.gpu
def test_dropout_masks_replayed_on_cuda():
    # On CUDA the masks come from the device's generator: its state is replayed per chunk too.
    ref_model = _build("llama", "lora", torch.float32, dropout=0.1, checkpointing=True).cuda()
    tiled_model = copy.deepcopy(ref_model)
    _chunked_with_graph(ref_model, CHUNK)
    tile_mlps(tiled_model, CHUNK)
    ids, embeds = (t.cuda() for t in _batch(torch.float32))
    results, rng_after = [], []
    for model in (ref_model, tiled_model):
        torch.manual_seed(123)
        results.append(_step(model, ids, embeds))
        rng_after.append(torch.cuda.get_rng_state())
    _assert_same(results[0], results[1], 1e-5)
    assert torch.equal(rng_after[0], rng_after[1])


# ------------------------------------------------------------------------------------------------
# memory: only one chunk of the wide tensors at a time


class _WideTensorRows(TorchDispatchMode):
    """Largest row count (elements / last dim) of any op output whose last dim is ``width``."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width
        self.max_rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.width:
                self.max_rows = max(self.max_rows, t.numel() // self.width)
        return out


@pytest.mark.parametrize("method", ["lora", "full"])
def test_wide_tensors_hold_one_chunk(method):
    chunk = 128
    ids, embeds = _batch(torch.float32, batch=2, seq_len=520)  # 1,040 tokens
    rows = {}
    for tiled in (False, True):
        model = _build("llama", method, torch.float32, checkpointing=True)
        if tiled:
            tile_mlps(model, chunk)
        with _WideTensorRows(INTERMEDIATE) as probe:
            _step(model, ids, embeds)
        rows[tiled] = probe.max_rows
    assert rows[False] >= 1040  # the untiled MLP makes [tokens, intermediate] tensors
    assert 0 < rows[True] <= chunk


# ------------------------------------------------------------------------------------------------
# structure: names, idempotence, hooks


def test_state_dict_and_parameters_unchanged_and_idempotent():
    model = _build("llama", "lora", torch.float32)
    keys = list(model.state_dict().keys())
    params = [id(p) for p in model.parameters()]
    assert tile_mlps(model, CHUNK) == 2
    assert tile_mlps(model, CHUNK) == 2
    assert list(model.state_dict().keys()) == keys
    assert [id(p) for p in model.parameters()] == params
    for block in decoder_layers(model):
        assert is_tiled(block.mlp)
        assert block.mlp.__dict__["_memfit_untiled_forward"] is None  # not the tiled forward twice
    ids, embeds = _batch(torch.float32)
    untiled = _build("llama", "lora", torch.float32)  # same seed: the same weights
    assert not any(is_tiled(b.mlp) for b in decoder_layers(untiled))
    _assert_same(_step(untiled, ids, embeds), _step(model, ids, embeds), 1e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_post_accumulate_grad_hooks_fire_once_per_backward(checkpointing):
    model = _build("llama", "full", torch.float32, checkpointing=checkpointing)
    tile_mlps(model, CHUNK)
    counts: dict[str, int] = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: counts.__setitem__(name, counts.get(name, 0) + 1))
    ids, embeds = _batch(torch.float32)
    for backward in (1, 2):
        _step(model, ids, embeds)
        mlp_names = [n for n in counts if ".mlp." in n]
        assert len(mlp_names) == 2 * 3
        assert set(counts.values()) == {backward}, counts


def test_skips_modules_that_are_not_dense_mlps():
    class Block(nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.mlp = mlp

    class Experts(nn.Module):  # fused expert weights, like transformers' MoE blocks
        def __init__(self):
            super().__init__()
            self.gate_up = nn.Parameter(torch.zeros(4, 8, 8))

        def forward(self, x):
            return x

    class TwoArgs(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x, router_logits):
            return self.proj(x)

    model = nn.Module()
    model.layers = nn.ModuleList([Block(Experts()), Block(TwoArgs()), Block(nn.Sequential(nn.Linear(8, 8)))])
    assert tile_mlps(model, 4) == 1
    assert [is_tiled(b.mlp) for b in model.layers] == [False, False, True]


def test_bad_chunk_size_named_in_error():
    model = _build("llama", "lora", torch.float32)
    for bad in (0, -3, 1.5):
        with pytest.raises(ValueError, match="chunk_tokens"):
            tile_mlps(model, bad)
    assert DEFAULT_TILE_TOKENS >= 512


def test_no_grad_forward_is_chunked_and_equal():
    ref_model = _build("llama", "lora", torch.float32)
    tiled_model = copy.deepcopy(ref_model)
    tile_mlps(tiled_model, CHUNK)
    ids, _ = _batch(torch.float32)
    ref_model.eval()
    tiled_model.eval()
    with torch.no_grad():
        ref = ref_model(input_ids=ids).logits
        with _WideTensorRows(INTERMEDIATE) as probe:
            tiled = tiled_model(input_ids=ids).logits
    assert _rel(tiled, ref) <= 1e-5
    assert probe.max_rows <= CHUNK


# ------------------------------------------------------------------------------------------------
# fake tensors (the planner runs the real step under FakeTensorMode)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_runs_under_fake_tensor_mode(dropout):
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    model = build_meta_model(_config("llama"), torch.bfloat16)
    model = attach_lora(model, RunSpec(method="lora", rank=4, dropout=dropout))
    enable_checkpointing(model)
    model.train()
    with FakeTensorMode(allow_non_fake_inputs=True):
        materialize(model, "cpu")
        assert tile_mlps(model, 256) == 2
        ids = torch.zeros(1, 1000, dtype=torch.long)
        with _WideTensorRows(INTERMEDIATE) as probe:
            model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad and ".mlp." in n]
    assert grads and all(g is not None and is_fake(g) for g in grads)
    assert probe.max_rows <= 256


def test_norms_tile_too_and_keep_gradients():
    """tile_norms: each decoder layer's RMSNorms run chunked; outputs and gradients unchanged."""
    from memfit.step.tiling import tile_norms

    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=512,
    )
    plain = LlamaForCausalLM(config).double()
    tiled = copy.deepcopy(plain)
    assert tile_norms(tiled, chunk_tokens=64) == 2 * 2  # input and post-attention norm of each layer
    assert tile_norms(tiled, chunk_tokens=64) == 4  # idempotent
    ids = torch.randint(0, 128, (2, 150))
    losses = []
    for model in (plain, tiled):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=0)
    for (name, a), (_, b) in zip(plain.named_parameters(), tiled.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)
