"""What a reward function reads is the decode of the token ids the learner trains.

An actor ships each response twice: as token ids (what the learner trains) and as text (vLLM's detokenized output).
Nothing ties the two together on the wire, so a group whose texts say "6" over token ids that say "99" would be
scored for the text and trained on the ids. So the text that is scored is never taken from the wire:

- the reward worker replaces every response's text with :meth:`ResponseTexts.decode` of its token ids before any
  reward function reads it (a text that differed is counted: ``asyncrl_reward_replaced_texts_total``);
- the learner decodes the ids again and refuses a group whose texts are not exactly that decode
  (:meth:`ResponseTexts.mismatch`), so it trains only ids whose scored text it has checked itself;
- ``samples.jsonl`` shows those texts: the decode of the trained ids.

One decode serves both sides: ``tokenizer.decode(ids, skip_special_tokens=True)`` with the run's own tokenizer
(``model.path``), the setting vLLM's detokenizer uses by default — an end-of-turn token is dropped from the text
and kept in the ids. A decode of one response alone may differ from vLLM's incremental detokenization in a leading
space (SentencePiece tokenizers); reward functions read the standalone decode, which is stable on both sides.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from asyncrl.common.wire.messages import RolloutGroup


def decode_responses(tokenizer: Any, token_ids: list[list[int]]) -> list[str]:
    """The text of each response: the one decode every side uses (an actor's text, what reward functions read)."""
    return list(tokenizer.batch_decode(token_ids, skip_special_tokens=True))


class ResponseTexts:
    """Decodes the responses of rollout groups with the run's tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, model_path: str | Path) -> ResponseTexts:
        """From the tokenizer files in the model folder (``model.path``); nothing is fetched from a hub."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(model_path)))

    def decode(self, group: RolloutGroup) -> list[str]:
        """The text of each response of ``group``, decoded from its token ids."""
        return decode_responses(self.tokenizer, [group.response(i)[0].tolist() for i in range(group.num_samples)])

    def rewrite(self, group: RolloutGroup) -> tuple[RolloutGroup, int]:
        """``group`` with its texts replaced by the decode of its token ids, and how many texts that changed."""
        decoded = self.decode(group)
        changed = sum(a != b for a, b in zip(decoded, group.texts, strict=True))
        return (dataclasses.replace(group, texts=decoded) if changed else group), changed

    def mismatch(self, group: RolloutGroup) -> str | None:
        """Why ``group``'s texts are not the decode of its token ids, or None when every one is."""
        for i, (decoded, text) in enumerate(zip(self.decode(group), group.texts, strict=True)):
            if decoded != text:
                return f"the text of response {i} is not the decode of its token ids (scored text differs from trained)"
        return None
