"""grpo's generation: each prompt's completions sampled from the policy, as the trainer and the planner run it.

:func:`generate_completion_ids` is the device half, the one the planner runs under fake tensors
(:mod:`memfit.planner.exact.generation`): every prompt repeated ``num_generations`` times (TRL's
generation batch: ``batch_size x grad_accum`` completions on one device), left-padded into one
``[completions, longest prompt]`` batch, and continued by transformers' ``generate`` with the policy
itself (adapters on), sampling at ``temperature`` and ``top_p`` (``top_k`` off, as TRL's
GRPOConfig) with a KV cache, up to ``max_completion_length`` new tokens.
:func:`completion_lists` is the host half: each completion cut after its first end token (which it
keeps), as TRL cuts them.

While it generates, the model is in :func:`generation_mode`: evaluation mode (no dropout;
checkpointing, which only acts in training mode, idle), its own attention instead of memfit's
document attention (one-row training batches), and no gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Sampling:
    """How a grpo run samples its completions (TRL GRPOConfig's names)."""

    num_generations: int
    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0

    @classmethod
    def of(cls, spec: Any) -> Sampling:
        """The sampling of a grpo :class:`~memfit.spec.RunSpec`."""
        return cls(
            num_generations=spec.num_generations,
            max_completion_length=spec.max_completion_length,
            temperature=spec.temperature,
            top_p=spec.top_p,
        )


def _base(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextlib.contextmanager
def generation_mode(model: Any) -> Iterator[None]:
    """``model`` ready to generate for the duration: evaluation mode (no dropout; checkpointing,
    which only acts in training mode, idle) and its own attention instead of memfit's document
    attention, which needs one-row batches without padding; training settings back afterwards."""
    from memfit.step.attention import IMPLEMENTATION, restore_attention, use_document_attention

    was_training = model.training
    documents = getattr(_base(model).config, "_attn_implementation", None) == IMPLEMENTATION
    if documents:
        restore_attention(model)
    model.eval()
    try:
        yield
    finally:
        if documents:
            use_document_attention(model)
        if was_training:
            model.train()


def prompt_batch(
    prompts: Sequence[Sequence[int]], num_generations: int, pad_token_id: int, device: Any = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``input_ids``, ``attention_mask``): each prompt ``num_generations`` times, left-padded (int64)."""
    rows = [list(p) for p in prompts for _ in range(num_generations)]
    longest = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, longest - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[index, longest - len(row) :] = 1
    return input_ids.to(device), mask.to(device)


def generate_completion_ids(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    sampling: Sampling,
    *,
    pad_token_id: int,
    eos_token_ids: Sequence[int],
) -> torch.Tensor:
    """``[completions, new tokens]``: the tokens ``generate`` sampled after each row of ``input_ids``
    (a row that ended early is padded with ``pad_token_id`` after its end token)."""
    with generation_mode(model), torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=sampling.max_completion_length,
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=0,
            use_cache=True,
            pad_token_id=pad_token_id,
            eos_token_id=list(eos_token_ids),
        )
    return out[:, input_ids.shape[1] :]


def completion_lists(completion_ids: torch.Tensor, eos_token_ids: Sequence[int]) -> list[list[int]]:
    """Each completion's tokens up to and including its first end token (all of them when it has none)."""
    rows = completion_ids.cpu().tolist()
    ends = set(int(t) for t in eos_token_ids)
    out = []
    for row in rows:
        cut = next((i + 1 for i, token in enumerate(row) if token in ends), len(row))
        out.append(row[:cut])
    return out
