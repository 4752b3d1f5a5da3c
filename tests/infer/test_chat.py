"""``memfit chat``: the conversation, its commands, and the command in a real terminal."""

from __future__ import annotations

import io
import os
import select
import signal
import subprocess
import sys

from memfit.infer.chat import PROMPT, Conversation


def test_the_conversation_keeps_its_system_prompt_across_resets():
    conversation = Conversation("Be brief.")
    conversation.add("user", "Hi")
    conversation.add("assistant", "Hello")
    conversation.add("user", "And?")
    conversation.drop_unanswered()  # a stopped reply: its question goes too
    assert conversation.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    conversation.reset()
    assert conversation.messages == [{"role": "system", "content": "Be brief."}]
    assert Conversation().messages == []


def test_each_turn_sees_the_whole_conversation(demo_run, monkeypatch):
    from memfit.infer import chat as chat_module
    from memfit.infer.loading import load_chat_model
    from memfit.train.generation import Sampling

    seen, replies = [], []
    real = chat_module.generate_reply

    def recording(model, tokenizer, messages, sampling, device, *, streamer=None):
        seen.append([dict(m) for m in messages])
        replies.append(real(model, tokenizer, messages, sampling, device, streamer=streamer))
        return replies[-1]

    monkeypatch.setattr(chat_module, "generate_reply", recording)
    lines = iter(["Hi", "", "And then?", "/reset", "/nope", "Again", "/exit", "never read"])
    out = io.StringIO()
    code = chat_module.run_chat(
        load_chat_model(str(demo_run), device="cpu"),
        Sampling(max_new_tokens=4),
        system="Be brief.",
        read_line=lambda prompt: next(lines),
        out=out,
    )
    assert code == 0
    system = {"role": "system", "content": "Be brief."}
    assert [[m["content"] for m in messages] for messages in seen] == [
        ["Be brief.", "Hi"],
        ["Be brief.", "Hi", seen[1][2]["content"], "And then?"],
        ["Be brief.", "Again"],
    ]
    assert seen[1][2]["role"] == "assistant" and seen[0][0] == system
    text = out.getvalue()
    assert text.startswith(f"chatting with {demo_run}: lora adapter on smollm2-135m")
    assert "(a new conversation: the system prompt stays)" in text and "/nope: not a command" in text
    assert seen[1][2]["content"] == replies[0].text  # the reply as streamed is the turn the model sees next
    assert text.count("(cut at --max-new-tokens 4)") == sum(r.stopped == "max_new_tokens" for r in replies)
    for reply in replies:
        assert reply.text in text


def test_the_end_of_input_ends_the_chat(demo_run):
    from memfit.infer.chat import run_chat
    from memfit.infer.loading import load_chat_model
    from memfit.train.generation import Sampling

    def end(prompt):
        raise EOFError

    assert run_chat(load_chat_model(str(demo_run), device="cpu"), Sampling(), read_line=end, out=io.StringIO()) == 0


# ------------------------------------------------------------------------------------------------
# In a terminal

#: Generous: the limit only keeps a broken chat from hanging the suite.
WAIT_S = 600


def _read_until(fd: int, marker: bytes, seen: bytearray, pieces: list[bytes] | None = None) -> bytes:
    """Read the terminal until ``marker`` has come after what ``seen`` holds; return the new bytes."""
    start = len(seen)
    while marker not in seen[start:]:
        ready, _, _ = select.select([fd], [], [], WAIT_S)
        assert ready, f"nothing more from the chat; it printed: {bytes(seen[start:])!r}"
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the terminal closed: the process is gone
            chunk = b""
        assert chunk, f"the chat ended early; it printed: {bytes(seen[start:])!r}"
        seen += chunk
        if pieces is not None:
            pieces.append(chunk)
    return bytes(seen[start:])


def _first_reply_text(fd: int, seen: bytearray, typed: bytes) -> bytes:
    """Read past the terminal's echo of ``typed`` until the reply's first text arrives."""
    _read_until(fd, typed.strip() + b"\r\n", seen)
    start = len(seen)
    while not bytes(seen[start:]).strip():
        ready, _, _ = select.select([fd], [], [], WAIT_S)
        assert ready, "no reply"
        seen += os.read(fd, 4096)
    return bytes(seen[start:])


def test_chat_in_a_terminal_streams_replies_and_takes_its_commands(demo_run):
    # A pseudo-terminal, as a person would run it. The reply is long (100,000 tokens: seconds of
    # generation on any machine, so that the SIGINT below cannot come after its end); its first
    # words are on the screen while it is still being written: Ctrl-C (SIGINT) then stops that
    # reply, and the chat goes on. Had the reply come all at once at its end, the SIGINT would reach
    # the prompt and end the chat instead.
    master, slave = os.openpty()
    command = [
        sys.executable,
        "-m",
        "memfit",
        "chat",
        str(demo_run),
        "--device",
        "cpu",
        "--min-new-tokens",
        "100000",
        "--max-new-tokens",
        "100000",
    ]
    # SIGINT as a terminal has it: a test run started in the background (nohup, `&`) ignores it,
    # and a Python started with it ignored never turns it into KeyboardInterrupt.
    proc = subprocess.Popen(
        command,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        close_fds=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    os.close(slave)
    seen = bytearray()
    try:
        assert b"chatting with" in _read_until(master, PROMPT.encode(), seen)
        os.write(master, b"Tell me a long story.\n")
        first = _first_reply_text(master, seen, b"Tell me a long story.")
        assert PROMPT.encode() not in first  # the reply has begun, and the next prompt has not come
        proc.send_signal(signal.SIGINT)
        stopped = _read_until(master, PROMPT.encode(), seen)
        assert b"(stopped; that turn is forgotten)" in stopped and proc.poll() is None

        os.write(master, b"/reset\n")
        assert b"(a new conversation)" in _read_until(master, PROMPT.encode(), seen)
        os.write(master, b"/exit\n")
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert b"Traceback" not in seen
