"""The optimizer step inside backward: each parameter is updated as soon as its gradient exists.

Full fine-tuning normally holds every gradient at once between backward and the optimizer step
(an 8B model in bf16: 16 GB of gradients). :class:`OptimizerInBackward` gives every parameter its
own small optimizer and steps it from a post-accumulate-grad hook, then drops that gradient, so at
any moment only the gradients autograd is still producing exist: about one parameter's worth.

It is a ``torch.optim.Optimizer`` so that the rest of the trainer does not change: LR schedulers
drive it through ``param_groups`` (the inner optimizers' own group dicts), checkpoints go through
``state_dict`` / ``load_state_dict``, the planner's tracker reads ``state``, and ``train_step``'s
``optimizer.step()`` / ``zero_grad()`` are no-ops. What it cannot do is anything that needs all
gradients before the first update: gradient accumulation, clipping by the global norm, and fp16's
GradScaler (which unscales and checks for inf across all gradients); the run's configuration refuses
those settings (:class:`memfit.spec.RunSpec` and :mod:`memfit.train.config`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


class _InnerStates(Mapping):
    """``optimizer.state`` of an :class:`OptimizerInBackward`: parameter -> its inner optimizer's state.

    A live, read-only view: states created by later steps show up without rebuilding it.
    """

    def __init__(self, owner: OptimizerInBackward) -> None:
        self._owner = owner

    def __getitem__(self, param: torch.Tensor) -> dict:
        inner = self._owner._inner_by_param.get(id(param))
        if inner is None:
            raise KeyError("not a parameter of this optimizer")
        # Like Optimizer.state (a defaultdict): a parameter without state yet gets an empty dict.
        return inner.state[param]

    def __contains__(self, param: object) -> bool:
        inner = self._owner._inner_by_param.get(id(param))
        return inner is not None and param in inner.state

    def __iter__(self) -> Iterator[torch.Tensor]:
        for inner in self._owner.inner_optimizers:
            yield from list(inner.state.keys())

    def __len__(self) -> int:
        return sum(len(inner.state) for inner in self._owner.inner_optimizers)


class OptimizerInBackward(torch.optim.Optimizer):
    """Steps each parameter inside backward with its own optimizer, then frees its gradient at once.

    ``make_optimizer([param])`` builds the optimizer of one parameter, e.g.
    ``lambda ps: torch.optim.AdamW(ps, lr=2e-4, fused=True)``. Only parameters that require
    gradients are taken (repeats, such as an embedding tied to the output head, count once: autograd
    sums both contributions before the hook fires). Use it like any optimizer, with
    ``grad_accum`` 1, no gradient clipping and no GradScaler (refused by the configuration):
    ``loss.backward()`` performs the update, ``step()`` only runs the closure, if any.

    A parameter that receives a second gradient before ``step()`` or ``zero_grad()`` (two backward
    passes for one step: gradient accumulation) raises instead of being updated twice.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], make_optimizer: OptimizerFactory) -> None:
        if not callable(make_optimizer):
            raise TypeError(
                f"make_optimizer: {make_optimizer!r} is not callable; pass e.g. lambda ps: torch.optim.AdamW(ps)"
            )
        if isinstance(params, torch.Tensor):
            raise TypeError("params: pass an iterable of parameters (e.g. model.parameters()), not one tensor")
        # These must exist before Optimizer.__init__, which builds the groups through add_param_group.
        self._make_optimizer = make_optimizer
        self.inner_optimizers: list[torch.optim.Optimizer] = []
        self._inner_by_param: dict[int, torch.optim.Optimizer] = {}
        self._params: list[torch.nn.Parameter] = []
        self._handles: list[Any] = []
        self._stepped: set[int] = set()  # ids of parameters updated since the last step()/zero_grad()
        trainable = _unique_trainable(params)
        if not trainable:
            raise ValueError("params: no parameter requires a gradient, so there is nothing to update")
        super().__init__(trainable, defaults={})
        self.defaults = dict(self.inner_optimizers[0].defaults)
        # Replaces Optimizer's own state dict: the states live in the inner optimizers.
        self.state = _InnerStates(self)  # type: ignore[assignment]
        self.register_hooks()

    # ------------------------------------------------------------------ groups and hooks
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add parameters, each with its own inner optimizer; other keys of ``param_group`` set its options."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        options = {key: value for key, value in param_group.items() if key != "params"}
        for param in params:
            if not isinstance(param, torch.Tensor) or not param.requires_grad or not param.is_leaf:
                raise ValueError("params: every parameter must be a leaf tensor that requires a gradient")
            if id(param) in self._inner_by_param:
                raise ValueError(f"params: a parameter of shape {tuple(param.shape)} is already in this optimizer")
            inner = self._make_optimizer([param])
            if not isinstance(inner, torch.optim.Optimizer):
                raise TypeError(f"make_optimizer must return a torch.optim.Optimizer, got {type(inner).__name__}")
            held = [p for group in inner.param_groups for p in group["params"]]
            if len(held) != 1 or held[0] is not param:
                raise ValueError("make_optimizer must build an optimizer over exactly the one parameter it is given")
            for group in inner.param_groups:
                unknown = sorted(set(options) - set(group))
                if unknown:
                    raise ValueError(f"param group: {', '.join(unknown)} not options of {type(inner).__name__}")
                group.update(options)
            self.inner_optimizers.append(inner)
            self._inner_by_param[id(param)] = inner
            self._params.append(param)
            # The very dicts the inner optimizer reads: a scheduler setting group["lr"] reaches it.
            self.param_groups.extend(inner.param_groups)
            if self._handles:  # hooks already on: a group added later gets its hook now
                self._handles.append(param.register_post_accumulate_grad_hook(self._step_parameter))

    def register_hooks(self) -> None:
        """(Re)register the per-parameter hooks, after any hooks registered on the parameters so far.

        Post-accumulate-grad hooks run in the order they were registered, and this one frees the
        gradient: code that must see ``param.grad`` in its own hook (a memory tracker) registers
        first, or calls this afterwards to move these hooks behind its own.
        """
        self.remove_hooks()
        self._handles = [p.register_post_accumulate_grad_hook(self._step_parameter) for p in self._params]

    def remove_hooks(self) -> None:
        """Stop updating in backward: gradients then stay in ``param.grad`` as usual, unused by this optimizer."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _step_parameter(self, param: torch.Tensor) -> None:
        key = id(param)
        if key in self._stepped:
            raise RuntimeError(
                f"OptimizerInBackward: a parameter of shape {tuple(param.shape)} got a second gradient before "
                "optimizer.step(); it would be updated twice. Use grad_accum 1 (one backward per step) and call "
                "optimizer.step() after every backward."
            )
        self._stepped.add(key)
        self._inner_by_param[key].step()
        # Free the gradient now: no other gradient needs to wait for it, and the next ones can reuse its memory.
        param.grad = None

    # ------------------------------------------------------------------ the Optimizer interface
    # GradScaler.step hands optimizers that claim their own scaling its found_inf (an attribute)
    # and calls step() directly: that is where a scaler in use shows, so step() can refuse it.
    _step_supports_amp_scaling = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (whose backward performs the updates) if given; the updates are already done."""
        if getattr(self, "found_inf", None) is not None or getattr(self, "grad_scale", None) is not None:
            raise RuntimeError(
                "OptimizerInBackward cannot be used with a GradScaler: the scaled gradients were applied in "
                "backward, before the scaler could unscale them or check them for inf. Train in bf16 or fp32 "
                "(precision: bf16) without a GradScaler, or turn step_in_backward off."
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._stepped.clear()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear any gradients (normally none are left) and start a new step."""
        super().zero_grad(set_to_none=set_to_none)
        self._stepped.clear()

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizers' states as one ordinary optimizer state dict (parameters numbered in order)."""
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for inner in self.inner_optimizers:
            inner_dict = inner.state_dict()
            for local_index, value in inner_dict["state"].items():
                state[offset + local_index] = value
            for group in inner_dict["param_groups"]:
                groups.append({**group, "params": [offset + i for i in group["params"]]})
            offset += sum(len(group["params"]) for group in inner.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore every inner optimizer from :meth:`state_dict` output (or from an ordinary optimizer's
        state dict over the same parameters in the same order)."""
        saved_groups = state_dict["param_groups"]
        group_of: dict[int, dict[str, Any]] = {}
        for group in saved_groups:
            for index in group["params"]:
                group_of[index] = group
        if len(group_of) != len(self._params):
            raise ValueError(
                f"optimizer state: holds {len(group_of)} parameters, this optimizer has {len(self._params)}. "
                "Resume with the same model and trainable parameters as the run that saved it."
            )
        offset = 0
        for inner in self.inner_optimizers:
            inner_state, inner_groups = {}, []
            for group in inner.param_groups:
                local = list(range(offset, offset + len(group["params"])))
                missing = [i for i in local if i not in group_of]
                if missing:
                    raise ValueError(f"optimizer state: no parameter group holds parameter {missing[0]}")
                saved = group_of[local[0]]
                inner_groups.append({**saved, "params": [i - offset for i in local]})
                for i in local:
                    if i in state_dict["state"]:
                        inner_state[i - offset] = state_dict["state"][i]
                offset += len(local)
            inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        # Loading gives each inner optimizer new group dicts: point param_groups at them again.
        self.param_groups = [group for inner in self.inner_optimizers for group in inner.param_groups]

    def __repr__(self) -> str:
        kinds = sorted({type(inner).__name__ for inner in self.inner_optimizers})
        return f"OptimizerInBackward({len(self._params)} parameters, {'/'.join(kinds)} each)"


def _unique_trainable(params: Iterable[Any]) -> list[torch.nn.Parameter]:
    """Parameters that require a gradient, each once, in their first order."""
    seen: set[int] = set()
    found = []
    for param in params:
        if isinstance(param, dict):
            raise TypeError("params: pass parameters, not parameter groups; add groups with add_param_group")
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            found.append(param)
    return found
