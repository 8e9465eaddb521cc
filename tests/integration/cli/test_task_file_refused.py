"""``rl-learner train`` refuses a data file with a bad row: exit 2, the file and row named, before DeepSpeed starts
(a prompt too long to serve is such a row with ``task.overlong = "refuse"``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def test_train_refuses_a_prompt_too_long_to_serve_naming_its_row(tmp_path: Path, tiny_model_dir, redis_server) -> None:
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "9" * 60 + "=", "answer": "9"}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    settings = [
        f"run.root={tmp_path}",
        f"model.path={json.dumps(str(tiny_model_dir))}",
        "model.max_model_len=64",
        "rollout.max_new_tokens=8",  # 64 - 8 = 56 prompt tokens at most; row 2 is BOS + 61 characters
        "task.name=file",
        f"task.path={json.dumps(str(data))}",
        'task.options={verifier="arithmetic"}',
        "task.overlong=refuse",  # the default, skip, leaves the row out and trains on the rest (tests/e2e)
    ]
    args = [str(BIN / "rl-learner"), "train", "--redis", redis_server.url]
    for setting in settings:
        args += ["--set", setting]
    result = subprocess.run(args, capture_output=True, text=True, timeout=180)
    assert result.returncode == 2, result.stderr
    assert f"error: {data}:line 2: prompt is 62 tokens; the run can serve at most 56" in result.stderr
    assert "Traceback" not in result.stderr
