"""Prompt sources: determinism by seed, the alphabet, formats, countdown solvability, data files, the registry."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from asyncrl.common.config import TaskSection
from asyncrl.common.data import tasks
from asyncrl.common.data.file_task import FileTask
from asyncrl.common.data.prompts import Prompter
from asyncrl.common.data.task_files import TaskFileError
from asyncrl.common.data.tasks import (
    TASK_ALPHABET,
    Task,
    TaskExample,
    get_task,
    outside_alphabet,
    register_task,
    task_names,
)
from asyncrl.common.rewards.verifiers import get_verifier
from asyncrl.common.tiny_models.character import build_char_tokenizer

GENERATED = ["arithmetic", "reverse", "copy", "count", "countdown"]


def char_prompter() -> Prompter:
    """The tiny model's prompter: its character tokenizer, no chat template."""
    return Prompter.for_tokenizer(build_char_tokenizer(TASK_ALPHABET), TaskSection())


def draw(task: Task, seed: int, n: int = 50) -> list[TaskExample]:
    rng = random.Random(seed)
    return [task.sample(rng) for _ in range(n)]


def write_rows(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    return write_rows(tmp_path / "data.jsonl", [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(5)])


def test_every_registered_task_is_covered_here() -> None:
    """Here, or in tests/unit/common/data/test_gyms.py for the adapters."""
    assert task_names() == sorted([*GENERATED, "file", "reasoning_gym", "textarena"])


@pytest.mark.parametrize("name", GENERATED)
def test_same_seed_same_examples_other_seed_others(name: str) -> None:
    assert draw(get_task(name), seed=1) == draw(get_task(name), seed=1)
    assert draw(get_task(name), seed=1) != draw(get_task(name), seed=2)


@pytest.mark.parametrize("name", [*GENERATED, "file"])
def test_prompts_and_answers_use_only_the_task_alphabet(name: str, tmp_path: Path) -> None:
    if name == "file":  # a file written by every generator, read back
        rows = [json.loads(line) for n in GENERATED for line in get_task(n).write_jsonl(tmp_path / n, 100, 0).open()]
        task = get_task("file", path=str(write_rows(tmp_path / "all.jsonl", rows)))
    else:
        task = get_task(name)
    for example in draw(task, seed=0, n=500):
        assert example.prompt and example.answer
        assert outside_alphabet(example.prompt + example.answer) == set(), example


def test_alphabet_has_each_character_once_and_the_specified_ones() -> None:
    assert len(set(TASK_ALPHABET)) == len(TASK_ALPHABET)
    assert set(TASK_ALPHABET) == set("0123456789abcdefghijklmnopqrstuvwxyz") | set('+-*/=()<>:,{}[]" \n')
    assert outside_alphabet("ab C£") == {"C", "£"}


def test_arithmetic_answers_are_the_computed_integers() -> None:
    for example in draw(get_task("arithmetic", ops="+-*", max_digits=2), seed=3, n=300):
        a, op, b = re.fullmatch(r"(\d{1,2})([+*-])(\d{1,2})=", example.prompt).groups()
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert example.answer == str(expected)


def test_arithmetic_options_choose_ops_and_digits() -> None:
    prompts = [e.prompt for e in draw(get_task("arithmetic", ops="-", max_digits=1), seed=0, n=100)]
    assert all(re.fullmatch(r"\d-\d=", p) for p in prompts)
    with pytest.raises(ValueError, match="ops"):
        get_task("arithmetic", ops="/")
    with pytest.raises(ValueError, match="max_digits"):
        get_task("arithmetic", max_digits=0)


def test_reverse_answer_is_the_reversed_string_within_the_length_bounds() -> None:
    for example in draw(get_task("reverse", min_length=2, max_length=4), seed=0, n=200):
        text = re.fullmatch(r"rev:([a-z]+)=", example.prompt).group(1)
        assert 2 <= len(text) <= 4 and example.answer == text[::-1]
    assert get_task("reverse").sample(random.Random(0)).answer  # defaults work


def test_reverse_with_a_tail_draws_mostly_short_strings_and_a_few_that_hold_much_of_the_letters() -> None:
    lengths = sorted(len(e.answer) for e in draw(get_task("reverse", min_length=2, max_length=96, tail=1), 0, 4000))
    assert lengths[0] >= 2 and lengths[-1] == 96
    assert 0.55 < sum(n <= 4 for n in lengths) / len(lengths) < 0.65  # P(L <= 4) = 1 - 2/5
    longest = lengths[int(0.9 * len(lengths)) :]
    assert sum(longest) > 0.5 * sum(lengths)  # the longest tenth holds over half the letters
    with pytest.raises(ValueError, match="tail must be 0"):
        get_task("reverse", tail=-1)
    with pytest.raises(ValueError, match="task 'copy': tail must be 0"):
        get_task("copy", tail=0.01)
    heavy = draw(get_task("copy", min_length=1, max_length=256, tail=0.1), 1, 2000)  # the heaviest tail allowed
    assert max(len(e.answer) for e in heavy) == 256 and min(len(e.answer) for e in heavy) >= 1


def test_copy_answers_with_the_letters_themselves_drawn_as_reverse_draws_them() -> None:
    pairs = zip(draw(get_task("copy", tail=1), 3, 100), draw(get_task("reverse", tail=1), 3, 100), strict=True)
    for copied, reversed_ in pairs:
        assert copied.prompt == "cp:" + copied.answer + "=" and copied.answer == reversed_.answer[::-1]


def test_count_answers_count_two_digit_numbers_from_the_first_to_the_second_with_a_heavy_tail() -> None:
    examples = draw(get_task("count", min_length=1, max_length=32, tail=1), 0, 4000)
    for example in examples:
        first, last = map(int, re.fullmatch(r"ct:(\d\d),(\d\d)=", example.prompt).groups())
        assert 10 <= first <= last <= 99 and example.answer == " ".join(str(n) for n in range(first, last + 1))
        assert outside_alphabet(example.prompt + example.answer) == set()
        assert get_verifier("count")(example.answer, example.answer) == 1.0
    counts = sorted(len(e.answer.split()) for e in examples)
    assert counts[0] == 1 and counts[-1] == 32 and 0.45 < sum(n == 1 for n in counts) / len(counts) < 0.55
    characters = sorted((len(e.answer) for e in examples), reverse=True)
    assert sum(characters[: len(characters) // 10]) > 0.5 * sum(characters)  # the longest tenth: over half
    assert get_verifier("count")("10 11 13", "10 11 12") == 0.0
    with pytest.raises(ValueError, match="task 'count': max_length"):
        get_task("count", max_length=91)


def test_countdown_prompt_matches_its_answer_and_the_generated_solution_scores_one() -> None:
    verify = get_verifier("countdown")
    for example in draw(get_task("countdown", count=4, max_number=12), seed=5, n=300):
        answer = json.loads(example.answer)
        numbers, target = answer["numbers"], answer["target"]
        assert example.prompt == f"cd:{','.join(map(str, numbers))}>{target}="
        assert len(numbers) == 4 and all(1 <= n <= 12 for n in numbers) and target >= 1
        assert verify(answer["solution"], example.answer) == 1.0, example


def test_first_examples_of_seed_zero_are_pinned() -> None:
    # Pins the formats and the generators' random streams: a change here changes every data set written
    # with a seed, so it should be deliberate. Hand check: 49*97 = 4753; "tkgnku" reversed is "ukngkt";
    # (1*7)/7 = 1 uses 1, 7 and 7 once each.
    assert [get_task(name).sample(random.Random(0)) for name in GENERATED] == [
        TaskExample("49*97=", "4753"),
        TaskExample("rev:tkgnku=", "ukngkt"),
        TaskExample("cp:tkgnku=", "tkgnku"),
        TaskExample("ct:63,87=", " ".join(map(str, range(63, 88)))),
        TaskExample("cd:7,7,1>1=", '{"numbers": [7, 7, 1], "target": 1, "solution": "(1*7)/7"}'),
    ]


@pytest.mark.parametrize("name", GENERATED)
def test_write_jsonl_writes_n_rows_deterministically(name: str, tmp_path: Path) -> None:
    task = get_task(name)
    first = task.write_jsonl(tmp_path / "a" / "one.jsonl", 20, seed=4)
    second = task.write_jsonl(tmp_path / "two.jsonl", 20, seed=4)
    assert first.read_bytes() == second.read_bytes()
    rows = [TaskExample(**json.loads(line)) for line in first.read_text().splitlines()]
    assert rows == draw(task, seed=4, n=20)


def test_file_task_cycles_through_every_row_once_per_pass_in_seeded_order(data_file: Path) -> None:
    task = get_task("file", path=str(data_file))
    assert isinstance(task, FileTask)
    rng = random.Random(0)
    passes = [[task.sample(rng).answer for _ in range(5)] for _ in range(3)]
    assert all(sorted(p) == ["0", "1", "2", "3", "4"] for p in passes)
    assert passes[0] != passes[1] or passes[1] != passes[2]  # reshuffled each pass (5! orders)
    again = [example.answer for example in draw(FileTask(data_file), seed=0, n=15)]
    assert again == passes[0] + passes[1] + passes[2]


def test_file_task_write_jsonl_does_not_depend_on_what_it_served_before(data_file: Path, tmp_path: Path) -> None:
    task = FileTask(data_file)
    before = task.write_jsonl(tmp_path / "before.jsonl", 7, seed=1).read_text()
    draw(task, seed=9, n=3)  # moves the task's own position
    assert task.write_jsonl(tmp_path / "after.jsonl", 7, seed=1).read_text() == before


def test_file_task_missing_field_names_file_and_line(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}])
    with pytest.raises(TaskFileError, match=re.escape(f"{path}:line 2: missing field 'answer'")):
        get_task("file", path=str(path))


def test_file_task_other_bad_rows_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1=", "answer": "1"}\n\n{not json\n')
    with pytest.raises(TaskFileError, match=re.escape(f"{path}:line 3: not valid JSON")):
        FileTask(path)
    write_rows(path, [{"prompt": "Hello=", "answer": "1"}])
    task = FileTask(path)  # the characters are checked against the run's tokenizer, once it is known
    assert task.examples == [TaskExample("Hello=", "1")]
    with pytest.raises(
        TaskFileError, match=re.escape(f"{path}:line 1: characters the model's tokenizer cannot encode")
    ):
        task.fit(char_prompter(), 100)  # the tiny model's tokenizer has no 'H'
    write_rows(path, [])
    with pytest.raises(TaskFileError, match="no examples"):
        FileTask(path)
    with pytest.raises(TaskFileError, match="no such file"):
        FileTask(tmp_path / "missing.jsonl")


def test_file_task_stores_structured_answers_as_json(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "cd.jsonl", [{"prompt": "cd:3,4>7=", "answer": {"numbers": [3, 4], "target": 7}}])
    (example,) = FileTask(path).examples
    assert json.loads(example.answer) == {"numbers": [3, 4], "target": 7}
    assert get_verifier("countdown")("3+4", example.answer) == 1.0


def test_parquet_file_task(tmp_path: Path) -> None:
    path = tmp_path / "data.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        path.write_bytes(b"PAR1")
        with pytest.raises(TaskFileError, match="needs the 'pyarrow' package"):
            FileTask(path)
        return
    pq.write_table(pa.table({"prompt": ["1+2=", "2+2="], "answer": ["3", None]}), path)
    with pytest.raises(TaskFileError, match=re.escape(f"{path}:row 2: field 'answer' is null")):  # a null cell
        FileTask(path)


def test_registry_refuses_a_second_class_under_a_taken_name() -> None:
    with tasks.TASKS.snapshot():  # registrations here are undone afterwards

        class Other(Task):
            def sample(self, rng: random.Random) -> TaskExample:
                return TaskExample("1=", "1")

        with pytest.raises(ValueError, match="'arithmetic' already registered by ArithmeticTask"):
            register_task("arithmetic")(Other)
        assert register_task("other")(Other) is Other and Other.name == "other"
        assert register_task("other")(Other) is Other  # the same class again is fine (a module reload)
        assert get_task("other").sample(random.Random(0)) == TaskExample("1=", "1")


def test_get_task_rejects_unknown_names_and_options() -> None:
    with pytest.raises(ValueError, match="unknown task 'nope'; registered: arithmetic, copy, count, countdown"):
        get_task("nope")
    with pytest.raises(ValueError, match="task 'reverse': bad options"):
        get_task("reverse", max_digits=3)


def test_file_task_refuses_empty_and_non_utf8_prompts_naming_the_row(tmp_path: Path) -> None:
    """Bad prompts are refused when the file is loaded, with the file, the row and the reason."""
    path = tmp_path / "bad.jsonl"
    write_rows(path, [{"prompt": "1+1=", "answer": "2"}, {"prompt": " \n", "answer": "2"}])
    with pytest.raises(TaskFileError, match=re.escape(f"{path}:line 2: field 'prompt' is empty")):
        FileTask(path)
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+\xff=", "answer": "4"}\n')
    with pytest.raises(TaskFileError, match=re.escape(f"{path}:line 2: not valid UTF-8 (byte 15: invalid start byte)")):
        FileTask(path)
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+\\udc80=", "answer": "4"}\n')  # valid JSON
    with pytest.raises(
        TaskFileError, match=re.escape(f"{path}:line 3: field 'prompt' is not valid UTF-8 (character 3")
    ):
        FileTask(path)  # refused whatever the tokenizer


def test_parquet_file_task_names_a_row_that_is_not_utf8(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    raw = pa.array([b"1+1=", b"2+\xff="])
    not_utf8 = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())  # a string column holding a bad byte
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": not_utf8, "answer": ["2", "4"]}), path)
    with pytest.raises(TaskFileError, match=re.escape(f"{path}:row 2: not valid UTF-8")):
        FileTask(path)
    path.write_bytes(b"PAR1 is not enough")
    with pytest.raises(TaskFileError, match=re.escape(f"{path}: not a readable Parquet file")):
        FileTask(path)


def test_file_task_refuses_a_prompt_longer_than_the_run_can_serve(tmp_path: Path) -> None:
    path = write_rows(
        tmp_path / "long.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "9" * 60 + "=", "answer": "9"}]
    )

    def encode(text: str) -> list[int]:  # the tiny model's tokenizer: BOS, then one token per character
        return [1] + [4] * len(text)

    FileTask(path).fit(Prompter(encode=encode), 62, "refuse")  # 1 + 61 tokens: fits exactly
    with pytest.raises(
        TaskFileError, match=re.escape(f"{path}:line 2: prompt is 62 tokens; the run can serve at most 61")
    ):
        FileTask(path).fit(Prompter(encode=encode), 61, "refuse")
    get_task("arithmetic").fit(Prompter(encode=encode), 1, "refuse")  # a generated task has nothing to refuse
