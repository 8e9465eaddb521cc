"""What ``rl-launch ray`` asks of Ray, built without a cluster: the head's bundle, each rollout actor's request and
command line, the ``[ray]`` settings it refuses, and an address where nothing answers (the run on a real Ray cluster
is tests/e2e/test_ray.py)."""

from __future__ import annotations

import json
import socket

import pytest

from asyncrl.cli.ray_cluster import unreachable_cluster
from asyncrl.cli.ray_launch import RayActors, head_bundle, namespace
from asyncrl.common.config import ConfigError, load_config


def test_the_heads_bundle_holds_the_learners_gpus_only_when_asked() -> None:
    assert head_bundle(load_config(None, []).ray) == {"CPU": 1.0}
    asked = load_config(None, ["ray.gpus=true", "ray.learner_ranks=2", "ray.head_resources={learner_node=1}"])
    assert head_bundle(asked.ray) == {"CPU": 1.0, "GPU": 2.0, "learner_node": 1.0}
    assert head_bundle(load_config(None, ["ray.head_cpus=0"]).ray) == {}


def test_each_actor_asks_for_its_tensor_parallel_gpus_and_its_command_names_files_only() -> None:
    config = load_config(None, ["ray.gpus=true", "rollout.tensor_parallel_size=2", "ray.actor_resources={a=1}"])
    proxy = RayActors(config, "10.0.0.1:6379", []).proxy("actor-3", ["rl-actor", "--redis-url-file", "/r/url"])
    request = json.loads(proxy[proxy.index("--request") + 1])
    assert request == {"cpus": 1.0, "resources": {"a": 1.0}, "restarts": 3, "gpus": 2}
    assert proxy[proxy.index("--") + 1 :] == ["rl-actor", "--redis-url-file", "/r/url"]
    assert proxy[proxy.index("--run") + 1] == config.run.name and namespace("exp1") == "asyncrl-exp1"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("ray.actor_resources={CPU=2}", "set ray.gpus, ray.head_cpus or ray.actor_cpus"),
        ("ray.head_resources={'bad name'=1}", "a resource is named with letters"),
        ("ray.actor_resources={x=-1}", "ray.actor_resources"),
        ("ray.actor_resources={x=inf}", "ray.actor_resources"),
        ("ray.actors=-1", "ray.actors"),
    ],
)
def test_a_ray_setting_ray_cannot_take_is_refused_naming_it(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_an_address_where_nothing_answers_is_said_at_once() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, not listening: refused
        assert "nothing answers at 127.0.0.1:" in (unreachable_cluster(f"127.0.0.1:{port}") or "")
        assert "nothing answers" in (unreachable_cluster(f"ray://127.0.0.1:{port}") or "")
    assert unreachable_cluster("auto") is None
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert unreachable_cluster(f"127.0.0.1:{listening.getsockname()[1]}") is None


def test_changing_a_live_run_needs_the_number_of_actors() -> None:
    from typer.testing import CliRunner

    from asyncrl.cli.launch import app

    said = CliRunner().invoke(app, ["ray", "--run", "exp1"])
    assert said.exit_code == 2 and said.stderr.startswith("error: --run names a live run to change"), said.output
