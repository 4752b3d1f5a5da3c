"""Replies from a model: the ``eval_prompts`` of a run as it trains, and the turns of ``memfit chat``
and ``memfit generate`` once it has (:mod:`memfit.infer` calls the same functions).

A prompt is rendered with the chat template the training data was rendered with
(:func:`memfit.train.data.render_prompt`: the tokenizer's own, else memfit's default), tokenized
without added special tokens (the template writes them, as in training) and continued by
transformers' ``generate``. A model in the middle of a run carries training-time settings that
generation must not see (dropout, document attention, ``use_cache`` off for checkpointing):
:func:`generation_mode` lifts them while it generates and puts them back.

Importing this module imports neither torch nor transformers (the config validates prompts with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Roles a message of a prompt may have (the roles the training data formats produce).
ROLES = ("system", "user", "assistant")

#: ``max_new_tokens`` of the replies to ``eval_prompts`` when the config does not say.
DEFAULT_EVAL_MAX_NEW_TOKENS = 64


def prompt_problem(prompt: Any) -> str | None:
    """Why ``prompt`` is not a prompt (None when it is): text, or a list of ``{role, content}``
    messages whose last one is not the assistant's (the reply is what comes next)."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "is empty text; write the prompt, or a list of {role, content} messages"
    if not isinstance(prompt, list) or not prompt:
        return f"{_shown(prompt)} is not a prompt: write text, or a list of {{role, content}} messages"
    for index, message in enumerate(prompt):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            return f"message {index} ({_shown(message)}) must be a mapping with exactly role and content"
        if message["role"] not in ROLES:
            return f"message {index}: role {message['role']!r} is not one of {', '.join(ROLES)}"
        if not isinstance(message["content"], (str, list)):
            return f"message {index}: content must be text or a list of parts, not {type(message['content']).__name__}"
    from memfit.train.data.chat import prompt_end_problem

    return prompt_end_problem(prompt)


def prompt_messages(prompt: str | list[dict[str, str]]) -> list[dict[str, str]]:
    """The chat messages of a valid prompt: text is one user turn."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class Sampling:
    """How replies are generated, named as transformers' ``generate`` names them. Greedy unless
    ``do_sample``; ``temperature`` and ``top_p`` apply only when sampling; a reply ends at an end
    token only once it has ``min_new_tokens`` tokens."""

    max_new_tokens: int = 256
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0

    def problems(self) -> list[str]:
        """What is out of range, one line per option, in the command line's spelling."""
        found = []
        if self.max_new_tokens < 1:
            found.append(f"--max-new-tokens {self.max_new_tokens}: must be 1 or more (e.g. --max-new-tokens 256)")
        if not 0 <= self.min_new_tokens <= max(self.max_new_tokens, 0):
            found.append(
                f"--min-new-tokens {self.min_new_tokens}: must be from 0 to --max-new-tokens ({self.max_new_tokens})"
            )
        if not self.temperature > 0:
            found.append(f"--temperature {self.temperature}: must be more than 0 (e.g. --temperature 0.7)")
        if not 0 < self.top_p <= 1:
            found.append(f"--top-p {self.top_p}: must be in (0, 1] (e.g. --top-p 0.9)")
        return found

    def generate_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "do_sample": self.do_sample}
        if self.min_new_tokens:  # the end tokens are held back until the reply is this long
            kwargs["min_new_tokens"] = self.min_new_tokens
        if self.do_sample:
            kwargs.update(temperature=self.temperature, top_p=self.top_p)
        else:  # the model's generation_config may ask for sampling: greedy means greedy
            kwargs.update(temperature=None, top_p=None, top_k=None)
        return kwargs


@dataclass(frozen=True)
class Reply:
    """One generated reply: its text (special tokens left out), how many tokens it took, and why
    it stopped: ``eos`` (the model ended its turn) or ``max_new_tokens``."""

    text: str
    new_tokens: int
    stopped: str


def generation_mode(model: Any):
    """``model`` ready to generate (:func:`memfit.step.rollout.generation_mode`: the one grpo's
    completions are sampled in, too)."""
    from memfit.step.rollout import generation_mode as mode

    return mode(model)


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The tokens that end a reply: the one the chat template closes an assistant turn with (what a
    model trained on the template learned to say last), the tokenizer's EOS, and those of the
    model's generation config."""
    ids = []
    config_ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    candidates = [
        turn_end_token_id(tokenizer),
        tokenizer.eos_token_id,
        *(config_ids if isinstance(config_ids, list) else [config_ids]),
    ]
    for value in candidates:
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    return ids


def turn_end_token_id(tokenizer: Any) -> int | None:
    """The special token the chat template writes right after an assistant's words (``<|im_end|>``,
    ``<|eot_id|>``, EOS for memfit's default template), found by rendering a sample conversation;
    None when the template writes plain text there."""
    from memfit.train.data.chat import ChatTemplateError, render_chat

    reply = "Reply."
    try:
        text, spans = render_chat(
            tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}]
        )
    except ChatTemplateError:
        return None
    turn = text[spans[0][0] : spans[0][1]] if spans else ""
    after = turn[turn.find(reply) + len(reply) :] if reply in turn else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    return ids[0] if ids and ids[0] in set(tokenizer.all_special_ids) else None


def prompt_token_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The token ids of ``messages`` rendered with the generation prompt, as training tokenized them."""
    from memfit.train.data.chat import render_prompt

    return list(tokenizer(render_prompt(tokenizer, messages), add_special_tokens=False)["input_ids"])


def generate_reply(
    model: Any,
    tokenizer: Any,
    messages: list[dict[str, str]],
    sampling: Sampling,
    device: Any,
    *,
    streamer: Any = None,
    processor: Any = None,
    images: list | None = None,
) -> Reply:
    """The model's reply to ``messages`` (the tokens are also handed to ``streamer`` as they come:
    transformers' ``TextStreamer`` or ``TextIteratorStreamer``). A vision-language model's prompt is
    rendered by its ``processor``, which puts ``images`` (one for each image part of the messages:
    pictures or file paths) into it."""
    import torch

    if processor is not None:
        inputs = {k: v.to(device) for k, v in vision_prompt(processor, messages, images or []).items()}
    else:
        inputs = {"input_ids": torch.tensor([prompt_token_ids(tokenizer, messages)], device=device)}
    input_ids = inputs.pop("input_ids")
    stops = stop_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops[0] if stops else None)
    with generation_mode(model), torch.no_grad():
        output = model.generate(
            input_ids=input_ids,
            **{"attention_mask": torch.ones_like(input_ids), **inputs},
            eos_token_id=stops or None,
            pad_token_id=pad_id,
            use_cache=True,
            streamer=streamer,
            **sampling.generate_kwargs(),
        )
    new = output[0, input_ids.shape[1] :].tolist()
    stopped = "eos" if new and new[-1] in stops else "max_new_tokens"
    return Reply(text=tokenizer.decode(new, skip_special_tokens=True), new_tokens=len(new), stopped=stopped)


def vision_prompt(processor: Any, messages: list[dict[str, Any]], images: list) -> dict[str, Any]:
    """The tensors of a vision-language prompt: ``messages`` rendered with the generation prompt by
    ``processor``'s chat template, ``images`` (pictures or paths, one for each image part) put in."""
    from memfit.train.data.chat import render_prompt
    from memfit.train.data.vision import open_image

    pictures = [open_image(image, index, max_pixels=2**62) for index, image in enumerate(images)]
    text = render_prompt(processor, messages)
    return dict(processor(text=[text], images=pictures or None, add_special_tokens=False, return_tensors="pt"))


def eval_generations(
    model: Any, tokenizer: Any, prompts: list, *, step: int, max_new_tokens: int, device: Any
) -> dict[str, Any]:
    """The ``metrics.jsonl`` record of the greedy replies to ``prompts`` at ``step``::

        {"step": 40, "max_new_tokens": 64, "generations": [
            {"messages": [{"role": "user", "content": "..."}], "generation": "...", "new_tokens": 12, "stopped": "eos"}]}

    Greedy decoding draws no random numbers, so a run's data order, dropout and resumes are the
    same with and without ``eval_prompts``.
    """
    sampling = Sampling(max_new_tokens=max_new_tokens)
    generations = []
    for prompt in prompts:
        messages = prompt_messages(prompt)
        reply = generate_reply(model, tokenizer, messages, sampling, device)
        generations.append(
            {"messages": messages, "generation": reply.text, "new_tokens": reply.new_tokens, "stopped": reply.stopped}
        )
    return {"step": step, "max_new_tokens": max_new_tokens, "generations": generations}
