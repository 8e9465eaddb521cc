"""``rl-learner check-data``: a data file with planted problems, each reported with its row number, under the tiny
character model (which has an unknown token) and a chat model (byte-level BPE, ChatML template); JSONL and Parquet;
exit codes 0 (warnings only), 1 (the run would refuse the file, or a verifier raises on a reference answer), 2
(a config error). Every reason given is the one the run gives for that row alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from asyncrl.cli.data_check import check_file, run_verifiers
from asyncrl.cli.learner import app
from asyncrl.common.config import RunConfig, TaskSection
from asyncrl.common.data.file_task import FileTask
from asyncrl.common.data.prompts import Prompter
from asyncrl.common.data.task_files import TaskFileError
from asyncrl.common.tiny_models.chat import init_chat_model

BIN = Path(sys.executable).parent
GSM8K_ANSWER = "She sold 48/2 = <<48/2=24>>24 clips in May.\nIn all 48+24 = <<48+24=72>>72 clips.\n#### 72"
UNTEMPLATED = "holds 'messages', but the run uses no chat template"


def line(row: dict) -> bytes:
    return json.dumps(row).encode()  # ASCII JSON: "\ud800" stays an escape, as a user's file may hold it


PLANTED = [  # line number: (the line, what check-data says of it; None = nothing)
    (line({"prompt": "1+1=", "answer": "2"}), None),
    (line({"prompt": "  ", "answer": "3"}), "line 2: field 'prompt' is empty"),
    (b'{"prompt": "2+2=\xff", "answer": "4"}', "line 3: not valid UTF-8 (byte 17: invalid start byte)"),
    (line({"prompt": "3+3="}), "line 4: missing field 'answer'"),
    (line({"prompt": "1+1=", "answer": "2"}), "line 1: repeated at line 5"),
    (line({"prompt": "4+4=", "answer": ""}), "line 6: raises ValueError: math answer has no final answer: ''"),
    (line({"prompt": "9" * 60 + "=", "answer": "9"}), "line 7: 62 tokens"),  # BOS + 61 characters > 64 - 8
    (
        line({"prompt": "what?=", "answer": "5"}),
        "line 8: characters the model's tokenizer cannot encode (it has no token for them): '?'",
    ),
    (line({"prompt": "5+5=", "answer": "ten"}), "line 9: scores 0"),  # math finds no number in "ten"
    (b'{"prompt": "6+6=", ', "line 10: not valid JSON (Expecting property name enclosed in double quotes)"),
    (b"", None),  # a blank line is no row
    (
        line({"prompt": "7+7=\ud800", "answer": "14"}),
        "line 12: field 'prompt' is not valid UTF-8 (character 5: surrogates not allowed)",
    ),
    (line({"messages": [{"role": "user", "content": "8+8="}], "answer": "16"}), f"line 13: {UNTEMPLATED}"),
    (line({"prompt": "6+6=", "answer": "12"}), None),
]
REFUSED = ["line 2", "line 3", "line 4", "line 8", "line 10", "line 12", "line 13"]


def write_planted(path: Path) -> Path:
    path.write_bytes(b"\n".join(text for text, _ in PLANTED) + b"\n")
    return path


def settings(model: Path, data: Path, *extra: str, verifier: str = "math") -> list[str]:
    """``--set`` arguments of a run on ``data`` under ``model``: 64 - 8 = 56 prompt tokens at most."""
    fields = [
        f"model.path={json.dumps(str(model))}",
        "model.max_model_len=64",
        "rollout.max_new_tokens=8",
        "task.name=file",
        f"task.path={json.dumps(str(data))}",
        f'task.options={{verifier="{verifier}"}}',
        *extra,
    ]
    return [arg for field in fields for arg in ("--set", field)]


def check(*args: str) -> tuple[int, str, str]:
    """``rl-learner check-data ARGS`` in this process: (exit status, stdout, stderr)."""
    result = CliRunner().invoke(app, ["check-data", *args])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 chat model: byte-level BPE (no unknown token), ChatML template, random weights."""
    return init_chat_model(tmp_path_factory.mktemp("chat") / "model", "qwen2", seed=0)


def test_every_planted_problem_is_reported_with_its_row(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The real console script on the tiny character model: each planted problem named by its line, exit 1."""
    data = write_planted(tmp_path / "planted.jsonl")
    args = [str(BIN / "rl-learner"), "check-data", *settings(tiny_model_dir, data)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=180)
    assert result.returncode == 1, result.stdout + result.stderr
    report = result.stdout.splitlines()
    for _, said in PLANTED:
        if said is not None:
            assert any(shown.startswith(f"  {said}") for shown in report), said
    assert "rows: 13 read, 13 checked, 7 refused, 5 ready to serve" in report
    assert "unknown to the tokenizer: '?' (U+003F): 1" in report
    assert report[report.index("empty answers: 1") :][:2] == ["empty answers: 1", "  line 6"]
    assert "verifier self-check (math): 6 of 8 reference answers score 1.0" in report
    assert report[-1].startswith("exit 1: 7 rows refused") and "Traceback" not in result.stderr


def test_json_names_every_row_and_each_reason_is_the_runs(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = write_planted(tmp_path / "planted.jsonl")
    code, out, _ = check(*settings(tiny_model_dir, data), "--json")
    report = json.loads(out)
    assert code == 1 == report["exit"]
    assert [r["row"] for r in report["refused"]] == REFUSED
    assert report["rows"] == {"read": 13, "checked": 13, "refused": 7, "servable": 5}
    assert report["too_long"] == [{"row": "line 7", "tokens": 62}] and report["limit_tokens"] == 56
    assert report["duplicates"] == [{"rows": ["line 1", "line 5"], "same_answer": True}]
    assert report["empty_answers"] == ["line 6"]
    assert report["unknown_characters"] == [{"char": "?", "codepoint": "U+003F", "rows": ["line 8"]}]
    assert report["prompt_tokens"] == {"min": 5, "median": 5, "p95": 62, "max": 62}  # BOS + "1+1=" ... BOS + 61
    (self_check,) = report["self_check"]
    assert [r["row"] for r in self_check["below"]] == ["line 9"] and self_check["below"][0]["score"] == 0.0
    assert [r["row"] for r in self_check["raised"]] == ["line 6"]
    # The run, given each refused line alone, refuses it for the same reason.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompter = Prompter.for_tokenizer(tokenizer, TaskSection())
    lines = data.read_bytes().split(b"\n")
    for refused in report["refused"]:
        alone = tmp_path / "alone.jsonl"
        alone.write_bytes(lines[int(refused["row"].split()[1]) - 1] + b"\n")
        with pytest.raises(TaskFileError) as caught:
            FileTask(alone).fit(prompter, 56)
        assert str(caught.value) == f"{alone}:line 1: {refused['reason']}"


def test_limit_checks_the_first_rows_but_every_unparseable_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    """As the run: a line that does not parse refuses the file wherever it is; task.limit keeps the first rows."""
    data = write_planted(tmp_path / "planted.jsonl")
    report = json.loads(check(*settings(tiny_model_dir, data, "task.limit=2"), "--json")[1])
    assert [r["row"] for r in report["refused"]] == ["line 2", "line 3", "line 10"]
    assert report["rows"] == {"read": 13, "checked": 4, "refused": 3, "servable": 1}


def test_the_eval_file_is_checked_with_the_tasks_keys_unless_it_names_its_own(tmp_path: Path, tiny_model_dir) -> None:
    """A run whose ``[task]`` reads ``question`` rows evaluates on a file read the same way: check-data reads the eval
    file too, with the task's keys, and names its bad rows; ``[eval]`` keys of its own win."""
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4)))
    held_out = tmp_path / "heldout.jsonl"
    rows = [{"question": "2+2=", "answer": "4"}, {"question": "3+3="}, {"q": "1+2=", "answer": "3"}]
    held_out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    evaluation = ("eval.every=2", f"eval.path={json.dumps(str(held_out))}")
    run = settings(tiny_model_dir, train, "task.prompt_key=question", *evaluation)
    code, out, _ = check(*run)
    assert code == 1, out
    [task_part, eval_part] = out.split("\n\ncheck-data: ")
    assert task_part.startswith(f"check-data: {train}") and "exit 0" in task_part
    assert eval_part.startswith(str(held_out)) and "line 2: missing field 'answer'" in eval_part
    assert "line 3: missing field 'question'" in eval_part, eval_part
    report = json.loads(check(*run, "--json")[1])
    assert report["exit"] == 1 and [r["row"] for r in report["eval"]["refused"]] == ["line 2", "line 3"]
    own = json.loads(check(*run, "--set", "eval.prompt_key=q", "--json")[1])["eval"]  # the task's stays 'question'
    missing_q = "missing field 'q'"
    assert [(r["row"], r["reason"]) for r in own["refused"]] == [("line 1", missing_q), ("line 2", missing_q)]


def test_parquet_rows_are_named_by_row_number(tmp_path: Path, tiny_model_dir: Path) -> None:
    rows = [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": "", "answer": "3"},
        {"prompt": "3+3=", "answer": None},
        {"prompt": "1+1=", "answer": "5"},
        {"prompt": "4+4=", "answer": ""},
        {"prompt": "9" * 60 + "=", "answer": "9"},
        {"prompt": "what?=", "answer": "5"},
        {"prompt": "5+5=", "answer": "ten"},
    ]
    data = tmp_path / "planted.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    code, out, _ = check(*settings(tiny_model_dir, data), "--json")
    report = json.loads(out)
    assert code == 1
    assert {r["row"]: r["reason"] for r in report["refused"]} == {
        "row 2": "field 'prompt' is empty",
        "row 3": "field 'answer' is null",  # a column store holds a missing field as null
        "row 7": "characters the model's tokenizer cannot encode (it has no token for them): '?'",
    }
    assert report["duplicates"] == [{"rows": ["row 1", "row 4"], "same_answer": False}]
    assert report["too_long"] == [{"row": "row 6", "tokens": 62}] and report["empty_answers"] == ["row 5"]
    assert [r["row"] for r in report["self_check"][0]["below"]] == ["row 8"]
    assert "  row 1: repeated at row 4 (different answers)" in check(*settings(tiny_model_dir, data))[1]


def test_exit_status(tmp_path: Path, tiny_model_dir: Path) -> None:
    """0: clean, or warnings only (--strict: 1); 1: what the run refuses, or a verifier raising; 2: config errors."""
    clean = tmp_path / "clean.jsonl"
    clean.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(5)))
    code, out, _ = check(*settings(tiny_model_dir, clean))
    assert (code, out.splitlines()[-1]) == (0, "exit 0: 0 warning(s)")

    warned = tmp_path / "warned.jsonl"  # a duplicate, a row overlong = "skip" leaves out, a reference scoring 0
    rows = [("1+1=", "2"), ("1+1=", "2"), ("9" * 60 + "=", "9"), ("5+5=", "ten")]
    warned.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    code, out, _ = check(*settings(tiny_model_dir, warned))
    assert (code, out.splitlines()[-1]) == (0, "exit 0: 3 warning(s)")
    assert check(*settings(tiny_model_dir, warned), "--strict")[0] == 1
    code, out, _ = check(*settings(tiny_model_dir, warned, "task.overlong=refuse"))
    assert code == 1 and 'too long to serve, and task.overlong = "refuse"' in out.splitlines()[-1]

    raising = tmp_path / "raising.jsonl"  # math cannot find a final answer in the reference: a data bug
    raising.write_text(json.dumps({"prompt": "1+1=", "answer": "#### "}) + "\n")
    code, out, _ = check(*settings(tiny_model_dir, raising))
    assert code == 1 and "verifier 'math' raises on 1 reference answer(s)" in out.splitlines()[-1]

    for args, said in [
        (settings(tiny_model_dir, clean, "task.bogus=1"), "task.bogus"),
        (settings(tiny_model_dir, tmp_path / "none.jsonl"), "none.jsonl: no such file"),
        (settings(tmp_path / "no-model", clean), "cannot load its tokenizer"),
        (settings(tiny_model_dir, clean, verifier="nope"), "unknown verifier 'nope'"),
        (settings(tiny_model_dir, clean, "task.chat=true"), "no chat template"),
        (["--set", f"model.path={tiny_model_dir}", "--set", "task.options={max_digits=99}"], "max_digits"),
    ]:
        code, _, err = check(*args)
        assert code == 2 and said in err, (args, err)


def test_chat_model_prompts_are_templated_and_gsm8k_answers_verify(tmp_path: Path, chat_model_dir: Path) -> None:
    """Under a chat model the lengths are those of the chat template with the system prompt; a byte-level BPE has no
    unknown characters; math gives a GSM8K answer 1.0 (the number after ####), a bare LaTeX answer 0 (a response must
    box it) and raises on an answer with none."""
    rows = [
        {"messages": [{"role": "user", "content": "Natalia sold 48 clips in April, half as many in May. In all?"}]},
        {"prompt": "What is half of one? Café, déjà vu!"},
        {"messages": [{"role": "user", "content": " "}]},
        {"prompt": "How much is 2+2?"},
        {"prompt": "What is 1,000+234?"},
    ]
    answers = [GSM8K_ANSWER, "\\frac{1}{2}", "3", "#### ", "#### 1,234"]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row | {"answer": a}) + "\n" for row, a in zip(rows, answers, strict=True)))
    system = 'task.system_prompt="Answer after ####."'
    code, out, _ = check(*settings(chat_model_dir, data, "model.max_model_len=512", system), "--json")
    report = json.loads(out)
    assert code == 1 and report["chat"] is True
    assert report["refused"] == [{"row": "line 3", "reason": "field 'messages' is empty"}]
    assert report["unknown_characters"] == []
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    lengths = []
    for row in rows[:2] + rows[3:]:
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        chat = [{"role": "system", "content": "Answer after ####."}, *messages]
        lengths.append(len(tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]))
    assert report["prompt_tokens"]["min"] == min(lengths) and report["prompt_tokens"]["max"] == max(lengths)
    (self_check,) = report["self_check"]
    assert self_check["checked"] == 4 and self_check["passed"] == 2  # lines 1 and 5 (GSM8K); line 3 is refused first
    assert self_check["below"] == [{"row": "line 2", "score": 0.0}]
    assert [r["row"] for r in self_check["raised"]] == ["line 4"]

    report = json.loads(check(*settings(chat_model_dir, data, "task.chat=false"), "--json")[1])
    assert {r["row"]: r["reason"][: len(UNTEMPLATED)] for r in report["refused"]} == {
        "line 1": UNTEMPLATED,
        "line 3": "field 'messages' is empty",
    }


def verifier_config(data: Path, model: Path, verifier: str, **options: str) -> RunConfig:
    task_function = {"name": "task", "options": options}
    return RunConfig.model_validate(
        {
            "model": {"path": str(model)},
            "task": {"name": "file", "path": str(data), "options": {"verifier": verifier}},
            "reward": {"functions": [task_function, {"name": "format"}]},
        }
    )


def test_the_self_check_binds_the_runs_verifier_with_its_options(tmp_path: Path, tiny_model_dir: Path) -> None:
    """regex's reference answer is what the pattern captures, not a response: only an answer it raises on counts;
    code_tests is not run (it would start the sandbox on every row)."""
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"prompt": "2+2=", "answer": ""}))
    config = verifier_config(data, tiny_model_dir, "regex", pattern="answer: (\\d+)")
    prompter = Prompter.for_tokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), config.task)
    (regex,) = check_file(config, prompter, len, run_verifiers(config)).checks
    assert regex.verify("so answer: 2", "2") == 1.0  # bound with the config's pattern
    assert (regex.checked, regex.passed, regex.below) == (2, 0, []) and "captures" in regex.note
    assert [where for where, _ in regex.raised] == ["line 2"] and "empty once normalised" in regex.raised[0][1]

    config = verifier_config(data, tiny_model_dir, "code_tests")
    (code,) = check_file(config, prompter, len, run_verifiers(config)).checks
    assert code.checked == 0 and "sandbox" in code.note


def test_a_generated_task_is_checked_on_its_drawn_prompts(tmp_path: Path, tiny_model_dir: Path, chat_model_dir) -> None:
    """A task that generates its prompts (here a game that deals cards as ``♥``) is checked as a file is, on 256 of
    its prompts drawn with run.seed: a character the tokenizer can only map to its unknown token fails it, as it does
    a file's row. And a multi-turn run whose first observation plus a first turn of rollout.max_new_tokens fills
    model.max_model_len is warned about: its episodes could never reach a second turn."""
    import random

    from asyncrl.common.data.tasks import TASKS, Task, TaskExample, register_task
    from asyncrl.common.rewards.verifiers import VERIFIERS, get_verifier, register_verifier

    with TASKS.snapshot(), VERIFIERS.snapshot():
        register_verifier("hearts")(get_verifier("arithmetic"))

        @register_task("hearts")
        class Hearts(Task):
            def sample(self, rng: random.Random) -> TaskExample:
                n = rng.randint(1, 9)
                return TaskExample(prompt=f"{'♥' * (n % 2)}{n}+1=", answer=str(n + 1))

        code, out, _ = check("--set", f"model.path={tiny_model_dir}", "--set", "task.name=hearts")
        assert code == 1, out
        assert "check-data: task 'hearts': 256 prompts drawn with run.seed = 0" in out
        assert "unknown to the tokenizer: '♥' (U+2665)" in out and "duplicate prompts" not in out

        long_turns = ["rollout.workflow=multi_turn", "environment.name=calculator", "model.max_model_len=64"]
        sets = [f"model.path={chat_model_dir}", "task.name=hearts", *long_turns]
        code, out, _ = check(*(a for x in [*sets, "rollout.max_new_tokens=40"] for a in ("--set", x)))
        assert code == 0 and "no room for a second turn" in out and out.endswith("exit 0: 1 warning(s)\n"), out
        code, out, _ = check(*(a for x in [*sets, "rollout.max_new_tokens=8"] for a in ("--set", x)))
        assert code == 0 and "no room for a second turn" not in out, out

