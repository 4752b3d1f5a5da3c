"""Padding-free batches: the examples of a micro-batch in one row give the loss and the gradients of
running them one by one, with no token of one example attending to another."""

from __future__ import annotations

import copy

import pytest
import torch

from memfit.models.build import make_config
from memfit.spec import make_spec
from memfit.step.attention import (
    IMPLEMENTATION,
    batch_layout,
    document_attention,
    unsupported_reason,
    use_document_attention,
)
from memfit.step.batch import DOCUMENTS, PADDED, collate
from memfit.step.losses import causal_lm_loss

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 97,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
QWEN2 = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "vocab_size": 97,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}

#: Multi-head latent attention: values (16 wide) narrower than queries and keys (24), and experts.
DEEPSEEK_V2 = {
    "model_type": "deepseek_v2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "vocab_size": 97,
    "max_position_embeddings": 256,
}


def _examples(lengths, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] + ids[1:]})
    return out


def _model(config_dict, dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config(config_dict), dtype=dtype, attn_implementation="sdpa")


def _loss_and_grads(model, batches, loss_fn=causal_lm_loss):
    """Token-weighted mean loss over ``batches`` and the gradients of that loss."""
    model.zero_grad(set_to_none=True)
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    total = sum(counts)
    loss = sum(loss_fn(model, b) * (n / total) for b, n in zip(batches, counts))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "config_dict, dtype, tol",
    [
        (LLAMA, torch.float64, 1e-10),
        (LLAMA, torch.float32, 1e-5),
        (QWEN2, torch.float64, 1e-10),
        (QWEN2, torch.float32, 1e-5),
        # its experts' grouped matmuls take no fp64
        (DEEPSEEK_V2, torch.float32, 1e-5),
    ],
    ids=["llama-fp64", "llama-fp32", "qwen2-fp64", "qwen2-fp32", "deepseek_v2-fp32"],
)
def test_one_row_equals_the_examples_one_by_one(config_dict, dtype, tol):
    examples = _examples([17, 5, 40, 1, 23])
    alone = _model(config_dict, dtype)
    row = copy.deepcopy(alone)
    use_document_attention(row)
    assert row.config._attn_implementation == IMPLEMENTATION
    ref_loss, ref_grads = _loss_and_grads(alone, [collate([e], 0) for e in examples])
    loss, grads = _loss_and_grads(row, [collate(examples, 0, layout=DOCUMENTS)])
    assert abs(float(loss) - float(ref_loss)) <= tol * abs(float(ref_loss))
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert g.abs().sum() > 0, name
        assert float((grads[name] - g).norm() / g.norm()) <= tol, name


def test_under_autocast_one_row_equals_the_examples_one_by_one():
    # fp32 weights under bf16 autocast (bf16-mixed): rotary embeddings leave the query and key in
    # fp32 and the value in bf16; the op computes in bf16, as SDPA under autocast does for the
    # examples one by one.
    examples = _examples([17, 5, 40, 1, 23])
    alone = _model(LLAMA, torch.float32)
    row = copy.deepcopy(alone)
    use_document_attention(row)

    def autocast_loss(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # forward only: backward runs outside, as in the step
            return causal_lm_loss(model, batch)

    ref_loss, ref_grads = _loss_and_grads(alone, [collate([e], 0) for e in examples], autocast_loss)
    loss, grads = _loss_and_grads(row, [collate(examples, 0, layout=DOCUMENTS)], autocast_loss)
    assert abs(float(loss) - float(ref_loss)) <= 1e-3 * abs(float(ref_loss))
    for name, g in ref_grads.items():
        assert grads[name].dtype == torch.float32
        assert float((grads[name] - g).norm() / g.norm()) <= 2e-2, name


def test_no_token_attends_to_another_example():
    # Changing the first example changes nothing of the second's outputs in the same row.
    model = _model(LLAMA, torch.float32).eval()
    use_document_attention(model)
    a, b = _examples([12, 9], seed=1)
    changed = dict(a, input_ids=[(t + 1) % 97 for t in a["input_ids"]])
    with torch.no_grad():
        first = collate([a, b], 0, layout=DOCUMENTS)
        second = collate([changed, b], 0, layout=DOCUMENTS)
        out1 = model(
            input_ids=first["input_ids"], position_ids=first["position_ids"], memfit_documents=first["documents"]
        ).logits
        out2 = model(
            input_ids=second["input_ids"], position_ids=second["position_ids"], memfit_documents=second["documents"]
        ).logits
    assert not torch.allclose(out1[0, :12], out2[0, :12])
    torch.testing.assert_close(out1[0, 12:], out2[0, 12:], rtol=0, atol=0)


def test_the_op_matches_sdpa_example_by_example_with_grouped_query_heads():
    torch.manual_seed(0)
    lengths = [7, 1, 12]
    q = torch.randn(20, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(20, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(20, 2, 8, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    out = document_attention(q, k, v, cu, lengths, 8**-0.5)
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    refs = []
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1), is_causal=True, enable_gqa=True
        )
        refs.append(o.transpose(0, 1))
        start += n
    ref = torch.cat(refs)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), grad)
    for got, want in ((out, ref), (dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_fake_tensors_allocate_what_the_flash_kernel_keeps():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(4096, 8, 64, dtype=torch.bfloat16)
        k = torch.empty(4096, 2, 64, dtype=torch.bfloat16)
        out, lse, rng = torch.ops.memfit.document_attention(
            q, k, k, torch.empty(3, dtype=torch.int32), [1000, 3096], 0.125
        )
    assert out.shape == (4096, 8, 64) and out.dtype == torch.bfloat16
    assert lse.shape == (8, 4096) and lse.dtype == torch.float32
    assert rng.shape == (2,) and rng.dtype == torch.uint64


def test_which_models_and_layouts():
    llama = make_config(LLAMA)
    assert unsupported_reason(llama) is None
    gemma2 = make_config(
        {
            "model_type": "gemma2",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 97,
        }
    )
    assert "soft-caps" in unsupported_reason(gemma2) or "sliding" in unsupported_reason(gemma2)
    assert batch_layout(make_spec(), llama) == DOCUMENTS
    assert batch_layout(make_spec(padding_free="off"), llama) == PADDED
    assert batch_layout(make_spec(padding_free="off", packing=True), llama) == DOCUMENTS
    assert batch_layout(make_spec(recipe="hf", packing=True), llama) == PADDED  # the plain stack pads
    assert batch_layout(make_spec(), gemma2) == PADDED  # auto: where the model allows it
    with pytest.raises(ValueError, match="packing: examples packed in one row need attention kept inside each example"):
        batch_layout(make_spec(packing=True), gemma2)
    with pytest.raises(ValueError, match="padding_free: on needs attention kept inside each example"):
        batch_layout(make_spec(padding_free="on"), gemma2)


@pytest.mark.gpu
def test_flash_kernel_on_cuda_equals_the_cpu_path():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("needs a CUDA device with flash attention (compute capability 8.0+)")
    torch.manual_seed(0)
    lengths = [300, 17, 700]
    q = torch.randn(1017, 8, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    k = torch.randn(1017, 2, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    v = torch.randn(1017, 2, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    cu = torch.tensor([0, 300, 317, 1017], dtype=torch.int32, device="cuda")
    out = document_attention(q, k, v, cu, lengths, 0.125)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    cpu = [t.detach().cpu().float().requires_grad_(True) for t in (q, k, v)]
    ref = document_attention(*cpu, cu.cpu(), lengths, 0.125)
    ref_grads = torch.autograd.grad(ref.sum(), cpu)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.float().cpu(), want, rtol=5e-2, atol=5e-2)
