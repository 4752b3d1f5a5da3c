"""A vision-language run's processor: the model's own, or one built here for a random tiny model.

A pretrained model's processor (its image processor, tokenizer and chat template) is read with
``AutoProcessor`` from the model's folder or from ``tokenizer``. A random model (``init: random``)
without ``tokenizer`` gets one built from parameters, no Hub involved: the family's image processor
sized by the model's config, the shipped tiny tokenizer with the image token added
(:data:`TINY_IMAGE_TOKENS`), and the tiny tokenizer's chat template taught to render image parts.
"""

from __future__ import annotations

from typing import Any

from memfit.train.errors import TrainError

#: The image placeholder token the tiny processor adds to the shipped tokenizer (its id: 512, the
#: tokenizer's first free one), by model type.
TINY_IMAGE_TOKENS = {"llava": "<image>"}

#: The shipped tokenizer's chat template, with a turn's parts rendered: an image part as the
#: family's image token, a text part as its text.
_TINY_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}IMAGE{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def load_processor(path: str | None, model_config) -> Any:
    """The processor of a vision-language model of ``model_config`` (a transformers config): read from
    ``path`` (a model's folder, or ``tokenizer``), or built for a tiny random model when None."""
    if path is None:
        return tiny_processor(model_config)
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(path))
    except (OSError, ValueError, TypeError, ImportError, AttributeError) as err:
        raise TrainError(f"tokenizer: cannot load the model's processor from {str(path)!r}: {err}") from None
    if not hasattr(processor, "image_processor"):
        raise TrainError(
            f"tokenizer: {path} holds a tokenizer and no image processor; a vision-language model needs its "
            "processor (preprocessor_config.json beside the tokenizer)"
        )
    return processor


def tiny_processor(model_config) -> Any:
    """A processor for a random tiny model of ``model_config``: the family's image processor made
    from the config's image size, the shipped tokenizer with the image token added."""
    from transformers import AutoTokenizer

    from memfit.train.data import tiny_tokenizer_path

    family = model_config.model_type
    token = TINY_IMAGE_TOKENS.get(family)
    if token is None:
        raise TrainError(
            f"tokenizer: init: random builds a processor for {', '.join(TINY_IMAGE_TOKENS)} models only, not "
            f"{family}; set tokenizer: to a folder holding the model's processor"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_path()))
    tokenizer.add_special_tokens({"additional_special_tokens": [token]})
    token_id = tokenizer.convert_tokens_to_ids(token)
    wanted = getattr(model_config, "image_token_index", getattr(model_config, "image_token_id", None))
    if wanted != token_id:
        raise TrainError(
            f"model_overrides: image_token_index: {wanted} is not the tiny tokenizer's image token {token} "
            f"({token_id}); set image_token_index: {token_id} and vocab_size: {len(tokenizer)} or more"
        )
    return _llava(model_config, tokenizer, _TINY_TEMPLATE.replace("IMAGE", token))


def _llava(config, tokenizer, template: str):
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    vision = config.vision_config
    side = int(vision.image_size)
    images = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        chat_template=template,
        patch_size=int(vision.patch_size),
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=1,  # CLIP's class token
    )
