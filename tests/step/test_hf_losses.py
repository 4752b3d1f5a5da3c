"""The losses of Liger, TRL, torchtune, Axolotl and older transformers, as the hf recipe runs them:
the same loss and gradients as the model's own, and the memory each library's code allocates."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from memfit.planner.exact.simulate import simulate
from memfit.spec import SpecError, make_spec
from memfit.step.hf_losses import (
    COMPILED_CE_ROWS,
    TORCHTUNE_OUTPUT_CHUNKS,
    TRL_CHUNK_TOKENS,
    liger_chunk_tokens,
    liger_fused_linear_cross_entropy,
    torchtune_chunked_output_ce,
    transformers_shifted_loss,
    trl_chunked_nll,
)
from memfit.step.labels import IGNORE_INDEX
from memfit.step.losses import choose_loss


def _reference(hidden, weight, labels):
    logits = hidden.double() @ weight.double().t()
    targets = F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)


_LOSS_FNS = {
    "liger": liger_fused_linear_cross_entropy,
    "chunked-nll": trl_chunked_nll,
    "chunked-output": partial(torchtune_chunked_output_ce, compiled=False),
    "chunked-output-compiled": partial(torchtune_chunked_output_ce, compiled=True),
    "chunked-ce": partial(torchtune_chunked_output_ce, compiled=True, whole_head=True),
    "model-4.45": partial(transformers_shifted_loss, fp32_logits=True),
    "model-4.46": partial(transformers_shifted_loss, fp32_logits=False),
}


@pytest.mark.parametrize("loss_fn", list(_LOSS_FNS.values()), ids=list(_LOSS_FNS))
@pytest.mark.parametrize("train_head", [False, True])
def test_loss_and_gradients_equal_the_standard_computation(loss_fn, train_head):
    torch.manual_seed(0)
    # 3 x 300 tokens: several of Liger's chunks and of TRL's 256-token chunks.
    # fp32, as both libraries compute the loss in fp32 whatever the inputs' dtype.
    hidden = torch.randn(3, 300, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=train_head)
    labels = torch.randint(0, 50, (3, 300))
    labels[0, :40] = IGNORE_INDEX  # prompt tokens carry no loss
    ours = loss_fn(hidden, weight, labels)
    (ours * 3.0).backward()  # an upstream gradient other than 1 (fp16's loss scale, say)
    got = (hidden.grad.clone(), weight.grad.clone() if train_head else None)
    hidden.grad = weight.grad = None
    ref = _reference(hidden, weight, labels)
    (ref * 3.0).backward()
    assert ours.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-5, atol=1e-7)
    if train_head:
        torch.testing.assert_close(got[1], weight.grad, rtol=1e-5, atol=1e-7)


def test_no_labelled_token_gives_zero_loss_connected_to_the_inputs():
    hidden = torch.randn(1, 8, 4, requires_grad=True)
    weight = torch.randn(10, 4, requires_grad=True)
    loss = trl_chunked_nll(hidden, weight, torch.full((1, 8), IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad is not None and weight.grad is not None


def test_liger_chunk_holds_about_as_many_logits_as_hidden_states():
    # Liger's own example: BT = 16,384, V = 32,000, H = 4,096 -> inc_factor 8, chunks of 2,048.
    assert liger_chunk_tokens(16384, 4096, 32000) == 2048
    # Llama 3 (V = 128,256): 2,048 tokens -> 32 x 64-token chunks; one token -> one.
    assert liger_chunk_tokens(2048, 4096, 128256) == 64
    assert liger_chunk_tokens(1, 4096, 128256) == 1


def test_hf_loss_needs_the_hf_recipe():
    with pytest.raises(SpecError, match="--hf-loss: liger is a loss of the hf recipe"):
        make_spec(hf_loss="liger")
    assert make_spec(recipe="hf", hf_loss="chunked-nll").hf_loss == "chunked-nll"


def test_choose_loss_runs_the_chosen_loss_under_autocast(tiny_llama):
    from memfit.step.losses import HF_LOSSES

    for name, fn in HF_LOSSES.items():
        chosen = choose_loss(make_spec(recipe="hf", hf_loss=name))
        assert chosen.keywords["loss_fn"] is fn and chosen.keywords["dtype"] is torch.bfloat16
    assert choose_loss(make_spec(recipe="hf", hf_loss="liger", precision="fp32")) is HF_LOSSES["liger"]


def _largest(result) -> int:
    return max(a.nbytes for a in result.allocations)


@pytest.mark.parametrize("hf_loss", ["liger", "chunked-nll", "chunked-output", "chunked-output-compiled", "chunked-ce"])
def test_planned_without_the_whole_logits(tiny_llama, hf_loss):
    config = dict(tiny_llama, vocab_size=8192)  # logits large enough to matter
    tokens = 512
    logits_bytes = tokens * config["vocab_size"] * 4
    whole = simulate(config, make_spec(method="lora", seq_len=tokens, recipe="hf")).tracker
    fused = simulate(config, make_spec(method="lora", seq_len=tokens, recipe="hf", hf_loss=hf_loss)).tracker
    assert _largest(whole) >= logits_bytes
    assert _largest(fused) < logits_bytes
    assert fused.peak.allocated_bytes < whole.peak.allocated_bytes


def test_chunked_nll_makes_an_fp32_head_for_each_chunk(tiny_llama):
    # TRL's chunk upcasts the head (w.float()): a bf16 head gets an fp32 copy, V x H x 4 bytes.
    config = dict(tiny_llama, vocab_size=8192)
    head_fp32_bytes = config["vocab_size"] * config["hidden_size"] * 4
    result = simulate(
        config, make_spec(method="lora", seq_len=TRL_CHUNK_TOKENS, recipe="hf", hf_loss="chunked-nll")
    ).tracker
    assert any(a.nbytes == head_fp32_bytes for a in result.allocations)


@pytest.mark.parametrize(
    "hf_loss",
    ["liger", "chunked-nll", "chunked-output", "chunked-output-compiled", "chunked-ce", "model-4.45", "model-4.46"],
)
def test_fake_run_counts_the_same_bytes_as_a_real_run(tiny_llama, hf_loss):
    spec = make_spec(method="lora", seq_len=300, batch_size=2, recipe="hf", hf_loss=hf_loss, precision="fp32")
    fake = simulate(tiny_llama, spec, fake=True).tracker
    real = simulate(tiny_llama, spec, fake=False).tracker
    assert fake.peak.allocated_bytes == real.peak.allocated_bytes
    assert fake.peak.categories == real.peak.categories


def test_chunked_output_keeps_its_16_bit_logits_and_eagerly_their_fp32_log_probabilities(tiny_llama):
    # torchtune keeps every chunk's bf16 logits until the loss returns; eager cross-entropy keeps each
    # chunk's fp32 log-softmax on top (the whole logits in fp32 by the end of forward), the compiled one
    # only a statistic per token.
    config = dict(tiny_llama, vocab_size=8192)
    tokens = 512
    bf16_logits = tokens * config["vocab_size"] * 2
    eager = simulate(config, make_spec(method="lora", seq_len=tokens, recipe="hf", hf_loss="chunked-output")).tracker
    compiled = simulate(
        config, make_spec(method="lora", seq_len=tokens, recipe="hf", hf_loss="chunked-output-compiled")
    ).tracker
    chunk = tokens // TORCHTUNE_OUTPUT_CHUNKS * config["vocab_size"]
    assert sum(a.nbytes == chunk * 2 for a in compiled.allocations) >= TORCHTUNE_OUTPUT_CHUNKS
    assert sum(a.nbytes == chunk * 4 for a in eager.allocations) >= TORCHTUNE_OUTPUT_CHUNKS
    assert not any(a.nbytes == chunk * 4 for a in compiled.allocations)  # no chunk upcast whole
    assert any(a.nbytes == COMPILED_CE_ROWS * config["vocab_size"] * 4 for a in compiled.allocations)
    # Eager keeps 2 x the bf16 logits more (their fp32 copy) at its peak, give or take one chunk.
    extra = eager.peak.allocated_bytes - compiled.peak.allocated_bytes
    assert 2 * bf16_logits - 2 * chunk * 4 <= extra <= 2 * bf16_logits + 2 * chunk * 4


def test_compiled_chunked_output_holds_all_its_logits_at_the_peak(tiny_llama):
    config = dict(tiny_llama, vocab_size=8192)
    tokens = 512
    compiled = simulate(
        config, make_spec(method="lora", seq_len=tokens, recipe="hf", hf_loss="chunked-output-compiled")
    ).tracker
    # At the peak: all 8 chunks' bf16 logits, as torchtune holds them through forward.
    assert compiled.peak.allocated_bytes >= tokens * config["vocab_size"] * 2


def test_axolotl_s_chunked_loss_joins_the_chunks_gradients_for_the_whole_head(tiny_llama):
    # The model's head makes the whole 16-bit logits, then the loss chunks them: backward gathers the
    # chunks' gradients into one whole gradient for the head's matmul, which torchtune's per-chunk
    # heads never make.
    config = dict(tiny_llama, vocab_size=8192)
    tokens = 512
    bf16_logits = tokens * config["vocab_size"] * 2
    knobs = dict(method="lora", seq_len=tokens, recipe="hf")
    axolotl = simulate(config, make_spec(**knobs, hf_loss="chunked-ce")).tracker
    torchtune = simulate(config, make_spec(**knobs, hf_loss="chunked-output-compiled")).tracker
    assert any(a.nbytes == bf16_logits for a in axolotl.allocations)
    assert not any(a.nbytes == bf16_logits for a in torchtune.allocations)
    assert axolotl.peak.allocated_bytes >= torchtune.peak.allocated_bytes + bf16_logits // 2


def test_transformers_before_4_50_hold_a_shifted_fp32_copy_of_the_logits_in_forward(tiny_llama):
    # Before 4.50 the loss shifts the fp32 logits into a copy (a copy only where the slice is not
    # contiguous: more than one row); 4.45 and before return the fp32 logits, so the 16-bit ones are
    # gone by then, where 4.46's stay as the model's output.
    config = dict(tiny_llama, vocab_size=8192)
    tokens, rows = 512, 2
    knobs = dict(method="lora", seq_len=tokens, batch_size=rows, recipe="hf")
    forward = {
        loss: simulate(config, make_spec(**knobs, hf_loss=loss)).tracker.phase_peaks["forward"]
        for loss in ("model", "model-4.46", "model-4.45")
    }
    shifted = rows * (tokens - 1) * config["vocab_size"] * 4
    assert abs(forward["model-4.46"] - forward["model"] - shifted) <= shifted // 100
    assert forward["model-4.46"] - forward["model-4.45"] == rows * tokens * config["vocab_size"] * 2
