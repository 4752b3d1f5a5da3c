"""Frozen input embeddings kept in host memory.

With LoRA or QLoRA the input embedding table is frozen, and a step only reads the rows of its
tokens: Llama-3.1-8B's table is 128,256 x 4,096 in bf16, 1 GB of device memory (a fifth of the whole
QLoRA model) for a lookup of 8k rows. :func:`keep_input_embeddings_on_host` moves the table to
(pinned) host memory and runs the lookup there; only the looked-up rows, ``[batch, seq, hidden]``,
travel to the device. The output head is not moved (it is a matmul over every row).

It applies when the table is frozen and not tied to the output head (a tied table is the head's
weight too). The cost is a host gather and one host-to-device copy of the looked-up rows per
micro-batch (64 MiB for 8,192 tokens of Llama-3.1-8B).

The planner runs the same code on the fake CPU device: under
:func:`memfit.step.offload.pinned_host_copies` the table's host copy is allocated pinned, which
the memory tracker counts as host memory.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from memfit.step.offload import host_copy

#: Attribute set (True) on tensors that live in host memory by design: memory trackers (the
#: planner's and the run's) count them as host memory, not device memory.
HOST_RESIDENT_ATTR = "_memfit_host_resident"

_HOST_ATTR = "_memfit_on_host"


def keep_input_embeddings_on_host(model: nn.Module) -> bool:
    """Move ``model``'s frozen, untied input embeddings to host memory; True if it did.

    Idempotent. The module keeps its class, parameter names and ``state_dict``; its forward takes
    token ids on any device and returns the embeddings on the ids' device.
    """
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(embeddings, nn.Module):
        return False
    if embeddings.__dict__.get(_HOST_ATTR):
        return True
    params = list(embeddings.parameters())
    if not params or any(p.requires_grad for p in params):
        return False
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_params = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    if any(id(p) in head_params for p in params):
        return False  # tied: the head computes with the same tensor on the device
    with torch.no_grad():
        for p in params:
            p.data = _host_copy(p.data)
            setattr(p, HOST_RESIDENT_ATTR, True)  # memory trackers count it as host memory
        for name, buffer in list(embeddings.named_buffers(recurse=False)):
            embeddings._buffers[name] = _host_copy(buffer)
            setattr(embeddings._buffers[name], HOST_RESIDENT_ATTR, True)
    embeddings.__dict__["_memfit_device_forward"] = embeddings.__dict__.get("forward")
    embeddings.forward = types.MethodType(_host_forward, embeddings)
    embeddings.__dict__[_HOST_ATTR] = True
    return True


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = host_copy(tensor)
    host.copy_(tensor)
    return host


def _host_forward(self: nn.Module, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    previous = self.__dict__["_memfit_device_forward"]
    forward = previous if previous is not None else types.MethodType(type(self).forward, self)
    rows = forward(input_ids.to("cpu"), *args, **kwargs)
    # Pageable host memory: the copy is synchronous, so the rows are on the device when used.
    return rows.to(input_ids.device)
