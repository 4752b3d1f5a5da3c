"""Optimizers by name, built the same way for the trainer and the planner."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from memfit.spec import choices

OPTIMIZERS = choices("optimizer")


def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    name: str,
    *,
    lr: float = 2e-4,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    step_in_backward: bool = False,
    adamw_impl: str = "fused",
) -> torch.optim.Optimizer:
    """Make optimizer ``name`` over ``params``.

    ``step_in_backward`` (full fine-tuning) gives each parameter its own optimizer ``name`` and runs
    its step as soon as its gradient is complete, inside backward
    (:class:`~memfit.step.step_in_backward.OptimizerInBackward`): gradients never all exist at once.

    - ``adamw``: PyTorch's fused AdamW. The fused kernel updates every parameter in place, so unlike
      the default foreach implementation it needs no temporary copy of all gradients; it exists for
      CUDA and CPU alike, which keeps planner (fake CPU) and trainer (CUDA) on the same code path.
    - ``adamw`` with ``adamw_impl="foreach"``: ``torch.optim.AdamW`` with PyTorch's defaults, as the
      Hugging Face Trainer's ``adamw_torch`` builds it: on CUDA that is the foreach implementation,
      whose step makes ``sqrt(exp_avg_sq)`` for every parameter at once (a temporary as large as the
      trainable parameters) before it updates them.
    - ``adamw8bit`` / ``paged-adamw8bit``: bitsandbytes' 8-bit AdamW (block-wise quantized states),
      the paged one keeps its states in CUDA unified memory.
    - ``sgd``: plain SGD without momentum (no state at all).
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters: nothing for the optimizer to update")
    if step_in_backward:
        from memfit.step.step_in_backward import OptimizerInBackward

        return OptimizerInBackward(
            params,
            lambda ps: build_optimizer(ps, name, lr=lr, weight_decay=weight_decay, betas=betas, adamw_impl=adamw_impl),
        )
    if name == "adamw" and adamw_impl == "foreach":
        # No implementation named: PyTorch picks foreach for CUDA parameters (the planner answers its
        # question as CUDA does: memfit.planner.exact.cuda_parity).
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=True)
    if name in ("adamw8bit", "paged-adamw8bit"):
        try:
            import bitsandbytes as bnb
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(f"--optimizer {name} needs bitsandbytes: pip install 'memfit[qlora]'") from err
        cls = bnb.optim.PagedAdamW8bit if name == "paged-adamw8bit" else bnb.optim.AdamW8bit
        return cls(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"--optimizer: {name!r} is not one of {', '.join(OPTIMIZERS)}")
