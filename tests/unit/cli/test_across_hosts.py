"""A run across hosts without starting one (``tests/e2e/test_multi_host.py`` runs it): the README's "On a cluster"
commands are ``cli/deploy.py``'s, each lasting process's command line is exactly its argv and environment, every
non-loopback ZeroMQ bind has CURVE keys, and the weight group's gloo sockets go where ``$ASYNCRL_ADVERTISE_HOST`` says.
"""

from __future__ import annotations

import shlex
from datetime import timedelta

import pytest
import torch.distributed as dist

from asyncrl.cli import deploy
from asyncrl.common.config import HOST_KEY_ENV
from asyncrl.common.weights.group import gloo_group
from tests.helpers.readme import readme_block

STEPS = deploy.cluster_steps(**deploy.CLUSTER_EXAMPLE)
HOST_KEY_ENV_BY_FIELD = {path: var for var, path in HOST_KEY_ENV.items()}


def test_the_cluster_docs_give_the_commands_deploy_builds() -> None:
    """docs/cluster.md's "On a cluster" block is exactly what ``cli/deploy.py`` builds."""
    assert readme_block() == deploy.cluster_doc(STEPS)


def test_the_block_says_what_keeps_running_and_leaves_the_readers_shell_as_it_was() -> None:
    """Pasted line by line, the block would stop at the first command that keeps running: each is announced as one
    for a terminal of its own. A umask set for a secret file stays inside a subshell."""
    lines = readme_block().splitlines()
    for step in STEPS:
        first = step.command.splitlines()[0]
        before = lines[lines.index(first) - 1]
        assert (before == deploy.KEEPS_RUNNING) == (step.process is not None), step.command[:80]
        if "umask" in step.command:
            assert step.command.startswith("(umask ") and step.command.endswith(")"), step.command


def test_each_lasting_process_is_its_command_line() -> None:
    """What the docs show is what a launcher starts: the shell words are the environment, then the argv."""
    lasting = [step for step in STEPS if step.process is not None]
    assert len(lasting) == 2 + 1 + len(deploy.CLUSTER_EXAMPLE["worker_hosts"])  # Redis, learner, reward, actors
    for step in lasting:
        words = shlex.split(step.command)
        env = [f"{name}={value}" for name, value in step.process.env.items()]
        assert words == [*env, *step.process.argv]


def test_every_host_advertises_its_address_and_binds_zeromq_with_curve() -> None:
    for step in STEPS:
        if step.process is None:
            continue
        argv, env = step.process.argv, step.process.env
        if argv[0] == "sh" and argv[3] == "redis":
            continue  # redis-server: its bind address is in redis.conf (below)
        assert env[deploy.ADVERTISE_ENV] == step.host
        assert not any("redis://" in word for word in argv)  # the URL comes from --redis-url-file
        if "reward" in argv:
            assert {HOST_KEY_ENV_BY_FIELD["curve_server_key"], HOST_KEY_ENV_BY_FIELD["curve_client_keys"]} <= set(env)
        elif argv[0] == "rl-actor":
            assert env[HOST_KEY_ENV_BY_FIELD["curve_client_key"]] == "keys/client.key_secret"
    learner = next(s for s in STEPS if s.process is not None and "torchrun" in s.process.argv)
    assert "transport.zmq_endpoint=tcp://0.0.0.0:5555" in learner.process.argv  # beyond loopback: CURVE required
    conf = next(s.command for s in STEPS if "redis.conf <<" in s.command)
    assert f"bind {deploy.CLUSTER_EXAMPLE['learner_host']}\n" in conf and "appendonly yes" in conf


def test_the_weight_group_binds_the_advertised_address() -> None:
    """gloo's device is the advertised address: one this host has works, one it lacks is refused by gloo itself
    (so the address really is the one bound); GLOO_SOCKET_IFNAME, when set, leaves the choice to gloo."""
    timeout = timedelta(seconds=5)
    assert gloo_group(dist.HashStore(), 0, 1, timeout, {deploy.ADVERTISE_ENV: "127.0.0.2"}).size() == 1
    with pytest.raises(RuntimeError, match=r"192\.0\.2\.1"):
        gloo_group(dist.HashStore(), 0, 1, timeout, {deploy.ADVERTISE_ENV: "192.0.2.1"})  # TEST-NET-1: not here
    chosen_by_gloo = {deploy.ADVERTISE_ENV: "192.0.2.1", "GLOO_SOCKET_IFNAME": "lo"}
    assert gloo_group(dist.HashStore(), 0, 1, timeout, chosen_by_gloo).size() == 1
