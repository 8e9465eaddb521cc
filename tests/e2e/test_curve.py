"""CURVE on the actor → reward-worker hop, set up as the README says (`rl-launch keys`), with real processes: the
run trains to the end, and an actor whose key is not authorised (its own key path from ``ASYNCRL_CURVE_CLIENT_KEY``)
is refused, counted and logged once; nothing it sends is scored, and every real group is trained once."""

from __future__ import annotations

import json
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from common.control import ControlPlane
from common.keys import connect
from tests.helpers.stack import BIN, ROOT, Processes, _wait

pytestmark = pytest.mark.e2e
RUN, STEPS, GROUPS = "curve", 6, 16


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


def test_curve_run_trains_and_an_unauthorised_actor_is_refused(tmp_path: Path, model_dir: Path) -> None:
    run_dir = tmp_path / RUN
    procs = Processes(tmp_path / "logs")
    keys = make_keys(tmp_path / "keys", procs)
    stranger = dict(arg.split("=", 1) for arg in make_keys(tmp_path / "strangers", procs) if "=" in arg)
    overrides = [f"run.root={tmp_path}", f"run.name={RUN}", f"model.path={model_dir}", f"learner.steps={STEPS}"]
    overrides.append("eval.every=0")  # eval rounds: tests/e2e/test_eval.py's
    sets = [*keys, *(arg for override in overrides for arg in ("--set", override))]
    config = ROOT / "configs/demo.toml"
    try:
        run_args = procs.start_run(config, sets, run_dir)
        url = run_args[1]
        plane = ControlPlane(connect(url), RUN)
        assert plane.run.read_config().transport.curve_client_key.endswith("client.key_secret")
        procs.start("actor-0", [BIN / "rl-actor", *run_args, "--id", "actor-0"], {"VLLM_CPU_OMP_THREADS_BIND": "1"})
        intruder_key = {"ASYNCRL_CURVE_CLIENT_KEY": stranger["transport.curve_client_key"]}
        procs.start("intruder", [BIN / "rl-actor", *run_args, "--id", "intruder"], intruder_key)
        learner = procs.start("learner", [BIN / "rl-learner", "train", config, *sets, "--redis", url])
        _wait(lambda: refused_clients(plane) >= 1, "the intruder's handshake refused", learner)
        _wait(lambda: "connected to reward worker" in procs.log("intruder"), "the intruder to try", learner)
        assert procs.stop("intruder") == 0, procs.log("intruder")[-2000:]  # gives back what it held
        assert learner.wait(900) == 0, procs.log("learner")[-3000:]
        assert "curve=True" in procs.log("actor-0")  # the authorised actor's hop is CURVE
        trained = {g.decode(): int(s) for g, s in plane.client.hgetall(f"asyncrl:{RUN}:trained").items()}
        assert Counter(trained.values()) == dict.fromkeys(range(1, STEPS + 1), GROUPS)  # none twice
        assert plane.client.xlen(plane.keys.dead) == 0
        groups_from = Counter()
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            groups_from.update({k.rsplit("/", 1)[1]: v for k, v in row.items() if k.startswith("rollout/groups_from/")})
        assert "intruder" not in groups_from  # nothing it generated was scored, let alone trained
    finally:
        procs.stop_all()
    assert procs.log("reward").count("refused a CURVE client whose public key is not authorised") == 1
