"""A user's chat model and chat data in a synchronous run with evaluation in the loop and CURVE on the actor →
reward-worker hop, real processes started one by one (`rl-launch redis`, `rl-actor reward`, `rl-actor`,
`rl-learner train`).

The model and data are as users bring them: a chat model (byte-level BPE, ChatML template, Qwen2 with a padded
embedding; tests/integration/test_chat_models.py serves and trains both architectures) and a chat-formatted JSONL file
with one prompt too long to serve. The run trains every step with finite losses and a learning signal (the format
reward varies); the over-long row is skipped at load with one log line naming it, and the run goes on.

Synchronous (``staleness.max_staleness = 0``): every token is sampled by the weights being trained, so μ (vLLM)
equals π_old (the learner) and every sample in samples.jsonl has staleness 0. Evaluation: eval rounds at steps 0, 2
and 4 of a 4-step run appear in metrics.jsonl with every prompt scored by the reward worker, sampled by the policy of
their step, and no eval group is ever trained, counted by admission or left behind in Redis (evaluating a checkpoint
offline, `rl-learner eval --checkpoint latest`: tests/e2e/test_resume.py). CURVE, set up as the README says
(`rl-launch keys`): the run trains to the end, and a stranger whose key pair the run never authorised, connecting as
an actor does, is refused, counted and logged once; nothing it sends is scored."""

from __future__ import annotations

import contextlib
import json
import math
import urllib.request
from collections import Counter
from pathlib import Path

from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import connect
from asyncrl.common.plane.run_secret import run_seal
from asyncrl.common.tiny_models.chat import chat_examples, init_chat_model, warm_start_chat
from asyncrl.common.transport.channel import ChannelBlocked, PushChannel
from asyncrl.common.transport.curve import CurveClient
from tests.helpers.forgery import reward_endpoints, reward_workers, right_texts
from tests.helpers.runs import check_samples
from tests.helpers.stack import BIN, ONE_PROCESS_ENGINE, ROOT, Processes, _wait

RUN, STEPS, GROUPS, PROMPTS = "evalrun", 4, 8, 12
ASSISTANT_TURN = "<|im_start|>assistant\n"
"""How the chat template's rendering of every prompt ends (the generation prompt)."""


def chat_model_and_data(folder: Path) -> tuple[Path, Path, Path]:
    """A warm-started Qwen2 chat model, a chat JSONL file whose 6th row is too long to serve, and a held-out file."""
    model = init_chat_model(folder / "model", "qwen2", seed=0)
    warm_start_chat(model, chat_examples(2000, seed=1), steps=60)
    rows = chat_examples(40, seed=2)
    rows.insert(5, {"messages": [{"role": "user", "content": "What is " + "1+" * 80 + "1?"}], "answer": "81"})
    data = folder / "chat.jsonl"
    data.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    heldout = folder / "heldout.jsonl"
    heldout.write_text("".join(json.dumps(row) + "\n" for row in chat_examples(PROMPTS, seed=3)))
    return model, data, heldout


def make_keys(folder: Path, procs: Processes) -> list[str]:
    """`rl-launch keys FOLDER`: the printed ``--set`` arguments."""
    proc = procs.start(f"keys-{folder.name}", [BIN / "rl-launch", "keys", folder])
    assert proc.wait(60) == 0, procs.log(f"keys-{folder.name}")
    return procs.log(f"keys-{folder.name}").split()


def refused_clients(plane: ControlPlane) -> float:
    """``asyncrl_channel_refused_clients_total`` of the reward worker (0 until it serves /metrics)."""
    workers = [h for h in plane.registry.processes()[0] if h.kind == "reward" and h.metrics_url]
    if not workers:
        return 0.0
    worker = workers[0]
    text = urllib.request.urlopen(worker.metrics_url.replace(worker.host, "127.0.0.1"), timeout=10).read().decode()
    lines = [line for line in text.splitlines() if line.startswith("asyncrl_channel_refused_clients_total")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def strike_as_stranger(plane: ControlPlane, key_file: str) -> PushChannel:
    """A peer whose key pair the run never authorised connects to the reward worker as an actor does (CURVE with the
    server key the worker advertises, the run's seal: it reached the run's Redis) and sends a rollout for every group
    in flight. Its handshake is refused, so nothing it sends ever arrives (each send gives up at once)."""
    [worker] = reward_workers(plane)
    channel = PushChannel("rollouts", send_timeout_s=0.1, seal=run_seal(plane.client, plane.keys, "rollouts"))
    channel.connect(worker.endpoint, CurveClient(Path(key_file), worker.curve_public_key.encode()))
    for group in right_texts(plane, actor="intruder"):
        with contextlib.suppress(ChannelBlocked):
            channel.send(group)
    return channel


def test_a_synchronous_curve_chat_run_has_no_policy_mismatch_refuses_a_stranger_and_never_trains_an_eval_round(
    tmp_path: Path,
) -> None:
    model_dir, data, heldout = chat_model_and_data(tmp_path)
    run_dir = tmp_path / RUN
    procs = Processes(tmp_path / "logs")
    keys = make_keys(tmp_path / "keys", procs)
    stranger = dict(arg.split("=", 1) for arg in make_keys(tmp_path / "strangers", procs) if "=" in arg)
    overrides = [
        f"run.root={tmp_path}", f"run.name={RUN}", f"model.path={model_dir}", f"learner.steps={STEPS}",
        f"learner.groups_per_step={GROUPS}", "eval.every=2", f"eval.limit={PROMPTS}",
        "eval.num_samples=2", "eval.temperature=1.0", "eval.max_new_tokens=8",
        "staleness.max_staleness=0", "monitoring.samples_every=2", "monitoring.samples_per_step=3", ONE_PROCESS_ENGINE,
        "task.name=file", f"task.path={json.dumps(str(data))}", 'task.options={verifier="arithmetic"}',
        'task.system_prompt="Answer with the number only."',
        'reward.functions=[{name = "task"}, {name = "format", weight = 0.5}]',  # format varies: a real gradient
        "model.max_model_len=96", "rollout.max_new_tokens=8",  # 88 prompt tokens at most: the long row has about 200
        "rollout.num_samples=4", "learner.micro_batch_size=16",
        "eval.name=file", f"eval.path={json.dumps(str(heldout))}", 'eval.options={verifier="arithmetic"}',
    ]
    sets = [*keys, *(arg for override in overrides for arg in ("--set", override))]
    config = ROOT / "configs/demo.toml"
    try:
        run_args = procs.start_run(config, sets, run_dir)
        plane = ControlPlane(connect(run_args[1]), RUN)
        assert plane.run.read_config().transport.curve_client_key.endswith("client.key_secret")
        procs.start_actor("actor-0", run_args, core=1)
        learner = procs.start("learner", [BIN / "rl-learner", "train", config, *sets, "--redis", run_args[1]])
        _wait(lambda: reward_endpoints(plane) and plane.prompts.ledger(), "groups in flight", learner)
        intruder = strike_as_stranger(plane, stranger["transport.curve_client_key"])
        _wait(lambda: refused_clients(plane) >= 1, "the intruder's handshake refused", learner)
        intruder.close()
        assert learner.wait(900) == 0, procs.log("learner")[-3000:]
        assert "curve=True" in procs.log("actor-0")  # the authorised actor's hop is CURVE
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in rows if "eval/step" in r]
        steps = [r for r in rows if "eval/step" not in r]
        assert [int(r["step"]) for r in steps] == list(range(1, STEPS + 1))
        assert all(math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]) for r in steps), steps
        assert all(r["train/applied"] == 1.0 and r["groups/refused"] == 0 for r in steps)
        assert any(r["train/grad_norm"] > 0 for r in steps), "no step had a learning signal"
        skipped = [x for x in procs.log("learner").splitlines() if "skipped a row whose prompt is too long" in x]
        assert len(skipped) == 1 and f"{data}:line 6" in skipped[0], skipped
        assert all(r["rollout/staleness_max"] == 0 for r in steps)
        assert max(r["train/offpolicy/mismatch_kl"] for r in steps) < 1e-4  # weights really arrive every step
        check_samples(run_dir / "samples.jsonl", steps=[2, 4], per_step=3, staleness=0, prompt_end=ASSISTANT_TURN)
        assert sorted(int(r["step"]) for r in evals) == [0, 2, 4]  # issued at step 0, 2 and the last
        for r in evals:
            assert (r["eval/groups"], r["eval/missing"], r["eval/k"]) == (PROMPTS, 0, 2)
            assert 0.0 <= r["eval/pass@k"] <= 1.0 and 0.0 <= r["eval/mean@k"] <= 1.0
            assert r["eval/pass@k"] >= r["eval/accuracy"]
            assert r["eval/policy_min"] >= r["eval/step"]  # the actor waited for the policy it evaluates
            assert r["eval/response_tokens"] <= 8
        trained = {g.decode(): int(s) for g, s in plane.client.hgetall(plane.keys.trained).items()}
        assert Counter(trained.values()) == dict.fromkeys(range(1, STEPS + 1), GROUPS)  # the batches stay whole
        assert not [g for g in trained if "-eval" in g]  # no eval group was trained
        counts = plane.prompts.dispatch_counts()
        assert counts["created"] == counts["released"] + counts.get("discarded", 0) + counts.get("lost", 0)
        assert not [g for g in plane.client.hkeys(plane.keys.groups) if b"-eval" in g]  # every round retired
        assert plane.client.llen(plane.keys.eval_prompts) == 0
        assert plane.client.xlen(plane.keys.dead) == 0  # nothing refused by the reward worker or the learner
        groups_from = Counter()
        for row in steps:
            groups_from.update({k.rsplit("/", 1)[1]: v for k, v in row.items() if k.startswith("rollout/groups_from/")})
        assert "intruder" not in groups_from  # nothing it generated was scored, let alone trained
        shown = json.loads(plane.client.get(plane.keys.eval))  # what rl-top shows
        assert [int(r["eval/step"]) for r in shown] == [0, 2, 4]
        log = procs.log("learner")
        for step in (0, 2, 4):
            print(f"eval step {step}:", {k: v for r in evals if r["step"] == step for k, v in r.items()})
        assert log.count("issued an eval round") == 3
    finally:
        procs.stop_all()
    assert procs.log("reward").count("refused a CURVE client whose public key is not authorised") == 1
