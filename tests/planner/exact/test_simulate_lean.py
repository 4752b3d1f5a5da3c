"""The planner plans memfit's memory-lean step: each technique lowers the plan where it should."""

from __future__ import annotations

from memfit.planner.exact.simulate import simulate
from memfit.spec import make_spec


def _peak_gradients(result) -> int:
    """Largest gradient bytes alive at any moment of the simulated steps."""
    return max(result.categories_at(i)["gradients"] for i in range(len(result.events)))


def test_step_in_backward_never_holds_every_gradient(tiny_llama):
    config = dict(tiny_llama, num_hidden_layers=4)
    normal = simulate(config, make_spec(method="full", precision="fp32", seq_len=64)).tracker
    in_backward = simulate(
        config, make_spec(method="full", precision="fp32", seq_len=64, step_in_backward=True)
    ).tracker
    trainable = normal.categories_at(len(normal.events) - 1)["trainable"]
    assert _peak_gradients(normal) == trainable  # every gradient exists at the optimizer step
    # One parameter's gradient at a time (the largest: the embedding or the head), not all of them.
    assert _peak_gradients(in_backward) <= trainable // 4
    # Same optimizer states: the update is the same, only its timing moves.
    assert (
        in_backward.categories_at(len(in_backward.events) - 1)["optimizer"]
        == normal.categories_at(len(normal.events) - 1)["optimizer"]
    )
