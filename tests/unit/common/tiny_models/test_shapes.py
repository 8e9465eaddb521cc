"""The published shapes of ``init-model --shape``: their sizes are the published parameter counts, and the
tokenizers write each model's chat template with its own end of turn."""

from __future__ import annotations

import pytest

from asyncrl.common.data.prompts import turn_end_id
from asyncrl.common.tiny_models.shapes import SHAPES, shaped_tokenizer


@pytest.mark.parametrize(
    ("name", "published"),
    [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-1.5b", 1_543_714_304), ("llama-3.2-1b", 1_235_814_400)],
)
def test_each_shape_has_the_published_parameter_count(name: str, published: int) -> None:
    assert SHAPES[name].parameters() == published


@pytest.mark.parametrize(("family", "turn_end"), [("qwen2.5", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_the_tokenizer_writes_the_models_template_and_ends_a_turn_with_its_token(family: str, turn_end: str) -> None:
    tokenizer = shaped_tokenizer(family, vocab_size=300)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(prompt, str)
    assert prompt.count("What is 2+3?") == 1 and prompt.startswith(
        "<|im_start|>system\nYou are Qwen" if family == "qwen2.5" else "<|begin_of_text|><|start_header_id|>system"
    )
    assert tokenizer.convert_ids_to_tokens(turn_end_id(tokenizer)) == turn_end
