"""Offloaded checkpointing gives the same numbers as plain checkpointing, and moves the layer inputs.

Tiny Llama models with random weights, on the CPU (the synchronous path), plus one CUDA test.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.spec import make_spec
from memfit.step.losses import causal_lm_loss
from memfit.step.offload import (
    MIN_OFFLOAD_BYTES,
    ActivationOffloader,
    enable_offloaded_checkpointing,
    offloader_of,
    pinned_host_copies,
)
from memfit.step.prepare import attach_lora, enable_checkpointing
from memfit.step.train_step import train_step

LAYERS = 3
HIDDEN = 64
BATCH, SEQ = 2, 32  # one layer input: 2 x 32 x 64 x 4 B = 16 KiB, above MIN_OFFLOAD_BYTES


@pytest.fixture(autouse=True)
def _one_thread():
    # These models are tiny: a second intra-op thread only spins (milliseconds a matmul on a busy CPU).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config(num_layers: int = LAYERS):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=176,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        use_cache=False,
    )


def build(
    method: str, *, offload: bool, device: str = "cpu", seed: int = 0, attention: str = "sdpa"
) -> torch.nn.Module:
    """A tiny Llama with checkpointing on (offloaded or not); same seed, same weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32, attn_implementation=attention)
    if method == "lora":
        model = attach_lora(model, make_spec(method="lora", rank=4, dropout=0.1, precision="fp32"))
        # PEFT starts B at zero, which would make every A gradient zero; give B values.
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    model.to(device)
    enable_checkpointing(model)
    if offload:
        assert enable_offloaded_checkpointing(model) == LAYERS
    model.train()
    return model


def batch(seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=g).to(device)
    return {"input_ids": ids, "labels": ids.clone()}


def grads_after_backward(model: torch.nn.Module, device: str = "cpu") -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(1)  # LoRA dropout draws the same masks in both runs
    loss = causal_lm_loss(model, batch(0, device))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("method", ["lora", "full"])
def test_gradients_equal_plain_checkpointing(method):
    plain = build(method, offload=False)
    offloaded = build(method, offload=True)
    loss_plain, grads_plain = grads_after_backward(plain)
    loss_off, grads_off = grads_after_backward(offloaded)
    assert loss_off == loss_plain
    assert grads_plain.keys() == grads_off.keys()
    trainable = sum(p.numel() for p in offloaded.parameters() if p.requires_grad)
    if method == "full":
        assert trainable == sum(p.numel() for p in offloaded.parameters())
    else:
        assert any("lora_A" in n for n in grads_off) and any("lora_B" in n for n in grads_off)
    for name, grad in grads_plain.items():
        assert torch.equal(grads_off[name], grad), name
    assert any(g.abs().sum() > 0 for g in grads_off.values())
    stats = offloader_of(offloaded).stats
    assert stats.tensors_packed == LAYERS and stats.tensors_unpacked == LAYERS


@pytest.mark.parametrize("method", ["lora", "full"])
def test_adamw_steps_with_gradient_accumulation_equal_plain_checkpointing(method):
    def run(model):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        torch.manual_seed(2)
        losses = []
        for step in range(3):
            loss, _ = train_step(
                model, [batch(10 * step), batch(10 * step + 1)], optimizer, loss_fn=causal_lm_loss, max_grad_norm=1.0
            )
            losses.append(float(loss))
        return losses, {n: p.detach().clone() for n, p in model.named_parameters()}

    losses_plain, weights_plain = run(build(method, offload=False))
    offloaded = build(method, offload=True)
    losses_off, weights_off = run(offloaded)
    assert losses_off == losses_plain
    assert losses_off[0] != losses_off[-1]  # the weights did move
    for name, weight in weights_plain.items():
        assert torch.equal(weights_off[name], weight), name
    stats = offloader_of(offloaded).stats
    # One layer input per layer and micro-batch, nothing else (3 steps x 2 micro-batches).
    assert stats.tensors_packed == LAYERS * 2 * 3
    assert stats.tensors_unpacked == stats.tensors_packed
    assert stats.bytes_packed == stats.tensors_packed * BATCH * SEQ * HIDDEN * 4


class _Spy:
    """Logs the offloader's unpacks and copies back, and keeps weak references to its host copies."""

    def __init__(self, offloader: ActivationOffloader) -> None:
        self.log: list[tuple[str, int]] = []
        self.host_refs: list[weakref.ref] = []
        self.handle_refs: list[weakref.ref] = []
        pack, unpack, fetch = offloader._pack, offloader._unpack, offloader._fetch

        def spy_pack(tensor):
            handle = pack(tensor)
            if handle is not tensor:
                self.host_refs.append(weakref.ref(handle.host))
                self.handle_refs.append(weakref.ref(handle))
            return handle

        def spy_unpack(handle):
            self.log.append(("unpack", handle.index))
            return unpack(handle)

        def spy_fetch(handle):
            self.log.append(("fetch", handle.index))
            fetch(handle)

        offloader._pack, offloader._unpack, offloader._fetch = spy_pack, spy_unpack, spy_fetch


def test_backward_prefetches_the_previous_layer_before_its_unpack_and_frees_every_copy():
    model = build("lora", offload=True)
    offloader = offloader_of(model)
    spy = _Spy(offloader)
    for micro_batch in range(2):  # gradient accumulation: a second forward and backward in the step
        spy.log.clear()
        loss = causal_lm_loss(model, batch(micro_batch))
        assert len(spy.host_refs) == LAYERS * (micro_batch + 1)
        assert all(ref() is not None for ref in spy.host_refs[-LAYERS:])  # held through forward
        loss.backward()
        # Last layer first: its own copy is made when it is needed (nothing could prefetch it), and
        # each earlier layer's copy is started while the layer after it is unpacked.
        assert spy.log == [("unpack", 2), ("fetch", 2), ("fetch", 1), ("unpack", 1), ("fetch", 0), ("unpack", 0)]
        # Every host copy is gone once backward returns, though the loss (and its graph) is alive.
        assert all(ref() is None for ref in spy.host_refs)
        assert all(ref() is None or ref().consumed for ref in spy.handle_refs)
        assert offloader._last_packed is None
        del loss
    assert offloader.stats.prefetches == 2 * (LAYERS - 1)
    assert offloader.stats.sync_fetches == 2


def test_no_offload_in_eval_or_without_grad():
    model = build("lora", offload=True)
    offloader = offloader_of(model)
    model.eval()
    with torch.no_grad():
        causal_lm_loss(model, batch(0))
    model.train()
    with torch.no_grad():  # checkpointing saves nothing without autograd
        causal_lm_loss(model, batch(0))
    assert offloader.stats.tensors_packed == 0


def test_enabling_twice_is_harmless():
    model = build("lora", offload=True)
    offloader = offloader_of(model)
    assert enable_offloaded_checkpointing(model) == LAYERS
    assert offloader_of(model) is offloader
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert len(layers) == LAYERS
    for layer in layers:
        func = layer._gradient_checkpointing_func
        assert func.func == offloader.checkpoint and "use_reentrant" not in func.keywords
    causal_lm_loss(model, batch(0)).backward()
    assert offloader.stats.tensors_packed == LAYERS


def test_needs_checkpointing_enabled_first():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32)
    with pytest.raises(ValueError, match="activation_checkpointing_enable"):
        enable_offloaded_checkpointing(model)
    with pytest.raises(ValueError, match="min_offload_bytes"):
        ActivationOffloader(min_offload_bytes=-1)


def test_small_integer_and_parameter_inputs_stay_where_they_are():
    offloader = ActivationOffloader()
    weight = torch.nn.Parameter(torch.randn(64, 64))  # 16 KiB, but a parameter
    big = torch.randn(32, 64, requires_grad=True)  # 8 KiB: offloaded
    small = torch.randn(4, requires_grad=True)  # 16 B: kept
    index = torch.arange(32)  # not floating: kept
    assert big.numel() * 4 >= MIN_OFFLOAD_BYTES > small.numel() * 4

    def fn(x, s, idx, w):
        return ((x @ w)[idx] * s.sum()).tanh()

    out = offloader.checkpoint(fn, big, small, index, weight)
    assert offloader.stats.tensors_packed == 1 and offloader.stats.bytes_packed == 32 * 64 * 4
    out.sum().backward()
    expected = torch.autograd.grad(fn(big, small, index, weight).sum(), [big, small, weight])
    assert torch.equal(big.grad, expected[0])
    assert torch.equal(small.grad, expected[1])
    assert torch.equal(weight.grad, expected[2])


def test_second_backward_through_the_same_graph_is_refused_clearly():
    offloader = ActivationOffloader()
    x = torch.randn(32, 64, requires_grad=True)
    out = offloader.checkpoint(lambda t: t.sin(), x)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        out.sum().backward()


def test_pinned_host_copies_on_real_cpu_tensors_without_an_accelerator():
    if torch.cuda.is_available():
        pytest.skip("checks the fallback for machines without a pinned-memory allocator")
    model = build("full", offload=True)
    with pinned_host_copies():
        loss = causal_lm_loss(model, batch(0))
    loss.backward()
    assert offloader_of(model).stats.tensors_unpacked == LAYERS


# ------------------------------------------------------------------------------------------------
# The planner's view: fake tensors on the CPU, memory counted by the tracker


def _tracked_step(offload: bool, num_layers: int, seq_len: int):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.models.build import build_meta_model, materialize
    from memfit.planner.exact.tracker import MemoryTracker
    from memfit.step.prepare import prepare_for_method

    config = tiny_config(num_layers)
    spec = make_spec(method="lora", rank=4, precision="fp32", checkpointing="on")
    model = prepare_for_method(build_meta_model(config, torch.float32), spec)
    if offload:
        assert enable_offloaded_checkpointing(model) == num_layers
    tracker = MemoryTracker()
    with FakeTensorMode(allow_non_fake_inputs=True), tracker, pinned_host_copies():
        model = materialize(model, "cpu")
        model.train()
        tracker.mark_model(model)
        ids = torch.zeros(1, seq_len, dtype=torch.long)
        tracker.reset_peak()
        tracker.set_phase("forward")
        loss = causal_lm_loss(model, {"input_ids": ids, "labels": ids})
        tracker.set_phase("backward")
        loss.backward()
        del loss
        tracker.set_phase("idle")
    return tracker.result()


def test_planner_sees_layer_inputs_in_host_memory_and_a_lower_device_peak():
    from memfit.planner.exact.tracker import round_block_bytes

    num_layers, seq_len = 8, 1024  # layer inputs (8 x 256 KiB) outweigh one layer's recomputation
    plain = _tracked_step(False, num_layers, seq_len)
    offloaded = _tracked_step(True, num_layers, seq_len)
    layer_input_bytes = round_block_bytes(seq_len * HIDDEN * 4)
    assert plain.outside_peaks.get("host", 0) == 0
    assert offloaded.outside_peaks["host"] == num_layers * layer_input_bytes
    # Host copies die in backward, as on CUDA.
    host = [a for a in offloaded.allocations if a.place == "host"]
    assert len(host) == num_layers and all(a.free_event is not None for a in host)
    # Between forward and backward, every layer input but the first has left the device (with LoRA
    # the first is the embedding output, a leaf that requires grad: autograd itself keeps it).
    held_plain = plain.segments()[0].end_bytes
    held_offloaded = offloaded.segments()[0].end_bytes
    assert [s.phase for s in offloaded.segments()] == ["forward", "backward"]
    assert held_plain - held_offloaded == (num_layers - 1) * layer_input_bytes
    # In backward the device holds that first input, the recomputed layer's copy and the prefetched
    # one, against all inputs with plain checkpointing at its peak (the first layer recomputed). The
    # offloaded peak comes last, after every LoRA gradient has been made.
    gradient_bytes = offloaded.peak.categories["trainable"]  # each gradient is its parameter's size
    saved = plain.peak.allocated_bytes - offloaded.peak.allocated_bytes
    assert saved >= (num_layers - 3) * layer_input_bytes - gradient_bytes
    assert saved > num_layers // 2 * layer_input_bytes


# ------------------------------------------------------------------------------------------------
# CUDA


class _CrossDeviceCopies(TorchDispatchMode):
    """Records, for every copy between host and device, its direction and the stream it ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, torch.cuda.Stream, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and args[0].device.type != args[1].device.type:
            direction = f"{args[1].device.type}->{args[0].device.type}"
            self.copies.append((direction, torch.cuda.current_stream(), args[0].numel()))
        return func(*args, **(kwargs or {}))


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["lora", "full"])
def test_cuda_equal_gradients_and_copies_on_the_side_stream(method):
    # Eager attention: its kernels are deterministic, so equal inputs give bit-equal gradients.
    plain = build(method, offload=False, device="cuda", attention="eager")
    offloaded = build(method, offload=True, device="cuda", attention="eager")
    loss_plain, grads_plain = grads_after_backward(plain, "cuda")
    offloader = offloader_of(offloaded)
    pinned = []
    pack_cuda = offloader._pack_cuda

    def spy_pack_cuda(source, last):
        handle = pack_cuda(source, last)
        pinned.append(handle.host.is_pinned())
        return handle

    offloader._pack_cuda = spy_pack_cuda
    with _CrossDeviceCopies() as seen:
        loss_off, grads_off = grads_after_backward(offloaded, "cuda")
    torch.cuda.synchronize()
    assert loss_off == loss_plain
    for name, grad in grads_plain.items():
        assert torch.equal(grads_off[name], grad), name
    assert pinned == [True] * LAYERS
    (copy_stream,) = offloader._copy_streams.values()
    assert copy_stream != torch.cuda.current_stream()
    # The layer inputs' copies (other host-device copies, if any, are not the offloader's).
    layer_inputs = [(d, stream) for d, stream, numel in seen.copies if numel == BATCH * SEQ * HIDDEN]
    directions = [d for d, _ in layer_inputs]
    assert directions.count("cuda->cpu") == LAYERS and directions.count("cpu->cuda") == LAYERS
    assert all(stream == copy_stream for _, stream in layer_inputs)
    assert offloader.stats.prefetches == LAYERS - 1 and offloader.stats.sync_fetches == 1
