"""Preference files for DPO: errors that name the line and field, tokenizing, the pair layout, synthetic pairs."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from asyncrl.common.data.tasks import TASK_ALPHABET, get_task
from asyncrl.common.tiny_models.character import build_char_tokenizer
from asyncrl.learner.intake.preferences import (
    EncodedPair,
    PreferenceFileError,
    PreferencePair,
    collate_pairs,
    encode_pairs,
    read_preferences,
    write_synthetic_preferences,
)

GOOD = '{"prompt": "1+2=", "chosen": "3", "rejected": "4"}'
BOS, EOS, PAD = 1, 2, 0  # the tiny tokenizer's special ids


def write(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_reads_pairs_and_skips_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path / "p.jsonl", GOOD, "", '{"prompt": "a", "chosen": "b", "rejected": "c", "extra": 1}')
    assert read_preferences(path) == [PreferencePair("1+2=", "3", "4"), PreferencePair("a", "b", "c")]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", ":line 2: not valid JSON"),
        ('["1+2=", "3", "4"]', ":line 2: expected an object with prompt, chosen, rejected, got list"),
        ('{"prompt": "1+2=", "chosen": "3"}', ":line 2: missing field 'rejected'"),
        ('{"prompt": "1+2=", "chosen": null, "rejected": "4"}', ":line 2: missing field 'chosen'"),
        ('{"prompt": "1+2=", "chosen": 3, "rejected": "4"}', ":line 2: field 'chosen' must be a string, got int"),
        ('{"prompt": ["1+2="], "chosen": "3", "rejected": "4"}', ":line 2: field 'prompt' must be a string, got list"),
    ],
)
def test_malformed_rows_name_the_line_and_field(tmp_path: Path, bad_line: str, message: str) -> None:
    path = write(tmp_path / "p.jsonl", GOOD, bad_line, GOOD)
    with pytest.raises(PreferenceFileError) as err:
        read_preferences(path)
    assert f"{path}{message}" in str(err.value)


def test_missing_empty_and_parquet_files_are_explained(tmp_path: Path) -> None:
    with pytest.raises(PreferenceFileError, match="no such file"):
        read_preferences(tmp_path / "nope.jsonl")
    with pytest.raises(PreferenceFileError, match="no preference pairs"):
        read_preferences(write(tmp_path / "empty.jsonl", ""))
    if importlib.util.find_spec("pyarrow") is None:
        with pytest.raises(PreferenceFileError, match="pyarrow"):
            read_preferences(write(tmp_path / "p.parquet", ""))


def test_parquet_rows_are_read_when_pyarrow_is_installed(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    table = pa.table({"prompt": ["1+2=", "2+2="], "chosen": ["3", "4"], "rejected": ["4", None]})
    pq.write_table(table, tmp_path / "p.parquet")
    with pytest.raises(PreferenceFileError, match=r"p.parquet:row 2: missing field 'rejected'"):
        read_preferences(tmp_path / "p.parquet")


def test_collate_puts_chosen_and_rejected_in_adjacent_rows() -> None:
    pairs = [EncodedPair((1, 10), (20, 2), (30, 31, 2)), EncodedPair((1, 11, 12), (21,), (32, 2))]
    out = collate_pairs(pairs, pad_id=PAD)
    # row 2i = prompt + chosen, row 2i + 1 = prompt + rejected; right-padded to the longest row (5 tokens)
    assert out["input_ids"].tolist() == [
        [1, 10, 20, 2, 0],
        [1, 10, 30, 31, 2],
        [1, 11, 12, 21, 0],
        [1, 11, 12, 32, 2],
    ]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # response tokens only: never the prompt, never padding
    assert out["response_mask"].tolist() == [
        [False, False, True, True, False],
        [False, False, True, True, True],
        [False, False, False, True, False],
        [False, False, False, True, True],
    ]
    assert out["input_ids"].dtype == torch.long and out["response_mask"].dtype == torch.bool
    with pytest.raises(ValueError, match="at least one pair"):
        collate_pairs([], pad_id=PAD)


def test_encode_adds_eos_and_truncates_responses_not_prompts() -> None:
    tokenizer = build_char_tokenizer(TASK_ALPHABET)
    ids = {c: tokenizer.convert_tokens_to_ids(c) for c in "12+=34"}
    pair = PreferencePair("1+2=", "3", "34")
    (full,) = encode_pairs([pair], tokenizer, max_length=64)
    assert full.prompt == (BOS, ids["1"], ids["+"], ids["2"], ids["="])  # <s> from the tokenizer
    assert full.chosen == (ids["3"], EOS) and full.rejected == (ids["3"], ids["4"], EOS)

    # max_length 7 leaves 2 response tokens: the rejected response loses its EOS, the prompt stays whole
    (cut,) = encode_pairs([pair], tokenizer, max_length=7)
    assert cut.prompt == full.prompt and cut.chosen == (ids["3"], EOS) and cut.rejected == (ids["3"], ids["4"])

    # a prompt that leaves no room for a response token is skipped, the others kept
    kept = encode_pairs([PreferencePair("1+2=1+2=", "3", "4"), pair], tokenizer, max_length=7)
    assert kept == [cut]


def test_synthetic_pairs_prefer_the_right_answer(tmp_path: Path) -> None:
    task = get_task("arithmetic", ops="+*", max_digits=2)
    path = write_synthetic_preferences(task, tmp_path / "a.jsonl", 50, seed=3)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 50
    for row in rows:
        left, op, right = re.fullmatch(r"(\d+)([+*])(\d+)=", row["prompt"]).groups()
        right_answer = int(left) + int(right) if op == "+" else int(left) * int(right)
        assert int(row["chosen"]) == right_answer and int(row["rejected"]) != right_answer
    assert write_synthetic_preferences(task, tmp_path / "b.jsonl", 50, seed=3).read_text() == path.read_text()
    assert read_preferences(path)[0] == PreferencePair(rows[0]["prompt"], rows[0]["chosen"], rows[0]["rejected"])

    reverse = write_synthetic_preferences(get_task("reverse"), tmp_path / "r.jsonl", 20, seed=0)
    for row in map(json.loads, reverse.read_text().splitlines()):
        text = row["prompt"].removeprefix("rev:").removesuffix("=")
        assert row["chosen"] == text[::-1] and row["rejected"] != row["chosen"]
        assert len(row["rejected"]) == len(row["chosen"])

    with pytest.raises(ValueError, match="no synthetic preferences for task 'countdown'"):
        write_synthetic_preferences(get_task("countdown"), tmp_path / "c.jsonl", 5, seed=0)
