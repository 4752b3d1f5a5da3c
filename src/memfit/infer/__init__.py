"""Talk to a model memfit trained: ``memfit chat`` (a terminal conversation, replies streamed) and
``memfit generate`` (the replies to a JSONL file of prompts).

:mod:`~memfit.infer.loading` finds the model (a run folder's adapter on the run's base, rebuilt by
the trainer's loader; or a model folder or Hub id with an optional adapter);
:mod:`~memfit.infer.chat` and :mod:`~memfit.infer.batch` drive the conversation and the file. The
replies come from :func:`memfit.train.generation.generate_reply`, the function a run's
``eval_prompts`` use, with the chat template the training data was rendered with. Importing this
package imports neither torch nor transformers.
"""

from __future__ import annotations

from memfit.infer.loading import ChatError, ChatModel, load_chat_model

__all__ = ["ChatError", "ChatModel", "load_chat_model"]
