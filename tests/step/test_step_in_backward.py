"""OptimizerInBackward: same updates as the ordinary optimizer, without holding all gradients at once."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.step.losses import causal_lm_loss
from memfit.step.step_in_backward import OptimizerInBackward
from memfit.step.train_step import train_step

LR = 1e-2
WEIGHT_DECAY = 0.1
STEPS = 5


def tiny_model(*, tie: bool = False, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        use_cache=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).train()  # float32: the default dtype


def batches(count: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    found = []
    for _ in range(count):
        ids = torch.randint(0, 64, (2, 12), generator=generator)
        found.append({"input_ids": ids, "labels": ids.clone()})
    return found


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)


def in_backward(model: torch.nn.Module) -> OptimizerInBackward:
    return OptimizerInBackward(model.parameters(), adamw)


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


def inner_lrs(optimizer: OptimizerInBackward) -> list[float]:
    """The lr each inner optimizer will use (read from its own groups, not through the outer one)."""
    return [group["lr"] for inner in optimizer.inner_optimizers for group in inner.param_groups]


def run(model, optimizer, data, scheduler=None) -> list[float]:
    losses = []
    for batch in data:
        loss, grad_norm = train_step(model, [batch], optimizer, loss_fn=causal_lm_loss)
        assert grad_norm is None
        losses.append(float(loss))
        if scheduler is not None:
            scheduler.step()
    return losses


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, atol: float = 1e-6) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_five_steps_match_fused_adamw():
    normal = tiny_model()
    stepped = copy.deepcopy(normal)
    start = copy.deepcopy(normal)
    data = batches(STEPS)
    losses_normal = run(normal, adamw(normal.parameters()), data)
    losses_stepped = run(stepped, in_backward(stepped), data)
    assert losses_stepped == pytest.approx(losses_normal, abs=1e-6)
    assert_same_weights(normal, stepped)
    # The weights did move (lr 1e-2 for 5 steps), so agreement is not trivial.
    moved = max((p - q).abs().max().item() for p, q in zip(stepped.parameters(), start.parameters()))
    assert moved > 1e-2
    assert all(p.grad is None for p in stepped.parameters())


def test_lambda_lr_warmup_reaches_every_inner_optimizer():
    normal = tiny_model()
    stepped = copy.deepcopy(normal)
    data = batches(STEPS)
    opt_normal = adamw(normal.parameters())
    opt_stepped = in_backward(stepped)
    sched_normal = torch.optim.lr_scheduler.LambdaLR(opt_normal, warmup)
    sched_stepped = torch.optim.lr_scheduler.LambdaLR(opt_stepped, warmup)

    assert inner_lrs(opt_stepped) == pytest.approx([LR / 4] * len(opt_stepped.inner_optimizers))
    assert len(opt_stepped.inner_optimizers) == len(list(stepped.parameters()))

    run(normal, opt_normal, data[:1], sched_normal)
    run(stepped, opt_stepped, data[:1], sched_stepped)
    assert inner_lrs(opt_stepped) == pytest.approx([2 * LR / 4] * len(opt_stepped.inner_optimizers))

    run(normal, opt_normal, data[1:], sched_normal)
    run(stepped, opt_stepped, data[1:], sched_stepped)
    assert sched_stepped.get_last_lr()[0] == pytest.approx(sched_normal.get_last_lr()[0])
    assert_same_weights(normal, stepped)


def _saved(obj) -> dict:
    """What a checkpoint gives back: the state dict through torch.save / torch.load (no shared tensors)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_dict_round_trip_mid_run_resumes_exactly():
    data = batches(STEPS)
    straight = tiny_model()
    opt = in_backward(straight)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    interrupted = copy.deepcopy(straight)
    run(straight, opt, data, sched)

    first = in_backward(interrupted)
    first_sched = torch.optim.lr_scheduler.LambdaLR(first, warmup)
    run(interrupted, first, data[:2], first_sched)
    checkpoint = _saved(
        {"model": interrupted.state_dict(), "optimizer": first.state_dict(), "scheduler": first_sched.state_dict()}
    )
    assert set(checkpoint["optimizer"]["state"]) == set(range(len(list(interrupted.parameters()))))
    first.remove_hooks()
    del first, first_sched, interrupted

    resumed = tiny_model(seed=123)  # different weights: everything must come from the checkpoint
    resumed.load_state_dict(checkpoint["model"])
    second = in_backward(resumed)
    second_sched = torch.optim.lr_scheduler.LambdaLR(second, warmup)
    second.load_state_dict(checkpoint["optimizer"])
    second_sched.load_state_dict(checkpoint["scheduler"])
    # Mid-warmup: the schedule must keep reaching the inner optimizers, whose group dicts loading replaced.
    assert inner_lrs(second) == pytest.approx([3 * LR / 4] * len(second.inner_optimizers))
    run(resumed, second, data[2:3], second_sched)
    assert inner_lrs(second) == pytest.approx([LR] * len(second.inner_optimizers))
    run(resumed, second, data[3:], second_sched)
    assert_same_weights(straight, resumed, atol=0)


def test_loads_an_ordinary_optimizer_state_over_the_same_parameters():
    normal = tiny_model()
    stepped = copy.deepcopy(normal)
    data = batches(3)
    opt_normal = adamw(normal.parameters())
    run(normal, opt_normal, data[:1])
    stepped.load_state_dict(normal.state_dict())
    opt_stepped = in_backward(stepped)
    opt_stepped.load_state_dict(_saved(opt_normal.state_dict()))
    run(normal, opt_normal, data[1:])
    run(stepped, opt_stepped, data[1:])
    assert_same_weights(normal, stepped)


def test_load_state_dict_rejects_other_parameter_count():
    model = tiny_model()
    opt = in_backward(model)
    state = opt.state_dict()
    state["param_groups"] = state["param_groups"][:-1]
    with pytest.raises(ValueError, match="optimizer state: holds"):
        opt.load_state_dict(state)


def _gradient_counts(model: torch.nn.Module) -> list[int]:
    """After each parameter's gradient is accumulated: how many parameters hold a .grad right then."""
    params = list(model.parameters())
    counts: list[int] = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda _: counts.append(sum(q.grad is not None for q in params)))
    return counts


def test_at_most_one_gradient_exists_during_backward():
    normal = tiny_model()
    stepped = copy.deepcopy(normal)
    n_params = len(list(normal.parameters()))
    data = batches(2)

    counts_normal = _gradient_counts(normal)
    optimizer = adamw(normal.parameters())
    normal.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(
        normal(input_ids=data[0]["input_ids"]).logits.flatten(0, 1), data[0]["labels"].flatten()
    )
    loss.backward()
    assert max(counts_normal) == n_params  # the ordinary step holds every gradient when backward ends
    assert sum(p.grad is not None for p in normal.parameters()) == n_params
    optimizer.zero_grad()

    # Registered before the optimizer's hooks, these see each gradient just before it is used and freed.
    counts_stepped = _gradient_counts(stepped)
    optimizer = in_backward(stepped)
    run(stepped, optimizer, data)
    assert len(counts_stepped) == 2 * n_params
    assert max(counts_stepped) == 1
    assert sum(p.grad is not None for p in stepped.parameters()) == 0


def test_tied_embedding_is_updated_once_with_both_contributions():
    normal = tiny_model(tie=True)
    stepped = copy.deepcopy(normal)
    assert stepped.lm_head.weight is stepped.model.embed_tokens.weight
    tied = stepped.model.embed_tokens.weight
    calls = []
    tied.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    optimizer = in_backward(stepped)
    assert len(optimizer.inner_optimizers) == len(list(stepped.parameters()))
    data = batches(3)
    run(normal, adamw(normal.parameters()), data)
    run(stepped, optimizer, data)
    assert len(calls) == 3  # one hook call (one update) per step
    assert float(optimizer.state[tied]["step"]) == 3
    # Equal weights also show the update used both gradients (embedding and head).
    assert_same_weights(normal, stepped)


def test_second_gradient_before_step_raises():
    model = tiny_model()
    in_backward(model)
    batch = batches(1)[0]
    out = model(input_ids=batch["input_ids"], labels=batch["labels"])
    out.loss.backward()
    out = model(input_ids=batch["input_ids"], labels=batch["labels"])
    with pytest.raises(RuntimeError, match="second gradient before"):
        out.loss.backward()


def test_remove_hooks_leaves_gradients_alone():
    model = tiny_model()
    before = copy.deepcopy(model)
    optimizer = in_backward(model)
    optimizer.remove_hooks()
    batch = batches(1)[0]
    model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert_same_weights(before, model, atol=0)
    optimizer.zero_grad(set_to_none=True)
    optimizer.register_hooks()
    run(model, optimizer, [batch])
    assert all(p.grad is None for p in model.parameters())
    assert not torch.equal(before.model.norm.weight, model.model.norm.weight)


def test_grad_scaler_is_refused():
    model = tiny_model()
    optimizer = in_backward(model)
    with pytest.raises(RuntimeError, match="cannot be used with a GradScaler"):
        train_step(model, batches(1), optimizer, loss_fn=causal_lm_loss, grad_scaler=torch.amp.GradScaler("cpu"))


def test_only_trainable_parameters_and_clear_errors():
    model = tiny_model()
    model.model.embed_tokens.weight.requires_grad_(False)
    optimizer = in_backward(model)
    assert len(optimizer.inner_optimizers) == len(list(model.parameters())) - 1
    assert "OptimizerInBackward(" in repr(optimizer)
    with pytest.raises(ValueError, match="no parameter requires a gradient"):
        OptimizerInBackward([model.model.embed_tokens.weight], adamw)
    with pytest.raises(ValueError, match="exactly the one parameter"):
        OptimizerInBackward(model.parameters(), lambda ps: adamw(list(model.parameters())[1:3]))


def test_runs_under_fake_tensor_mode_with_the_planner_tracker():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from memfit.planner.exact.tracker import MemoryTracker

    def gradient_peak_bytes(stepping: bool) -> tuple[int, int, int]:
        tracker = MemoryTracker()
        with FakeTensorMode(allow_non_fake_inputs=True), tracker:
            model = tiny_model()
            assert isinstance(model.model.norm.weight, FakeTensor)
            tracker.mark_model(model)
            hooks = tracker.watch_gradients(model)  # before the optimizer's hooks: sees every gradient
            optimizer = in_backward(model) if stepping else adamw(model.parameters())
            data = [{"input_ids": torch.zeros(2, 12, dtype=torch.long), "labels": torch.zeros(2, 12, dtype=torch.long)}]
            for _ in range(2):
                train_step(model, data, optimizer, loss_fn=causal_lm_loss, observer=tracker)
                tracker.mark_optimizer(optimizer)
            for h in hooks:
                h.remove()
            param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            result = tracker.result()
        live = peak = 0
        roles = {a.alloc_id: a.role for a in result.allocations}
        sizes = {a.alloc_id: a.nbytes for a in result.allocations}
        for kind, alloc_id, _ in result.events:
            if roles[alloc_id] == "gradients":
                live += sizes[alloc_id] if kind == "alloc" else -sizes[alloc_id]
                peak = max(peak, live)
        optimizer_bytes = sum(a.nbytes for a in result.allocations if a.role == "optimizer" and a.free_event is None)
        return peak, param_bytes, optimizer_bytes

    peak_normal, param_bytes, optim_normal = gradient_peak_bytes(stepping=False)
    peak_stepped, _, optim_stepped = gradient_peak_bytes(stepping=True)
    assert peak_normal >= param_bytes  # every gradient at once
    largest_param_bytes = 64 * 32 * 4  # the embedding (and the untied head)
    assert 0 < peak_stepped <= 2 * largest_param_bytes
    # Both AdamW moments of every parameter are found through optimizer.state.
    assert optim_stepped >= 2 * param_bytes
    assert optim_normal >= 2 * param_bytes


def test_register_hooks_moves_the_update_behind_hooks_added_later():
    from memfit.planner.exact.tracker import MemoryTracker

    model = tiny_model()
    optimizer = in_backward(model)
    tracker = MemoryTracker()
    with tracker:
        hooks = tracker.watch_gradients(model)  # added after the optimizer: would find .grad already freed
        optimizer.register_hooks()
        train_step(model, batches(1), optimizer, loss_fn=causal_lm_loss, observer=tracker)
        tracker.mark_optimizer(optimizer)
        for h in hooks:
            h.remove()
    roles = [a.role for a in tracker.result().allocations]
    n_params = len(list(model.parameters()))
    assert roles.count("gradients") == n_params
    assert len(optimizer.state) == n_params
    assert all(set(state) == {"step", "exp_avg", "exp_avg_sq"} for state in optimizer.state.values())
