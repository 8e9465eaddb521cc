"""Models with the exact shape of the ones users start RL from, with random weights, made locally.

A 0.5 B model with Qwen2.5's 151,936-row vocabulary costs what the real one costs to sample, train, broadcast and
checkpoint — which is what sizing and benchmarking the system needs — but it knows nothing: such a model is for
systems work (speed, memory, the mechanics of the loop at size), never for learning curves.

The architecture values are the published ``config.json`` of each model; the tokenizer is a small byte-level BPE
trained on local text (:func:`asyncrl.common.tiny_models.chat.corpus`) with the model's special tokens and chat
template, and the embedding is padded to the real vocabulary (ids beyond the tokenizer are sampled like Qwen2.5's
padded rows). ``layers`` may lower the depth: the real vocabulary and widths at two layers exercise the large LM head,
the padded vocabulary on the wire and the bf16 path in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from tokenizers import processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from asyncrl.common.tiny_models.chat import END_OF_TEXT, IM_END, IM_START, save_chat_model, trained_bpe

QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + QWEN25_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5-Instruct's template without its tool-calling parts: ChatML, with Qwen's system message by default."""

BEGIN, END, HEADER_START, HEADER_END, EOT = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' + system + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
"""Llama 3.2-Instruct's template without its tool-calling parts: a header per turn, ``<|eot_id|>`` ends a turn, and
the system turn with its knowledge date is always written."""


@dataclass(frozen=True)
class Shape:
    """One published architecture: the ``config.json`` values that set its size and numerics."""

    family: str  # "qwen2.5" or "llama3"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    max_position: int
    rope_theta: float
    rms_norm_eps: float
    tied: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def parameters(self, layers: int | None = None) -> int:
        """Weights of the model at ``layers`` deep (default: its own), counted from the shape: embedding (twice when
        untied), per layer q/k/v (with Qwen's biases) and o, the gated MLP, two norms; the final norm."""
        head = self.hidden // self.heads
        kv = self.kv_heads * head
        attention = self.hidden * (self.hidden + 2 * kv) + self.hidden * self.hidden
        attention += (self.hidden + 2 * kv) if self.family == "qwen2.5" else 0
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embedding = self.vocab * self.hidden * (1 if self.tied else 2)
        return embedding + (self.layers if layers is None else layers) * layer + self.hidden


SHAPES: dict[str, Shape] = {
    "qwen2.5-0.5b": Shape("qwen2.5", 896, 4864, 24, 14, 2, 151_936, 32_768, 1_000_000.0, 1e-6),
    "qwen2.5-1.5b": Shape("qwen2.5", 1536, 8960, 28, 12, 2, 151_936, 32_768, 1_000_000.0, 1e-6),
    "llama-3.2-1b": Shape(
        "llama3", 2048, 8192, 16, 32, 8, 128_256, 131_072, 500_000.0, 1e-5,
        extra={
            "head_dim": 64,
            "rope_scaling": {
                "rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
}  # fmt: skip
"""``init-model --shape``: Qwen2.5-0.5B/1.5B-Instruct and Llama-3.2-1B-Instruct, as their ``config.json`` give them."""


def shaped_tokenizer(family: str, *, vocab_size: int = 512, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with the special tokens, end of turn and chat template of ``family``: Qwen2.5's
    (no BOS, EOS ``<|im_end|>``, pad ``<|endoftext|>``) or Llama 3's (BOS ``<|begin_of_text|>`` on plain text and
    in the template, EOS ``<|eot_id|>``)."""
    if family == "qwen2.5":
        backend = trained_bpe([END_OF_TEXT, IM_START, IM_END], vocab_size=vocab_size, seed=seed)
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
        names, template, extra = {"eos_token": IM_END, "pad_token": END_OF_TEXT}, QWEN25_TEMPLATE, [IM_START]
    else:
        backend = trained_bpe([BEGIN, END, HEADER_START, HEADER_END, EOT], vocab_size=vocab_size, seed=seed)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{BEGIN} $A", pair=f"{BEGIN} $A $B", special_tokens=[(BEGIN, backend.token_to_id(BEGIN))]
        )
        names = {"bos_token": BEGIN, "eos_token": EOT, "pad_token": END}
        template, extra = LLAMA3_TEMPLATE, [HEADER_START, HEADER_END]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, clean_up_tokenization_spaces=False, model_max_length=32_768, **names
    )
    tokenizer.add_special_tokens({"additional_special_tokens": extra})
    tokenizer.chat_template = template
    return tokenizer


def init_shaped_model(
    out_dir: str | Path, name: str, *, dtype: str = "float32", layers: int | None = None, seed: int = 0
) -> Path:
    """Write a Hugging Face folder with the shape ``name`` (:data:`SHAPES`), random weights from ``seed``, in
    ``dtype``; ``layers`` (default: the shape's) lowers the depth. Returns the folder's path."""
    if name not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {name!r}")
    shape = SHAPES[name]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = shaped_tokenizer(shape.family, seed=seed)
    values = {
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers if layers is None else layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "max_position_embeddings": shape.max_position,
        "rope_theta": shape.rope_theta,
        "rms_norm_eps": shape.rms_norm_eps,
        "tie_word_embeddings": shape.tied,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "dtype": dtype,
        **shape.extra,
    }
    if shape.family == "qwen2.5":
        config, model_class = Qwen2Config(**values), Qwen2ForCausalLM
        ends = (IM_END, END_OF_TEXT)
    else:
        config, model_class = LlamaConfig(**values), LlamaForCausalLM
        ends = (END, EOT)
    eos = [cast(int, tokenizer.convert_tokens_to_ids(token)) for token in ends]
    return save_chat_model(out, config, model_class, tokenizer, eos=eos, seed=seed)
