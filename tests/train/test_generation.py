"""Replies from a model (memfit.train.generation): prompts, greedy decoding, the model's training
settings put back, and the eval_prompts records a run writes."""

from __future__ import annotations

import json

import pytest

from memfit.train.generation import Sampling, prompt_messages, prompt_problem


def test_prompts_are_text_or_messages_ending_with_a_user_turn():
    assert prompt_problem("Hi") is None
    assert prompt_problem([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]) is None
    assert "empty text" in prompt_problem("  ")
    assert "is not a prompt" in prompt_problem(3)
    assert "is not a prompt" in prompt_problem([])
    assert "exactly role and content" in prompt_problem([{"role": "user"}])
    assert "role 'bot' is not one of system, user, assistant" in prompt_problem([{"role": "bot", "content": "x"}])
    assert "content must be text" in prompt_problem([{"role": "user", "content": 5}])
    assert "ends with an assistant message" in prompt_problem(
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    )
    assert prompt_messages("Hi") == [{"role": "user", "content": "Hi"}]


def test_sampling_options_are_checked_and_greedy_means_greedy():
    assert Sampling().problems() == []
    problems = Sampling(max_new_tokens=0, temperature=0.0, top_p=1.5).problems()
    assert [p.split()[0] for p in problems] == ["--max-new-tokens", "--temperature", "--top-p"]
    assert Sampling(max_new_tokens=4, min_new_tokens=5).problems() == [
        "--min-new-tokens 5: must be from 0 to --max-new-tokens (4)"
    ]
    assert Sampling(min_new_tokens=3).generate_kwargs()["min_new_tokens"] == 3
    # Greedy overrides whatever sampling a model's generation_config asks for.
    assert Sampling().generate_kwargs() == {
        "max_new_tokens": 256,
        "do_sample": False,
        "temperature": None,
        "top_p": None,
        "top_k": None,
    }
    assert Sampling(do_sample=True, temperature=0.7, top_p=0.9).generate_kwargs() == {
        "max_new_tokens": 256,
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.9,
    }


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture
def tiny_model_and_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memfit.models.build import make_config
    from memfit.models.catalog import load_catalog_config
    from memfit.train.data import tiny_tokenizer_path

    config = dict(
        load_catalog_config("smollm2-135m"),
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(config), dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(str(tiny_tokenizer_path()))


def test_a_greedy_reply_is_the_likeliest_token_each_time(tiny_model_and_tokenizer):
    from memfit.train.generation import generate_reply, prompt_token_ids, stop_token_ids

    model, tokenizer = tiny_model_and_tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = generate_reply(model, tokenizer, messages, Sampling(max_new_tokens=6), torch.device("cpu"))
    # The same six tokens by hand: the prompt as training renders it, then argmax after argmax.
    ids = prompt_token_ids(tokenizer, messages)
    assert tokenizer.decode(ids).startswith(tokenizer.bos_token + "<|user|>\nWhat is the capital of France?")
    expected = []
    with torch.no_grad():
        for _ in range(6):
            token = int(model(input_ids=torch.tensor([ids + expected])).logits[0, -1].argmax())
            expected.append(token)
            if token in stop_token_ids(model, tokenizer):
                break
    assert reply.new_tokens == len(expected)
    assert reply.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert reply.stopped == ("eos" if expected[-1] in stop_token_ids(model, tokenizer) else "max_new_tokens")


def test_min_new_tokens_holds_the_end_back(tiny_model_and_tokenizer):
    from memfit.train.generation import generate_reply, stop_token_ids

    model, tokenizer = tiny_model_and_tokenizer
    messages = [{"role": "user", "content": "Hi"}]
    # A model that always wants to end: every end token is the likeliest next token.
    with torch.no_grad():
        model.lm_head.weight[stop_token_ids(model, tokenizer)] += 100.0
    assert generate_reply(model, tokenizer, messages, Sampling(max_new_tokens=8), torch.device("cpu")).new_tokens == 1
    held = generate_reply(model, tokenizer, messages, Sampling(max_new_tokens=8, min_new_tokens=5), torch.device("cpu"))
    assert held.new_tokens == 6 and held.stopped == "eos"  # five tokens, then the end it was held from


def test_a_reply_ends_where_the_template_ends_an_assistant_turn(tiny_model_and_tokenizer):
    from memfit.train.generation import stop_token_ids, turn_end_token_id

    model, tokenizer = tiny_model_and_tokenizer
    # The shipped tiny tokenizer's template closes each turn with <|end|>, which is not its EOS.
    assert tokenizer.convert_ids_to_tokens(turn_end_token_id(tokenizer)) == "<|end|>"
    assert stop_token_ids(model, tokenizer)[:2] == [turn_end_token_id(tokenizer), tokenizer.eos_token_id]
    tokenizer.chat_template = None  # memfit's default template ends each turn with EOS
    assert turn_end_token_id(tokenizer) == tokenizer.eos_token_id


def test_generation_puts_the_training_settings_back(tiny_model_and_tokenizer):
    from memfit.step.attention import IMPLEMENTATION, use_document_attention
    from memfit.train.generation import generation_mode

    model, _ = tiny_model_and_tokenizer
    use_document_attention(model)
    model.train()
    with generation_mode(model):
        assert not model.training and model.config._attn_implementation != IMPLEMENTATION
    assert model.training and model.config._attn_implementation == IMPLEMENTATION
    model.eval()
    with generation_mode(model):
        pass
    assert not model.training


def test_a_run_writes_the_replies_to_its_eval_prompts(tmp_path):
    from trainer_helpers import read_metrics, tiny_config

    from memfit.train.recipe import train

    prompts = [
        "What is the capital of France?",
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    ]
    # With dropout, a generation that drew random numbers would change every loss after step 3.
    train(
        tiny_config(tmp_path / "with", eval_prompts=prompts, eval_every=3, eval_max_new_tokens=5, dropout=0.1),
        progress=False,
    )
    train(tiny_config(tmp_path / "without", eval_every=3, dropout=0.1), progress=False)
    records = read_metrics(tmp_path / "with")
    generated = [r for r in records if "generations" in r]
    assert [r["step"] for r in generated] == [3, 6]  # every eval_every steps and at the end
    for record in generated:
        assert record["max_new_tokens"] == 5
        assert [g["messages"] for g in record["generations"]] == [prompt_messages(p) for p in prompts]
        for generation in record["generations"]:
            assert isinstance(generation["generation"], str) and 1 <= generation["new_tokens"] <= 5
            assert generation["stopped"] in ("eos", "max_new_tokens")
    json.dumps(generated)  # plain JSON all the way down
    # Greedy decoding draws no random numbers: the training itself is the same without the prompts.
    losses = lambda rs: [(r["step"], r["loss"]) for r in rs if "loss" in r]  # noqa: E731
    assert losses(records) == losses(read_metrics(tmp_path / "without"))
