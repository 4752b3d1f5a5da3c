"""Sequence-tiled MLP: run each decoder layer's MLP over chunks of the tokens.

At long context the MLP is where a decoder layer's activations peak. For every token it makes
several ``[tokens, intermediate_size]`` tensors in the compute dtype (gate, up, act(gate),
act(gate) * up) that autograd keeps for backward, and that exist together while the layer is
recomputed under activation checkpointing. For Llama-3.1-8B at 100k tokens that is
4 x 100k x 14336 x 2 B = 11 GB, several times the layer's input.

Every token goes through the MLP on its own, so the MLP can run over chunks of the flattened
``[batch * seq, hidden]`` tokens with the same result. :class:`TiledMLPFunction` does that in
forward under ``no_grad`` and keeps only the MLP's input; backward recomputes one chunk at a time
with grad enabled and takes its gradients at once, so the wide tensors exist for one chunk only.

Cost: one more MLP forward per training step than without tiling (the per-chunk recompute in
backward), on top of what activation checkpointing already recomputes.

Only the instance's ``forward`` is patched (no wrapper modules), so parameter names, the
``state_dict`` and everything that saves or merges adapters by name are unchanged.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.models.layers import decoder_layers
from memfit.step import seam
from memfit.step.autocast import active_autocast_dtype, same_autocast
from memfit.step.seam import chunks_to_run, run_region

#: Tokens per chunk. 2048 rows keep each chunk's matmuls ([2048, hidden] x [hidden, intermediate])
#: large enough to run a GPU's tensor cores near full speed (a few hundred rows already do for
#: 4k-wide layers; 2048 leaves margin for narrow models), while the chunk's intermediates stay
#: small: Llama-3.1-8B, 4 x 2048 x 14336 x 2 B = 235 MB instead of 11 GB at 100k tokens.
DEFAULT_TILE_TOKENS = 2048

# Instance attributes that mark a tiled MLP. They live in the module's __dict__ (not as
# parameters or buffers), so the state_dict does not see them. The chunk size decides what the
# module's forward allocates.
TILE_TOKENS = seam.memory_attribute("_memfit_tile_tokens")
_UNTILED_ATTR = "_memfit_untiled_forward"

# Class names of mixture-of-experts blocks: their routers feed an auxiliary loss through hooks
# and batch tokens per expert, so they are never tiled even when their shapes would allow it.
_MOE_NAME_PARTS = ("moe", "expert", "sparse", "router")


def tile_mlps(model: nn.Module, chunk_tokens: int = DEFAULT_TILE_TOKENS) -> int:
    """Make the MLP of every decoder layer run over chunks of ``chunk_tokens`` tokens.

    The MLP is the child module named ``mlp`` of each block in
    :func:`memfit.models.layers.decoder_layers` (works on PEFT-wrapped models). Blocks that are not
    a dense token-wise MLP mapping ``[batch, seq, hidden]`` to the same shape (mixture-of-experts
    blocks, forwards taking more than the hidden states) are left alone.

    Outputs and gradients equal the untiled computation (up to the order of floating-point sums
    over chunks); each trainable parameter's ``.grad`` is accumulated once per backward. The price
    is one more MLP forward per step. Idempotent: calling again only updates the chunk size.
    Returns how many MLPs now run tiled.
    """
    _check_chunk_tokens(chunk_tokens)
    tiled = 0
    for block in decoder_layers(model):
        mlp = getattr(block, "mlp", None)
        if not isinstance(mlp, nn.Module) or not is_dense_mlp(mlp):
            continue
        _tile(mlp, chunk_tokens)
        tiled += 1
    return tiled


def tile_norms(model: nn.Module, chunk_tokens: int = DEFAULT_TILE_TOKENS) -> int:
    """Run the normalisation layers of every decoder layer over chunks of ``chunk_tokens`` tokens.

    Norms are token-wise too, and at long context they rival the MLP: an RMSNorm computes in fp32,
    so autograd keeps fp32 copies of its ``[tokens, hidden]`` input (Llama-3.1-8B at 100k tokens:
    1.6 GB each, several per norm, two norms a layer). Tiled, a norm keeps only its input in the
    compute dtype and makes the fp32 intermediates one chunk at a time, in forward and backward. The
    same mechanism as :func:`tile_mlps` (one more norm forward per step, which is cheap). Returns
    how many norms now run tiled.
    """
    _check_chunk_tokens(chunk_tokens)
    tiled = 0
    for block in decoder_layers(model):
        for _, child in block.named_children():
            if not _is_norm(child) or not is_dense_mlp(child):
                continue
            _tile(child, chunk_tokens)
            tiled += 1
    return tiled


def _tile(module: nn.Module, chunk_tokens: int) -> None:
    """Patch ``module``'s forward to run tiled (or only update its chunk size when it already does)."""
    if not is_tiled(module):
        # Keep whatever forward the instance had (another library may have patched it too).
        module.__dict__[_UNTILED_ATTR] = module.__dict__.get("forward")
        module.forward = types.MethodType(_tiled_forward, module)
    module.__dict__[TILE_TOKENS] = chunk_tokens


def _check_chunk_tokens(chunk_tokens: int) -> None:
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise ValueError(
            f"chunk_tokens must be a positive integer, got {chunk_tokens!r}; pass e.g. {DEFAULT_TILE_TOKENS}"
        )


def _is_norm(module: nn.Module) -> bool:
    """RMSNorm / LayerNorm children of a decoder layer (by class name: every architecture has its own)."""
    return isinstance(module, nn.LayerNorm) or type(module).__name__.lower().endswith(("rmsnorm", "layernorm", "norm"))


def is_tiled(mlp: nn.Module) -> bool:
    """Whether :func:`tile_mlps` patched this module."""
    return TILE_TOKENS in mlp.__dict__


def is_dense_mlp(mlp: nn.Module) -> bool:
    """Whether ``mlp`` looks like a dense, token-wise MLP: ``forward(hidden_states)`` alone, no
    expert lists, no fused expert weights (3-d parameters), not named like a mixture of experts."""
    if any(part in type(mlp).__name__.lower() for part in _MOE_NAME_PARTS):
        return False
    for module in mlp.modules():
        if isinstance(module, nn.ModuleList):
            return False
    if any(p.dim() > 2 for p in mlp.parameters()):
        return False
    try:
        params = list(inspect.signature(type(mlp).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_rest = [p for p in params[1:] if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return len(positional) >= 1 and not required_rest


def _tiled_forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    untiled = self.__dict__[_UNTILED_ATTR]
    if args or kwargs or not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        return _call_untiled(untiled, self, hidden_states, *args, **kwargs)

    run = _Untiled(untiled, self)
    chunk_tokens = self.__dict__[TILE_TOKENS]
    params = [p for p in self.parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (hidden_states.requires_grad or params):
        # Evaluation or no_grad: nothing to recompute, chunking alone bounds the intermediates.
        with torch.no_grad():
            return _chunked_forward(run, hidden_states, chunk_tokens, rng_states=None)
    preserve_rng = _dropout_active(self) and seam.keeps_dropout_masks(hidden_states)
    return TiledMLPFunction.apply(run, chunk_tokens, preserve_rng, hidden_states, *params)


def _call_untiled(untiled: Callable | None, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return untiled(*args, **kwargs) if untiled is not None else type(module).forward(module, *args, **kwargs)


class _Untiled:
    """``module``'s own (untiled) forward on one chunk; ``module`` is whose chunks they are."""

    def __init__(self, untiled: Callable | None, module: nn.Module) -> None:
        self.untiled = untiled
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _call_untiled(self.untiled, self.module, x)


class TiledMLPFunction(torch.autograd.Function):
    """``run(x)`` over row chunks of ``x`` flattened to ``[tokens, hidden]``.

    Inputs: ``run`` (the MLP's untiled forward), ``chunk_tokens``, ``preserve_rng`` (dropout is
    active: replay the forward's random masks in backward), ``x`` and the MLP's trainable
    parameters. The parameters are inputs so that autograd accumulates each one's gradient, summed
    over the chunks here, exactly once; frozen weights (4-bit or frozen base weights) are not.
    """

    @staticmethod
    def forward(ctx, run, chunk_tokens, preserve_rng, x, *params):
        rng_states: list[tuple] | None = [] if preserve_rng else None
        out = _chunked_forward(run, x, chunk_tokens, rng_states)
        ctx.run = run
        ctx.chunk_tokens = chunk_tokens
        ctx.rng_states = rng_states
        # Backward recomputes the chunks under the autocast forward ran under (mixed precision).
        ctx.autocast_dtype = active_autocast_dtype(x.device.type)
        # The parameters are saved too, but they are references to existing weights: the only
        # activation kept is the MLP input.
        ctx.save_for_backward(x, *params)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, *params = ctx.saved_tensors
        need_x = ctx.needs_input_grad[3]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[4:]) if need]
        flat_x = x.detach().reshape(-1, x.shape[-1])
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(flat_x) if need_x else None
        grad_params: list[torch.Tensor | None] = [None] * len(params)
        rng_states = ctx.rng_states
        devices = _cuda_devices(x) if rng_states is not None else []
        # fork_rng: replaying the forward's RNG states must not change the RNG stream the rest of
        # the step sees afterwards.
        with (
            torch.random.fork_rng(devices=devices, enabled=rng_states is not None),
            same_autocast(x.device.type, ctx.autocast_dtype),
        ):
            for index, start in enumerate(chunks_to_run(flat_x.shape[0], ctx.chunk_tokens, flat_x)):
                stop = start + ctx.chunk_tokens
                if rng_states is not None:
                    _set_rng_state(rng_states[index], devices)
                grads = run_region(
                    ctx.run.module,
                    "tiled-backward",
                    functools.partial(_chunk_gradients, ctx.run),
                    need_x,
                    flat_x[start:stop],
                    flat_grad[start:stop],
                    *[params[i] for i in wanted],
                )
                if need_x:
                    grad_x[start:stop] = grads[0]
                    grads = grads[1:]
                for i, g in zip(wanted, grads):
                    if g is None:
                        continue
                    if grad_params[i] is None:
                        grad_params[i] = g
                    else:
                        grad_params[i] += g
                # Drop the chunk's gradients now; ``g`` would keep the last one alive through the
                # next chunk's recomputation.
                del grads
                g = None
        grad_x = grad_x.view(x.shape) if grad_x is not None else None
        return (None, None, None, grad_x, *grad_params)


def _chunk_gradients(
    run: _Untiled, need_x: bool, x_rows: torch.Tensor, grad_rows: torch.Tensor, *params: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    """One chunk of the tiled backward: recompute ``run`` on ``x_rows`` with grad enabled and return
    the gradients of ``x_rows`` (when ``need_x``) and of ``params`` for the output gradient ``grad_rows``."""
    piece = x_rows.detach().requires_grad_(need_x)
    with torch.enable_grad():
        y = run(piece)
    inputs = ([piece] if need_x else []) + list(params)
    # autograd.grad (not .backward) so nothing lands in .grad here: the Function's return value is
    # accumulated once by autograd, and hooks on it fire once.
    return torch.autograd.grad(y, inputs, grad_rows, allow_unused=True)


def _chunked_forward(
    run: _Untiled,
    x: torch.Tensor,
    chunk_tokens: int,
    rng_states: list[tuple] | None,
) -> torch.Tensor:
    """``run`` over row chunks of ``x`` (flattened to 2-d), written into one output tensor."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    devices = _cuda_devices(x) if rng_states is not None else []
    out = None
    for start in chunks_to_run(rows, chunk_tokens, flat):
        piece = flat[start : start + chunk_tokens]
        if rng_states is not None:
            rng_states.append(_get_rng_state(devices))
        y = run_region(run.module, "tiled-forward", run, piece)
        if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.shape[0] != piece.shape[0]:
            raise TypeError(
                f"tiled MLP: the MLP returned {type(y).__name__} "
                f"{tuple(y.shape) if isinstance(y, torch.Tensor) else ''} for a [{piece.shape[0]}, {x.shape[-1]}] "
                "input; only token-wise MLPs can be tiled. Turn tiling off (--tiling off) for this model."
            )
        if out is None:
            # Preallocated once: concatenating the chunks would briefly hold the output twice.
            out = y.new_empty((rows, y.shape[1]))
        out[start : start + piece.shape[0]] = y
        del y
    if out is None:  # zero tokens
        return run(x)
    return out.view(*x.shape[:-1], out.shape[-1])


def _dropout_active(mlp: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0 for m in mlp.modules())


def _cuda_devices(x: torch.Tensor) -> list[int]:
    return [x.device.index if x.device.index is not None else torch.cuda.current_device()] if x.is_cuda else []


def _get_rng_state(cuda_devices: list[int]) -> tuple:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in cuda_devices]


def _set_rng_state(state: tuple, cuda_devices: list[int]) -> None:
    cpu_state, cuda_states = state
    torch.set_rng_state(cpu_state)
    for device, device_state in zip(cuda_devices, cuda_states):
        torch.cuda.set_rng_state(device_state, device)
