"""Render conversations with a chat template and find where each assistant turn lies.

The boundaries come from rendering the conversation incrementally: the text up to an assistant turn
(with the generation prompt, as at inference) and the text through that turn. The assistant turn is
the difference between the two, provided the template renders every prefix as a prefix of the whole
conversation; templates that rewrite earlier turns (some drop past reasoning) are detected and
refused with a clear error instead of being masked wrongly.
"""

from __future__ import annotations

from typing import Any

# Used when the tokenizer has no chat template of its own (base models). Role markers are plain
# text, so any tokenizer can encode them; each turn ends with the EOS token, so a model trained on it
# stops generating after its answer. Rendered, a conversation looks like
#   <bos><|system|>\nBe brief.<eos><|user|>\nHi<eos><|assistant|>\nHello!<eos>
DEFAULT_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def prompt_end_problem(messages: list[dict[str, Any]]) -> str | None:
    """Why ``messages`` cannot be a prompt (None when they can): a reply, the assistant's, follows a
    prompt, so a prompt that ends with an assistant turn would put two of them in a row. The rule of
    ``memfit generate``'s and ``eval_prompts``' prompts, and of a preference pair's."""
    if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        return "ends with an assistant message, so the reply would be a second assistant turn in a row; end it with the user's turn the reply answers"
    return None


class ChatTemplateError(ValueError):
    """The chat template cannot be used to separate prompts from responses."""


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    # The tokenizer's own template wins; the default only fills in for tokenizers without one.
    template = None if getattr(tokenizer, "chat_template", None) else DEFAULT_CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    if not isinstance(text, str):  # a template that returns something else is unusable here
        raise ChatTemplateError(f"the chat template rendered {type(text).__name__}, expected text")
    return text


def render_chat(
    tokenizer: Any, messages: list[dict[str, str]], find_assistant_spans: bool = True, from_turn: int = 0
) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` with the tokenizer's chat template (or :data:`DEFAULT_CHAT_TEMPLATE`).

    Returns the rendered text and, when ``find_assistant_spans``, the ``[start, end)`` character
    span of each assistant turn in it (from message ``from_turn`` on: a prompt-completion record's
    completion): everything the template emits for that turn after the generation prompt, including
    its end marker.

    Raises:
        ChatTemplateError: the template fails on this conversation, or renders a prefix of the
            conversation differently from the start of the whole, so spans cannot be found.
    """
    try:
        full = _render(tokenizer, messages, add_generation_prompt=False)
        spans: list[tuple[int, int]] = []
        if not find_assistant_spans:
            return full, spans
        for index, message in enumerate(messages):
            if message["role"] != "assistant" or index < from_turn:
                continue
            before = _render(tokenizer, messages[:index], add_generation_prompt=True)
            through = _render(tokenizer, messages[: index + 1], add_generation_prompt=False)
            if not (through.startswith(before) and full.startswith(through)):
                raise ChatTemplateError(
                    f"the chat template renders turn {index} differently depending on what follows "
                    "it, so the response boundaries cannot be found; use conversations with one "
                    "assistant turn, train_on_inputs=True, or a template that renders past turns "
                    "unchanged"
                )
            spans.append((len(before), len(through)))
    except ChatTemplateError:
        raise
    except Exception as exc:  # jinja2 errors, including raise_exception() calls inside templates
        raise ChatTemplateError(f"the chat template failed: {exc}") from exc
    return full, spans


def render_messages(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """``messages`` rendered with the tokenizer's chat template (or :data:`DEFAULT_CHAT_TEMPLATE`);
    ``add_generation_prompt``: end with what opens an assistant turn (a prompt as the model sees it).

    Raises:
        ChatTemplateError: the template fails on these messages.
    """
    try:
        return _render(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    except ChatTemplateError:
        raise
    except Exception as exc:  # jinja2 errors, including raise_exception() calls inside templates
        raise ChatTemplateError(f"the chat template failed: {exc}") from exc


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """``messages`` rendered as at inference: the conversation so far and the assistant's
    generation prompt, with the template training rendered them with (the tokenizer's own, else
    :data:`DEFAULT_CHAT_TEMPLATE`). Raises :class:`ChatTemplateError` when the template fails."""
    return render_messages(tokenizer, messages, add_generation_prompt=True)
