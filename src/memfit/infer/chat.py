"""``memfit chat``: a conversation with a model in the terminal, its replies streamed as they come.

Each turn renders the whole conversation with the chat template the model trained with and
generates the assistant's next reply (:func:`memfit.train.generation.generate_reply`, the function
a run's ``eval_prompts`` use). ``/reset`` starts the conversation again (the ``--system`` prompt
stays), ``/exit`` or Ctrl-D ends it; Ctrl-C stops a reply that is being written.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

from memfit.train.generation import Sampling, generate_reply

#: What the user types before each turn.
PROMPT = ">>> "
HELP = "/reset starts again, /exit (or Ctrl-D) ends the chat, Ctrl-C stops a reply"


class Conversation:
    """The messages so far: the system prompt (which ``/reset`` keeps) and the turns after it."""

    def __init__(self, system: str | None = None, images: list[str] | None = None) -> None:
        self.system = system
        self.images = list(images or [])  # shown with the conversation's first user turn
        self.turns: list[dict[str, Any]] = []

    @property
    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def add(self, role: str, content: str) -> None:
        if role == "user" and self.images and not self.turns:
            parts = [{"type": "image"} for _ in self.images] + [{"type": "text", "text": content}]
            self.turns.append({"role": role, "content": parts})
            return
        self.turns.append({"role": role, "content": content})

    def drop_unanswered(self) -> None:
        """Forget a user turn whose reply was stopped, so the next turn does not follow it."""
        if self.turns and self.turns[-1]["role"] == "user":
            self.turns.pop()

    def reset(self) -> None:
        self.turns = []


def make_streamer(tokenizer: Any, out: TextIO) -> Any:
    """A transformers ``TextStreamer`` that writes the reply's text to ``out`` as it is decoded
    (whole words: the streamer holds back a word until it is complete), flushing each piece."""
    from transformers import TextStreamer

    class _Streamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            out.write(text + ("\n" if stream_end else ""))
            out.flush()

    return _Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def run_chat(
    chat_model: Any,
    sampling: Sampling,
    *,
    system: str | None = None,
    images: list[str] | None = None,
    read_line: Callable[[str], str] = input,
    out: TextIO = sys.stdout,
) -> int:
    """Talk with ``chat_model`` (:class:`memfit.infer.loading.ChatModel`) until ``/exit`` or the end of input;
    return the exit code (0). ``images`` (file paths) go with the first user turn of each conversation."""
    conversation = Conversation(system, images)
    out.write(f"chatting with {chat_model.description}\n{HELP}\n")
    out.flush()
    while True:
        try:
            line = read_line(PROMPT)
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command = text.split()[0].lower()
            if command in ("/exit", "/quit"):
                return 0
            if command == "/reset":
                conversation.reset()
                out.write("(a new conversation" + (": the system prompt stays" if system else "") + ")\n")
            else:
                out.write(f"{command}: not a command; {HELP}\n")
            out.flush()
            continue
        conversation.add("user", text)
        try:
            reply = generate_reply(
                chat_model.model,
                chat_model.tokenizer,
                conversation.messages,
                sampling,
                chat_model.device,
                streamer=make_streamer(chat_model.tokenizer, out),
                **_vision(chat_model, conversation.images),
            )
        except KeyboardInterrupt:
            conversation.drop_unanswered()
            out.write("\n(stopped; that turn is forgotten)\n")
            out.flush()
            continue
        conversation.add("assistant", reply.text)
        if reply.stopped == "max_new_tokens":
            out.write(f"(cut at --max-new-tokens {sampling.max_new_tokens})\n")
            out.flush()


def _vision(chat_model: Any, images: list[str]) -> dict[str, Any]:
    """What a vision-language model's replies take beside the messages: its processor and the images."""
    processor = getattr(chat_model, "processor", None)
    return {"processor": processor, "images": images} if processor is not None else {}
