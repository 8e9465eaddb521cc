"""Dataset files as users have them : JSONL, Parquet and ``save_to_disk`` folders, key mapping with dotted
paths, chat messages, ``extra`` fields for reward functions, split / limit / shuffle, and what a bad or over-long row
does — refused with its row named, or skipped and counted."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.common.config import ConfigError, RewardFunction, TaskSection, load_config
from asyncrl.common.data.file_task import FileTask
from asyncrl.common.data.prompts import Prompter, PromptError
from asyncrl.common.data.task_files import TaskFileError
from asyncrl.common.data.tasks import TASK_ALPHABET, TaskExample, get_task, prompt_group
from asyncrl.common.rewards.functions import score
from asyncrl.common.tiny_models.character import build_char_tokenizer
from asyncrl.common.tiny_models.chat import build_bpe_tokenizer
from asyncrl.common.wire.messages import Decoder, PromptGroup, RolloutGroup, encode
from asyncrl.common.wire.provenance import issue_mismatch
from asyncrl.learner.intake.dispatcher import task_options

VERL_ROWS = [  # the layout of verl's GSM8K Parquet files: chat messages, the answer nested, other fields beside
    {
        "data_source": "gsm8k",
        "prompt": [{"role": "user", "content": f"What is {i}+{i}? Think step by step."}],
        "ability": "math",
        "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
        "extra_info": {"index": i, "split": "train"},
    }
    for i in range(4)
]
VERL_KEYS = {"answer_key": "reward_model.ground_truth"}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def bpe() -> Prompter:
    """A chat model's prompter: byte-level BPE with a ChatML template."""
    return Prompter.for_tokenizer(build_bpe_tokenizer("qwen2", vocab_size=300), TaskSection())


def char_prompter() -> Prompter:
    return Prompter.for_tokenizer(build_char_tokenizer(TASK_ALPHABET), TaskSection())


def check_verl_rows(task: FileTask) -> None:
    assert [e.answer for e in task.examples] == ["0", "2", "4", "6"]
    first = task.examples[1]
    assert first.messages == ({"role": "user", "content": "What is 1+1? Think step by step."},)
    assert json.loads(first.extra) == {  # everything but the prompt and the answer's own leaf
        "data_source": "gsm8k",
        "ability": "math",
        "reward_model": {"style": "rule"},
        "extra_info": {"index": 1, "split": "train"},
    }


def test_jsonl_with_chat_messages_and_a_dotted_answer_key(tmp_path: Path) -> None:
    check_verl_rows(FileTask(write_jsonl(tmp_path / "verl.jsonl", VERL_ROWS), **VERL_KEYS))


def test_parquet_with_chat_messages_and_a_dotted_answer_key(tmp_path: Path) -> None:
    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), path)
    check_verl_rows(FileTask(path, **VERL_KEYS))


def test_a_save_to_disk_folder_is_read_without_the_datasets_package(tmp_path: Path) -> None:
    """Written by the real ``datasets`` library; read by ``common.data.task_files`` with pyarrow alone."""
    import datasets
    datasets.Dataset.from_list(VERL_ROWS).save_to_disk(str(tmp_path / "one"))
    check_verl_rows(FileTask(tmp_path / "one", **VERL_KEYS))
    test_rows = [{"question": "What is 9+9?", "answer": "18"}]
    train = datasets.Dataset.from_list([{"question": f"What is {i}+1?", "answer": str(i + 1)} for i in range(5)])
    datasets.DatasetDict({"train": train, "test": datasets.Dataset.from_list(test_rows)}).save_to_disk(
        str(tmp_path / "dict"),
        num_shards={"train": 2, "test": 1},  # two Arrow files in one split
    )
    task = FileTask(tmp_path / "dict", prompt_key="question", split="train")
    assert [e.prompt for e in task.examples] == [f"What is {i}+1?" for i in range(5)]
    assert FileTask(tmp_path / "dict", prompt_key="question", split="test").examples == [
        TaskExample("What is 9+9?", "18")
    ]
    with pytest.raises(TaskFileError, match=r"holds several splits: set task.split to one \(splits: train, test\)"):
        FileTask(tmp_path / "dict", prompt_key="question")
    with pytest.raises(TaskFileError, match="has no split 'validation'"):
        FileTask(tmp_path / "dict", prompt_key="question", split="validation")
    with pytest.raises(TaskFileError, match=re.escape("task.split is for a folder written by save_to_disk")):
        FileTask(write_jsonl(tmp_path / "a.jsonl", test_rows), prompt_key="question", split="train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskFileError, match="not one written by save_to_disk"):
        FileTask(tmp_path / "empty")


def test_bad_rows_are_refused_with_their_row_in_every_format(tmp_path: Path) -> None:
    import datasets
    rows = [dict(VERL_ROWS[0]), {**VERL_ROWS[1], "reward_model": {"style": "rule"}}]  # row 2: no ground truth
    jsonl = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TaskFileError, match=re.escape(f"{jsonl}:line 2: missing field 'reward_model.ground_truth'")):
        FileTask(jsonl, **VERL_KEYS)
    parquet = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    with pytest.raises(TaskFileError, match=re.escape(f"{parquet}:row 2: field 'reward_model.ground_truth' is null")):
        FileTask(parquet, **VERL_KEYS)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "bad"))
    null = "row 2: field 'reward_model.ground_truth' is null"  # a column store holds a missing field as null
    with pytest.raises(TaskFileError, match=re.escape(f"{tmp_path / 'bad'}:{null}")):
        FileTask(tmp_path / "bad", **VERL_KEYS)
    shapes = [
        ({"messages": [], "answer": "1"}, "field 'messages' is empty"),
        ({"messages": [{"role": "user", "content": " "}], "answer": "1"}, "field 'messages' is empty"),
        ({"messages": [{"role": "user"}], "answer": "1"}, "field 'messages'[0] is not a message"),
        ({"prompt": 7, "answer": "1"}, "field 'prompt' must be a string or a list of messages, got int"),
        ({"messages": [{"role": "user", "content": "2+\udc80"}], "answer": "1"}, "'messages[0].content' is not valid"),
        ({"prompt": "2+2=", "answer": None}, "field 'answer' is null"),  # there, but null: named as such
    ]
    for row, reason in shapes:
        path = write_jsonl(tmp_path / "shape.jsonl", [{"prompt": "1+1=", "answer": "2"}, row])
        with pytest.raises(TaskFileError, match=re.escape(f"{path}:line 2: ") + ".*" + re.escape(reason)):
            FileTask(path)


def test_a_chat_row_is_read_whatever_the_prompt_key_of_the_others(tmp_path: Path) -> None:
    """A file of ``question`` rows with some chat rows: each chat row's ``messages`` is its prompt."""
    rows = [{"question": "1+1=", "answer": "2"}, {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}]
    task = FileTask(write_jsonl(tmp_path / "mixed.jsonl", rows), prompt_key="question", shuffle=False)
    first, second = (task.sample(random.Random(0)) for _ in range(2))
    assert (first.prompt, first.messages) == ("1+1=", None)
    assert second.messages == ({"role": "user", "content": "2+2?"},) and second.answer == "4"


def test_limit_takes_the_first_rows_and_shuffle_false_serves_file_order(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"{i}=", "answer": str(i)} for i in range(6)])
    ordered = FileTask(path, limit=4, shuffle=False)
    rng = random.Random(0)
    assert [ordered.sample(rng).answer for _ in range(10)] == ["0", "1", "2", "3", "0", "1", "2", "3", "0", "1"]
    shuffled, rng = FileTask(path, limit=4), random.Random(0)
    passes = [[shuffled.sample(rng).answer for _ in range(4)] for _ in range(3)]
    assert all(sorted(p) == ["0", "1", "2", "3"] for p in passes) and passes != [["0", "1", "2", "3"]] * 3
    with pytest.raises(ValueError, match="limit must be >= 0"):
        FileTask(path, limit=-1)


def test_an_overlong_row_is_skipped_and_counted_or_refused_as_configured(
    tmp_path: Path, bpe: Prompter, caplog: pytest.LogCaptureFixture
) -> None:
    long = {
        "prompt": [{"role": "user", "content": "What is " + "9+" * 300 + "9?"}],
        "reward_model": {"ground_truth": "2709"},
    }
    rows = [*VERL_ROWS[:2], long, VERL_ROWS[2]]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    task = FileTask(path, **VERL_KEYS)
    limit = 100
    assert len(bpe.encode(bpe.text(task.examples[2]))) > limit >= len(bpe.encode(bpe.text(task.examples[0])))
    with caplog.at_level(logging.WARNING, logger="asyncrl.tasks"):
        task.fit(bpe, limit, "skip")
    assert task.skipped == [f"{path}:line 3"] and [e.answer for e in task.examples] == ["0", "2", "4"]
    named = [r.getMessage() for r in caplog.records if "skipped a row" in r.getMessage()]
    assert len(named) == 1 and f'row="{path}:line 3"' in named[0], named
    rng = random.Random(0)
    assert "2709" not in {task.sample(rng).answer for _ in range(12)}  # never served: it never reaches vLLM
    with pytest.raises(TaskFileError, match=re.escape(f"{path}:line 3: prompt is")):
        FileTask(path, **VERL_KEYS).fit(bpe, limit, "refuse")
    with pytest.raises(TaskFileError, match="every row's prompt is longer"):
        FileTask(path, **VERL_KEYS).fit(bpe, 5, "skip")


def test_characters_are_refused_only_where_the_tokenizer_cannot_encode_them(tmp_path: Path, bpe: Prompter) -> None:
    """TASK_ALPHABET binds the tiny character model only; a BPE model takes '?' and accented letters."""
    path = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "Wie viel ist 3+4? Déjà vu", "answer": "7"}])
    FileTask(path).fit(bpe, 100)
    with pytest.raises(TaskFileError, match=re.escape(f"{path}:line 1: characters the model's tokenizer cannot")):
        FileTask(path).fit(char_prompter(), 100)


def test_chat_prompts_use_the_template_and_the_system_prompt(tmp_path: Path) -> None:
    tokenizer = build_bpe_tokenizer("llama", vocab_size=300)
    prompter = Prompter.for_tokenizer(tokenizer, TaskSection(system_prompt="Answer with a number."))
    plain = prompter.text(TaskExample("What is 1+1?", "2"))
    assert plain == (
        "<s><|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nWhat is 1+1?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = prompter.encode(plain)
    assert ids.count(tokenizer.bos_token_id) == 1  # the template's BOS; the tokenizer adds none to it
    assert tokenizer(plain)["input_ids"].count(tokenizer.bos_token_id) == 2  # what add_special_tokens=True would do
    own = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"})
    assert prompter.text(TaskExample("", "4", own)).count("system") == 1  # a row's own system message is kept
    off = Prompter.for_tokenizer(tokenizer, TaskSection(chat=False))
    assert off.text(TaskExample("What is 1+1?", "2")) == "What is 1+1?" and off.encode("x")[0] == tokenizer.bos_token_id
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": list(own), "answer": "4"}])
    with pytest.raises(TaskFileError, match=re.escape(f"{path}:line 1: holds 'messages', but the run uses no chat")):
        FileTask(path).fit(off, 100)
    char = build_char_tokenizer(TASK_ALPHABET)
    assert not Prompter.for_tokenizer(char, TaskSection()).chat  # the tiny model: auto = no template
    with pytest.raises(PromptError, match=re.escape("task.chat = true, but the tokenizer of model.path has no chat")):
        Prompter.for_tokenizer(char, TaskSection(chat=True))
    with pytest.raises(PromptError, match=re.escape("task.system_prompt is set, but the run does not use a chat")):
        Prompter.for_tokenizer(char, TaskSection(system_prompt="Hi"))


def test_file_settings_come_from_the_task_section() -> None:
    section = load_config(
        None, ["task.name=file", "task.path=d.jsonl", "task.answer_key=reward_model.ground_truth", "task.limit=5"]
    ).task
    assert task_options(section) == {
        "path": "d.jsonl",
        "prompt_key": "prompt",
        "answer_key": "reward_model.ground_truth",
        "split": "",
        "limit": 5,
        "shuffle": True,
    }
    assert section.overlong == "skip" and section.chat == "auto"
    with pytest.raises(ValueError, match=re.escape("set task.limit, not task.options.limit")):
        task_options(section.model_copy(update={"options": {"limit": 3}}))
    with pytest.raises(ConfigError, match='shuffle is a setting of data files: it needs name = "file"'):
        load_config(None, ["task.shuffle=false"])
    with pytest.raises(ConfigError, match=re.escape("task.overlong")):
        load_config(None, ["task.name=file", "task.overlong=truncate"])
    assert load_config(None, ["task.chat=false"]).task.chat is False


def extra_keys(group: RolloutGroup, options: dict) -> list[float]:
    """A user's reward function (named by import path): reads the row's other fields."""
    return [float(group.extra_fields()["extra_info"]["index"]) for _ in group.texts]


def test_a_rows_other_fields_reach_the_reward_functions_as_extra(tmp_path: Path) -> None:
    task = FileTask(write_jsonl(tmp_path / "verl.jsonl", VERL_ROWS), **VERL_KEYS)
    group = prompt_group("g1", "file", task.examples[3], lambda text: [1, 2, 3], num_samples=2)
    assert Decoder(PromptGroup).decode(encode(group)).extra == task.examples[3].extra
    rollout = RolloutGroup(
        group_id="g1", task="file", prompt=group.prompt, prompt_ids=group.prompt_ids, answer=group.answer,
        token_ids=np.array([4, 5], np.int32), logprobs=np.zeros(2, np.float32), versions=np.zeros(2, np.int32),
        lengths=np.array([1, 1], np.int32), texts=["6", "7"], finish_reasons=["stop", "stop"], extra=group.extra,
    )  # fmt: skip
    received = Decoder(RolloutGroup).decode(encode(rollout))
    assert score(RewardFunction(name=f"{__name__}:extra_keys"), received) == [3.0, 3.0]
    assert issue_mismatch(group, received, 8) is None
    forged = RolloutGroup(**{**received.__dict__, "extra": '{"extra_info": {"index": 0}}'})
    assert issue_mismatch(group, forged, 8) == "its extra differs from the one issued"
    assert get_task("arithmetic").sample(random.Random(0)).extra == ""  # a generated task has none


def test_extra_is_appended_to_the_wire_format(tmp_path: Path) -> None:
    """A message from a peer that predates ``extra`` (one field fewer) still decodes, with extra = ''."""
    import msgpack

    group = PromptGroup(group_id="g", task="t", prompt="p", prompt_ids=np.array([1], np.int32), extra='{"a": 1}')
    header, *frames = encode(group)
    version, tag, body = msgpack.unpackb(header, raw=False, ext_hook=lambda code, data: msgpack.ExtType(code, data))
    fields = [f.name for f in dataclasses.fields(PromptGroup)]
    old = msgpack.packb([version, tag, body[: fields.index("extra")]], use_bin_type=True)
    assert Decoder(PromptGroup).decode([old, *frames]).extra == ""
    # appended after the fields a peer that predates it knows, before those appended after it (eval, loss mask, ...)
    assert fields[fields.index("issued_at") + 1 :][:2] == ["extra", "purpose"]
    rollout_fields = [f.name for f in dataclasses.fields(RolloutGroup)]
    appended = ["extra", "purpose", "loss_mask", "attestations", "row_starts"]
    assert rollout_fields[rollout_fields.index("timings") + 1 :] == appended


def test_a_file_without_line_ends_is_refused_having_read_only_the_longest_line(tmp_path: Path) -> None:
    """``/dev/zero`` never ends: the reader stops at MAX_LINE_BYTES and names the line."""
    with pytest.raises(TaskFileError, match=r"^/dev/zero:line 1: longer than 64 MiB without a line end"):
        FileTask("/dev/zero")


def test_a_row_nested_too_deep_is_refused_naming_its_line(tmp_path: Path) -> None:
    deep = tmp_path / "deep.jsonl"
    deep.write_text(
        '{"prompt": "p", "answer": "a"}\n{"prompt": "p", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    )
    with pytest.raises(TaskFileError, match=rf"^{re.escape(str(deep))}:line 2: nested more than 64 levels deep$"):
        FileTask(deep)
    shallower = tmp_path / "shallower.jsonl"  # parses within the stack, refused all the same
    shallower.write_text('{"prompt": "p", "answer": "a", "x": ' + "[" * 100 + "]" * 100 + "}\n")
    with pytest.raises(TaskFileError, match=r"shallower\.jsonl:line 1: nested more than 64 levels deep"):
        FileTask(shallower)


def test_a_table_row_nested_too_deep_is_refused_naming_its_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parquet's own schema limit (100 levels) stops the deepest rows first; this bound is checked all the same."""
    monkeypatch.setattr("asyncrl.common.data.task_files.MAX_ROW_DEPTH", 8)
    table = tmp_path / "deep.parquet"
    nested: object = "leaf"
    for _ in range(10):
        nested = [nested]
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "p", "answer": "a", "x": nested}, {"prompt": "p", "answer": "a", "x": None}]),
        table,
    )
    with pytest.raises(TaskFileError, match=r"deep\.parquet:row 1: nested more than 8 levels deep"):
        FileTask(table)


def test_a_number_longer_than_python_converts_is_refused_naming_its_line(tmp_path: Path) -> None:
    huge = write_jsonl(tmp_path / "huge.jsonl", [{"prompt": "p", "answer": "a"}])
    with huge.open("a") as f:
        f.write('{"prompt": "p", "answer": ' + "9" * 100_001 + "}\n")
    with pytest.raises(TaskFileError, match=r"huge\.jsonl:line 2: a number of over 4300 digits; write it as a string"):
        FileTask(huge)


def test_an_oversized_save_to_disk_index_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    folder.mkdir()
    with (folder / "state.json").open("wb") as f:
        f.truncate(17 * 2**20)  # sparse: 17 MiB of zeros
    with pytest.raises(TaskFileError, match=r"state\.json: over 16 MiB"):
        FileTask(folder)


def test_check_data_reads_hostile_jsonl_as_the_run_does_naming_each_row(tmp_path: Path) -> None:
    """``rl-learner check-data`` keeps reading past a bad row (it reports them all) but refuses each as the run would:
    a row nested too deep and a 100,001-digit number are named, and a file with no line end stops the read."""
    from asyncrl.cli.data_check import file_rows

    rows = tmp_path / "rows.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    rows.write_text(f'{{"q": "1+1=", "a": "2"}}\n{{"q": {deep}}}\n{{"q": {"9" * 100_001}}}\n{{"q": "2", "a": "4"}}\n')
    good, bad = file_rows(rows)
    assert [where for where, _ in good] == ["line 1", "line 4"]
    assert [where for where, _ in bad] == ["line 2", "line 3"]
    assert "nested more than" in bad[0][1] and "digits" in bad[1][1]
    endless = tmp_path / "endless.jsonl"
    with endless.open("wb") as f:  # /dev/zero, cut: a line longer than the limit without an end
        f.truncate(65 * 2**20)
    assert file_rows(endless) == ([], [("file", file_rows(endless)[1][0][1])])
    assert "without a line end" in file_rows(endless)[1][0][1]
