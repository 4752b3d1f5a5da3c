"""The chunked, fused loss equals the standard one (loss and gradients) and never holds all logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memfit.step.losses import (
    IGNORE_INDEX,
    ChunkedLinearCrossEntropy,
    chunked_cross_entropy,
)


def _reference(hidden, weight, labels):
    logits = hidden @ weight.t()
    logits = logits if logits.dtype == torch.float64 else logits.float()
    targets = F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("train_head", [False, True])
def test_loss_and_gradients_equal_the_standard_computation(chunk, train_head):
    torch.manual_seed(0)
    hidden = torch.randn(3, 21, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=train_head)
    labels = torch.randint(0, 50, (3, 21))
    labels[0, :5] = IGNORE_INDEX  # prompt tokens carry no loss
    ours = chunked_cross_entropy(hidden, weight, labels, chunk=chunk)
    ours.backward()
    got = (hidden.grad.clone(), weight.grad.clone() if train_head else None)
    hidden.grad = None
    weight.grad = None
    ref = _reference(hidden, weight, labels)
    ref.backward()
    assert ours.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-10, atol=1e-12)
    if train_head:
        torch.testing.assert_close(got[1], weight.grad, rtol=1e-10, atol=1e-12)


def test_fp32_within_1e_5():
    torch.manual_seed(1)
    hidden = torch.randn(2, 300, 64, requires_grad=True)
    weight = torch.randn(1000, 64) * 0.1
    labels = torch.randint(0, 1000, (2, 300))
    ours = chunked_cross_entropy(hidden, weight, labels, chunk=128)
    ours.backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    ref = _reference(hidden, weight, labels)
    ref.backward()
    assert ours.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(grad, hidden.grad, rtol=1e-5, atol=1e-7)


def test_all_labels_ignored_gives_zero_not_nan():
    hidden = torch.randn(1, 4, 8, requires_grad=True)
    loss = chunked_cross_entropy(hidden, torch.randn(10, 8), torch.full((1, 4), IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(hidden.grad == 0)


def test_at_most_one_chunk_of_logits_is_alive():
    """Counted with the planner's tracker: the largest transient is one chunk, not all tokens."""
    from memfit.planner.exact.tracker import MemoryTracker

    tokens, vocab, chunk = 4096, 2048, 256
    hidden = torch.randn(tokens, 32, requires_grad=True)
    weight = torch.randn(vocab, 32)
    labels = torch.randint(0, vocab, (tokens,))
    tracker = MemoryTracker()
    with tracker:
        tracker.reset_peak()
        start = tracker.live_device_bytes
        loss = ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk)
        loss.backward()
    extra = tracker.result().peak.allocated_bytes - start
    full_logits = tokens * vocab * 4
    assert extra < full_logits / 4  # the unchunked loss holds all logits (and their gradient)


def test_step_uses_the_fused_loss_and_matches_the_model_loss(tiny_llama):
    from transformers import AutoModelForCausalLM

    from memfit.models.build import make_config
    from memfit.step.losses import backbone_and_head, causal_lm_loss

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(tiny_llama), dtype=torch.float32)
    batch = {"input_ids": torch.randint(0, 256, (2, 24))}
    batch["labels"] = batch["input_ids"].clone()
    batch["labels"][:, :6] = IGNORE_INDEX
    assert backbone_and_head(model) is not None
    ours = causal_lm_loss(model, batch)
    ref = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
    assert ours.item() == pytest.approx(ref.item(), rel=1e-5)


def test_models_with_capped_logits_keep_their_own_loss(tiny_llama):
    from transformers import AutoModelForCausalLM

    from memfit.models.build import make_config
    from memfit.step.losses import backbone_and_head

    config = make_config(dict(tiny_llama, model_type="gemma2", head_dim=16, final_logit_softcapping=30.0))
    model = AutoModelForCausalLM.from_config(config)
    assert backbone_and_head(model) is None


# ------------------------------------------------------------------------------------------------
# Mixed precision: the fused loss under autocast


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_it_computes_as_autocast_runs_the_unfused_loss(dtype):
    # fp32 hidden states and head (full fine-tuning in bf16-mixed / fp16-mixed): the unfused loss
    # under autocast computes the logits in 16 bits from 16-bit copies of both, upcasts them, and
    # hands fp32 gradients back. The fused loss must give the same numbers.
    torch.manual_seed(2)
    hidden = (torch.randn(2, 150, 64) * 0.5).requires_grad_(True)
    weight = (torch.randn(1000, 64) * 0.1).requires_grad_(True)
    labels = torch.randint(0, 1000, (2, 150))
    with torch.autocast("cpu", dtype=dtype):
        ours = chunked_cross_entropy(hidden, weight, labels, chunk=64)
    ours.backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    with torch.autocast("cpu", dtype=dtype):
        ref = _reference(hidden, weight, labels)
    ref.backward()
    assert got[0].dtype == got[1].dtype == torch.float32
    assert ours.item() == pytest.approx(ref.item(), rel=1e-4)
    # The same 16-bit products; sums over chunks and the order of fp32 accumulation differ a little.
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(got[1], weight.grad, rtol=1e-2, atol=1e-5)


def test_under_autocast_it_keeps_the_hidden_states_in_16_bits():
    # What autocast's own matmul would keep for backward: the 16-bit copy, not the fp32 states.
    hidden = torch.randn(300, 32, requires_grad=True)
    weight = torch.randn(500, 32, requires_grad=True)
    labels = torch.randint(0, 500, (300,))
    kept = []

    def pack(tensor):
        kept.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        chunked_cross_entropy(hidden, weight, labels, chunk=64)
    assert ((300, 32), torch.bfloat16) in kept and ((300, 32), torch.float32) not in kept


def test_a_mixed_precision_step_runs_its_forward_under_autocast(tiny_llama):
    from transformers import AutoModelForCausalLM

    from memfit.models.build import make_config
    from memfit.spec import make_spec
    from memfit.step.builder import build_step

    config = make_config(tiny_llama)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    seen = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    batch = {"input_ids": torch.randint(0, 256, (1, 24))}
    batch["labels"] = batch["input_ids"].clone()
    for precision, expected in (("bf16-mixed", torch.bfloat16), ("fp16-mixed", torch.float16), ("fp32", torch.float32)):
        step = build_step(make_spec(method="full", precision=precision), config)
        loss = step.loss(model, batch)
        assert seen.pop() == expected and loss.dtype == torch.float32
        assert step.scales_loss == (precision == "fp16-mixed")


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v2"])
@pytest.mark.parametrize("routing_loss", [True, False])
def test_a_moe_model_gets_its_routing_loss_as_its_own_forward_adds_it(name, routing_loss):
    # output_router_logits on: router_aux_loss_coef x the model's load-balancing loss (padding
    # masked); DeepSeek defines none. Off: the loss alone.
    from transformers import AutoModelForCausalLM

    from memfit.models.build import make_config
    from memfit.step.batch import collate
    from memfit.step.losses import causal_lm_loss
    from memfit.train.conformance import TINY_MODELS

    torch.manual_seed(0)
    config = dict(TINY_MODELS[name], output_router_logits=routing_loss, router_aux_loss_coef=0.5)
    model = AutoModelForCausalLM.from_config(make_config(config))
    examples = [
        {"input_ids": list(range(3, 15)), "labels": list(range(3, 15))},
        {"input_ids": list(range(20, 29)), "labels": list(range(20, 29))},
    ]
    batch = collate(examples, 0)
    ours = causal_lm_loss(model, batch)
    theirs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    plain = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        labels=batch["labels"],
        output_router_logits=False,
    ).loss
    assert (ours.item() != pytest.approx(plain.item(), rel=1e-6)) == (routing_loss and name != "deepseek_v2")
