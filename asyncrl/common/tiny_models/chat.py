"""Tiny chat models as users bring them: a real byte-level BPE tokenizer with a ChatML template, built locally.

Beside the character-level tiny model (``common/tiny_models/character.py``), tests and demos need models that look like
the Hugging Face instruct models users arrive with — a BPE tokenizer trained with ``tokenizers`` (here on generated
text), special tokens ``<|im_start|>`` / ``<|im_end|>`` and a chat template in ``tokenizer_config.json`` — in two
architectures that vLLM and transformers both load from a plain folder. Nothing is fetched from a hub.

==========  ========================================================================================================
``llama``   LlamaForCausalLM; BOS ``<s>`` (the template writes it, the tokenizer also adds it to plain text), EOS =
            ``<|im_end|>`` (as in Qwen2.5-Instruct: vLLM stops on it by itself), untied embeddings
``qwen2``   Qwen2ForCausalLM (grouped-query attention, q/k/v biases); no BOS, EOS = ``<|endoftext|>`` (as in a base
            model: the template's ``<|im_end|>`` ends a turn only through ``Prompter.stop_ids``), tied embeddings
            padded beyond the tokenizer (as Qwen2.5's 151,936 rows for 151,665 tokens)
``qwen3``   Qwen3ForCausalLM (q/k norms), otherwise as ``qwen2``, with a thinking model's template
            (:data:`THINKING_TEMPLATE`): ``<think>`` and ``</think>`` are tokens of their own, and the reasoning of an
            assistant turn is dropped once a later user turn follows, as Qwen3's template does
==========  ========================================================================================================
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Literal, cast

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from asyncrl.common.tiny_models.character import IGNORE_INDEX, Row, _save_tokenizer, _seeded, warm_start_rows

Architecture = Literal["llama", "qwen2", "qwen3"]
ARCHITECTURES: tuple[Architecture, ...] = ("llama", "qwen2", "qwen3")
IM_START, IM_END, END_OF_TEXT, BOS, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "<pad>"
THINK, END_THINK = "<think>", "</think>"

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML, as Qwen's templates write it (without their tool-calling parts)."""

THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- if loop.index0 > ns.last_query %}"
    "{%- set content = '<think>\n' + reasoning + '\n</think>\n\n' + content %}"
    "{%- endif %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
"""ChatML as a thinking model's template writes it (Qwen3's, without its tool-calling parts): an assistant turn's
reasoning (``<think>…</think>`` before its answer) is rendered only after the last user turn; earlier assistant turns
keep their answer alone. A tool's reply is not a user turn, so reasoning within one tool-calling exchange stays."""

_WORDS_TEXT = (
    "what is the sum of and plus minus times answer question number result please compute tell me how much "
    "a an one two three four five six seven eight nine ten value total give only write think step first then "
    "café naïve über déjà vu résumé why who where when which"
)
_WORDS = _WORDS_TEXT.split()


def corpus(n: int = 3000, seed: int = 0) -> list[str]:
    """Generated text to train the tokenizer on: arithmetic questions and answers, words, punctuation (``? ! .``),
    a few accented letters, so that the BPE merges look like a small natural-language vocabulary."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        words = " ".join(rng.choices(_WORDS, k=rng.randint(3, 12)))
        lines.append(rng.choice([f"What is {a}+{b}?", f"{a} plus {b} is {a + b}.", f"{words.capitalize()}?", words]))
    return lines


def trained_bpe(specials: list[str], *, vocab_size: int, seed: int) -> Tokenizer:
    """A byte-level BPE model with ``specials`` first (ids 0, 1, …), trained on :func:`corpus` up to ``vocab_size``."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus(seed=seed), trainer)
    return backend


def build_bpe_tokenizer(arch: Architecture, *, vocab_size: int = 512, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on :func:`corpus`, with the special tokens and template of ``arch``.

    Byte-level: every string encodes (no unknown token), and decoding a whole response gives its text back; but
    decoding a token *prefix* and re-encoding it need not give the same ids — why ids, never text, travel to the
    learner.
    """
    specials = [END_OF_TEXT, IM_START, IM_END] + ([BOS, PAD] if arch == "llama" else [])
    backend = trained_bpe(specials, vocab_size=vocab_size, seed=seed)
    if arch == "llama":  # plain text gets BOS from the tokenizer; the chat template writes its own
        bos = backend.token_to_id(BOS)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos)]
        )
        names = {"bos_token": BOS, "eos_token": IM_END, "pad_token": PAD}
        template = "{{- bos_token }}" + CHATML_TEMPLATE
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
        names = {"eos_token": END_OF_TEXT, "pad_token": END_OF_TEXT}
        template = CHATML_TEMPLATE
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, clean_up_tokenization_spaces=False, model_max_length=512, **names
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tokenizer.chat_template = template
    if arch == "qwen3":  # tokens of their own that a decode keeps (not special), as in Qwen3's tokenizer
        tokenizer.add_tokens([THINK, END_THINK])
        tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def init_chat_model(
    out_dir: str | Path,
    arch: Architecture,
    *,
    vocab_size: int = 512,
    padded_vocab: int | None = None,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    intermediate: int = 256,
    max_position: int = 512,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a Hugging Face folder of ``arch`` (random weights from ``seed``, :func:`build_bpe_tokenizer`).

    ``padded_vocab`` (at least the tokenizer's length) sets the embedding's rows; by default ``qwen2`` pads to the
    next multiple of 64 plus 64 and ``llama`` does not pad. Returns the folder's path.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_bpe_tokenizer(arch, vocab_size=vocab_size, seed=seed)
    if padded_vocab is None:
        padded_vocab = len(tokenizer) if arch == "llama" else (len(tokenizer) // 64 + 2) * 64
    if padded_vocab < len(tokenizer):
        raise ValueError(f"padded_vocab {padded_vocab} is below the tokenizer's {len(tokenizer)} tokens")
    eos = [cast(int, tokenizer.eos_token_id)]
    shape = {
        "vocab_size": padded_vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "max_position_embeddings": max_position,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": eos[0],
        "dtype": dtype,
    }
    if arch == "llama":
        config = LlamaConfig(num_key_value_heads=heads, tie_word_embeddings=False, **shape)
        model_class = LlamaForCausalLM
    elif arch == "qwen2":
        from transformers import Qwen2ForCausalLM

        config = Qwen2Config(num_key_value_heads=max(1, heads // 2), tie_word_embeddings=True, **shape)
        model_class = Qwen2ForCausalLM
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        kv_heads = max(1, heads // 2)
        config = Qwen3Config(num_key_value_heads=kv_heads, head_dim=hidden // heads, tie_word_embeddings=True, **shape)
        model_class = Qwen3ForCausalLM
    return save_chat_model(out, config, model_class, tokenizer, eos=eos, seed=seed)


def save_chat_model(
    out: Path,
    config: PretrainedConfig,
    model_class: type,
    tokenizer: PreTrainedTokenizerFast,
    *,
    eos: list[int],
    seed: int,
) -> Path:
    """Write ``model_class(config)`` with weights drawn from ``seed``, in the config's dtype, and the tokenizer with
    its chat template; generation stops on ``eos``. Returns ``out``."""
    with _seeded(seed):
        model = model_class(config)
    model.to(getattr(torch, str(config.dtype).removeprefix("torch.")))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    _save_chat_tokenizer(tokenizer, out)
    return out


def _save_chat_tokenizer(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Save the tokenizer with its chat template inside ``tokenizer_config.json``, where most hub models keep it
    (transformers 5 writes ``chat_template.jinja`` instead; both are read)."""
    _save_tokenizer(tokenizer, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = tokenizer.chat_template
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)


def chat_examples(n: int, seed: int = 0, max_number: int = 9) -> list[dict]:
    """``n`` chat rows ``{"messages": [{"role": "user", "content": "What is 3+4?"}], "answer": "7"}`` (addition of
    numbers up to ``max_number``), as a user's chat-formatted JSONL holds them; the ``arithmetic`` verifier scores
    a response whose first line is the sum."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, max_number), rng.randint(0, max_number)
        rows.append({"messages": [{"role": "user", "content": f"What is {a}+{b}?"}], "answer": str(a + b), "id": i})
    return rows


def warm_start_chat(model_dir: str | Path, rows: list[dict], *, steps: int, seed: int = 0, **options) -> dict:
    """Fine-tune the folder's model on chat rows (:func:`chat_examples`): the templated prompt (masked), then the
    answer and the template's end of turn, so that it learns to answer and to close its turn; a thinking model's
    (``qwen3``) answer comes after a short reasoning block, as such models write. Options as
    :func:`asyncrl.common.tiny_models.character.warm_start_rows`, which returns the figures."""
    from transformers import AutoTokenizer

    from asyncrl.common.config import TaskSection
    from asyncrl.common.data.prompts import Prompter, turn_end_id
    from asyncrl.common.data.tasks import TaskExample

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompter = Prompter.for_tokenizer(tokenizer, TaskSection(chat=True))
    end = turn_end_id(tokenizer)
    reasoning = f"{THINK}\nadd them\n{END_THINK}\n\n" if THINK in tokenizer.get_vocab() else ""
    encoded: list[Row] = []
    for row in rows:
        example = TaskExample(row["messages"][-1]["content"], row["answer"], tuple(row["messages"]))
        prompt = prompter.encode(prompter.text(example))
        answer = [*tokenizer(reasoning + row["answer"], add_special_tokens=False)["input_ids"], end]
        encoded.append((prompt + answer, [IGNORE_INDEX] * len(prompt) + answer))
    return warm_start_rows(model_dir, encoded, steps=steps, seed=seed, **options)
