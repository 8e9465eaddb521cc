"""The command line and environment of every process of a run spread over hosts: one source for the Kubernetes
manifests under ``k8s/`` and for the multi-host test.

Why a module, not a YAML file of commands or a manifest generator: the manifests stay hand-written (readable,
reviewable, patched by kustomize overlays), and both users of a command take it from here.
``tests/integration/cli/test_k8s.py`` builds every overlay and asserts that each container's ``command + args`` and
``env`` are exactly :func:`kube_container` of its role; the multi-host test starts its processes from :func:`learner`,
:func:`actor`, :func:`reward` and :func:`redis` with its own :class:`Site` (a Job's learner is :func:`learner_job`: the
same ``rl-learner train`` arguments, wrapped so that the container exits with the learner's own status). A changed
command fails that test until the manifests say the same, so they cannot drift apart. The "On a cluster" commands of
``docs/cluster.md`` are :func:`cluster_steps` of :data:`CLUSTER_EXAMPLE`, rendered by :func:`cluster_doc`:
``tests/unit/cli/test_across_hosts.py`` asserts the docs hold that text and ``tests/e2e/test_multi_host.py`` runs those
very steps, host by host.

What differs between hosts or pods is a :class:`Site` parameter. On Kubernetes (:data:`KUBE`) the parameters that
differ per pod or per overlay are the kubelet's ``$(NAME)`` references: it expands them in ``args`` and ``env`` from
the variables listed before them in the container (:data:`POD_INPUTS`: the downward API's pod IP and name, the
``asyncrl-run`` ConfigMap), so every overlay runs the same container spec and only its ConfigMap differs.

No secret is ever an argument or an environment value here (DESIGN, "Across hosts"): the Redis URL with its password
is read from ``--redis-url-file`` (a mounted Secret on Kubernetes), CURVE keys from the files that
:data:`asyncrl.common.config.HOST_KEY_ENV` variables name, and the Redis password from a file that the Redis role feeds
``redis-server`` on standard input (``requirepass``), not through ``--requirepass``, which ``ps`` would show.
No vLLM, DeepSpeed or torch import: the test and a launcher load this in milliseconds.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncrl.actors.liveness import ALIVE_ENV
from asyncrl.common.config import HOST_KEY_ENV
from asyncrl.common.net import ADVERTISE_HOST_ENV

ADVERTISE_ENV = ADVERTISE_HOST_ENV
"""The address a process puts in its heartbeat for others to reach it (``common/net.py``)."""
_KEY_ENV = {path: var for var, path in HOST_KEY_ENV.items()}  # transport.curve_* field -> its per-host variable

LEARNER_RESUME = """\
# Resume from the newest complete checkpoint when there is one (a restarted pod), else start the run.
checkpoints=$1; shift
for manifest in "$checkpoints"/step-*/manifest.json; do
  [ -f "$manifest" ] && exec "$@" --resume latest
done
exec "$@"
"""
"""``sh -c`` script around the learner: ``rl-learner train --resume latest`` refuses a run with no checkpoint, and a
container restarted by its pod must resume, so the choice is made here (a ``step-<N>`` folder exists only once its
checkpoint is complete: it is written under a temporary name and renamed)."""

LEARNER_JOB = """\
# A Job's learner: the container exits with the learner's own status (its podFailurePolicy reads it).
checkpoints=$1 nproc=$2 timeout=$3 rank=$4; shift 4
# Resume from the newest complete checkpoint when there is one (a restarted pod), else start the run.
for manifest in "$checkpoints"/step-*/manifest.json; do
  [ -f "$manifest" ] && set -- "$@" --resume latest && break
done
# One rank: the learner alone. Several: torchrun, whose own status is 1 whatever its ranks exit with, so
# each rank runs under the script $rank, and the first rank to fail writes its status to $status/first.
status=$(mktemp -d)
[ "$nproc" = 1 ] || set -- torchrun --standalone --nnodes=1 --nproc-per-node="$nproc" \\
  --shutdown-timeout="$timeout" --no-python sh -c "$rank" rank "$status/first" "$@"
# SIGTERM goes on (torchrun passes it to every rank and waits); then exit as the learner did.
trap 'kill -TERM "$pid" 2>/dev/null' TERM INT
"$@" &
pid=$!
wait "$pid"; code=$?
while kill -0 "$pid" 2>/dev/null; do wait "$pid"; code=$?; done
[ -s "$status/first" ] && read -r code < "$status/first"
rm -rf "$status"
exit "$code"
"""
"""``sh -c`` script of the learner's container (:func:`learner_job`): ``--resume latest`` as :data:`LEARNER_RESUME`
adds it, and the container's exit status is the learner's — under torchrun, whose own is 1 for any failed rank, the
status of the rank that failed first (the others are then stopped by torchrun's SIGTERM) — so that the Job's
``podFailurePolicy`` tells a refused config (2, ``ExitCode.REFUSED``) from what another pod may mend (3: no
actors left, 75: Redis gone, 143: SIGTERM, 1: a crash). Not ``exec``: the shell stays as the container's pid 1,
passes SIGTERM on and waits (pid 1 ignores a signal it has no handler for)."""

LEARNER_RANK = """\
# One learner rank under torchrun: SIGTERM goes on to it. The first rank to fail writes its status to
# the file $1 (noclobber: the file is made only where no other rank has made it).
first=$1; shift
trap 'kill -TERM "$pid" 2>/dev/null' TERM INT
"$@" &
pid=$!
wait "$pid"; code=$?
while kill -0 "$pid" 2>/dev/null; do wait "$pid"; code=$?; done
[ "$code" = 0 ] || (set -C; echo "$code" > "$first") 2>/dev/null
exit "$code"
"""
"""``sh -c`` script that :data:`LEARNER_JOB` runs each torchrun rank under (``torchrun --no-python``)."""

REDIS_START = """\
exec redis-server "$1" - <<EOF
requirepass $(cat "$2")
EOF
"""
"""``sh -c`` script of the Redis role: the config file, then ``requirepass`` from the password file on standard input
(``redis-server FILE -`` reads both); ``exec`` leaves ``redis-server`` as the process that gets SIGTERM. The password
must need no quoting in a Redis config (``openssl rand -hex 32`` makes one)."""

REDIS_CONF = """\
# asyncrl's Redis: bound where the run's other hosts reach it (in a pod every interface: who may connect is the
# NetworkPolicy's business), a password (requirepass, fed on standard input: it is in no file), and AOF so a restart
# loses nothing (always: everysec lost acknowledged writes on a kill -9 of the server, common/plane/outage.py). Past
# maxmemory a write fails loudly (noeviction): nothing of the run is ever evicted.
bind {bind}
port {port}
dir {data_dir}
appendonly yes
appendfsync always
maxmemory {maxmemory_mb}mb
maxmemory-policy noeviction
"""
"""The Redis config file (holds no secret: a ConfigMap on Kubernetes)."""


@dataclass(frozen=True)
class Site:
    """Where a run's processes find their inputs, and the ports they use. On one host, literal values; on Kubernetes
    :data:`KUBE`, where some are the kubelet's ``$(NAME)`` references."""

    run: str
    """Run name (``run.name``): the Redis namespace ``asyncrl:<run>:`` and the folder under :attr:`root`."""
    config: str
    """The learner's TOML config file; everyone else reads the config the learner publishes in Redis."""
    redis_url_file: str
    """File holding the Redis URL with its password (mode 0600 or a mounted Secret)."""
    advertise_host: str
    """This host's address as the others reach it (``$ASYNCRL_ADVERTISE_HOST``: heartbeats, ``/metrics``)."""
    root: str = "runs"
    """``run.root``: the learner's checkpoints, metrics and audit trail go to ``<root>/<run>/``."""
    nproc: str = "1"
    """Learner ranks on this host (``torchrun --nproc-per-node``; GPUs on a GPU host)."""
    shutdown_timeout_s: str = "3600"
    """How long torchrun lets its ranks finish the step and checkpoint after SIGTERM before it kills them."""
    sigterm_exit_code: int = 0
    """The learner's exit status after SIGTERM stopped an unfinished run (``--sigterm-exit-code``): non-zero where a
    Job runs it, so that a drained or evicted learner is restarted rather than taken for a finished run."""
    metrics_port: int = 9400
    """``monitoring.metrics_port``: the same on every process (each host or pod has its own address)."""
    metrics_host: str = "0.0.0.0"
    """``monitoring.metrics_host``: every interface, since Prometheus scrapes from another host or pod (the config's
    default is loopback)."""
    zmq_port: int = 5555
    """Port of the reward workers' PULL socket (``transport.zmq_endpoint`` = every interface, this port)."""
    curve_server_key: str = ""
    """Reward workers: their CURVE server secret key file (``server.key_secret`` from ``rl-launch keys``)."""
    curve_client_keys: str = ""
    """Reward workers: the folder of authorised client public keys (``authorized/``)."""
    curve_client_key: str = ""
    """Actors: their CURVE client secret key file (``client.key_secret``)."""
    alive_file: str = ""
    """Actors: the file each touches while its engine makes progress (:data:`ALIVE_ENV`; empty: none)."""
    redis_conf: str = "redis.conf"
    """The Redis role's config file (:data:`REDIS_CONF`)."""
    redis_password_file: str = "password"
    """The Redis role's password file (the password of the URL in :attr:`redis_url_file`)."""


@dataclass(frozen=True)
class Process:
    """One process to start: its argument vector and the environment it needs on top of the host's."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


def learner(site: Site) -> Process:
    """``rl-learner train`` under torchrun with ``site.nproc`` ranks, resuming when a checkpoint exists."""
    torchrun = (
        "torchrun", "--standalone", "--nnodes=1", f"--nproc-per-node={site.nproc}",
        f"--shutdown-timeout={site.shutdown_timeout_s}",
        "-m", "asyncrl.cli.learner", *_train_args(site),
    )  # fmt: skip
    argv = ("sh", "-c", LEARNER_RESUME, "learner", _checkpoints(site), *torchrun)
    return Process(argv, {ADVERTISE_ENV: site.advertise_host})


def learner_job(site: Site) -> Process:
    """``rl-learner train`` as a Kubernetes Job runs it (:data:`LEARNER_JOB`): alone for one rank, under torchrun for
    several, resuming when a checkpoint exists, and exiting with the learner's own status (under torchrun, that of
    the rank that failed first)."""
    job = (_checkpoints(site), site.nproc, site.shutdown_timeout_s, LEARNER_RANK)
    argv = ("sh", "-c", LEARNER_JOB, "learner", *job, "rl-learner", *_train_args(site))
    return Process(argv, {ADVERTISE_ENV: site.advertise_host})


def _checkpoints(site: Site) -> str:
    return f"{site.root}/{site.run}/checkpoints"


def _train_args(site: Site) -> tuple[str, ...]:
    return (
        "train", site.config,
        "--set", f"run.name={site.run}",
        "--set", f"run.root={site.root}",
        "--set", f"monitoring.metrics_port={site.metrics_port}",
        "--set", f"monitoring.metrics_host={site.metrics_host}",
        "--set", f"transport.zmq_endpoint=tcp://0.0.0.0:{site.zmq_port}",
        "--redis-url-file", site.redis_url_file,
        *(("--sigterm-exit-code", str(site.sigterm_exit_code)) if site.sigterm_exit_code else ()),
    )  # fmt: skip


def actor(site: Site, process_id: str) -> Process:
    """One rollout actor: the config, weights and prompts come from the run's Redis."""
    argv = ("rl-actor", "--run", site.run, "--redis-url-file", site.redis_url_file, "--id", process_id)
    env = {ADVERTISE_ENV: site.advertise_host, _KEY_ENV["curve_client_key"]: site.curve_client_key}
    return Process(argv, env | ({ALIVE_ENV: site.alive_file} if site.alive_file else {}))


def reward(site: Site, process_id: str) -> Process:
    """One reward worker, binding ``transport.zmq_endpoint`` with CURVE (it is beyond loopback)."""
    argv = ("rl-actor", "reward", "--run", site.run, "--redis-url-file", site.redis_url_file, "--id", process_id)
    env = {
        ADVERTISE_ENV: site.advertise_host,
        _KEY_ENV["curve_server_key"]: site.curve_server_key,
        _KEY_ENV["curve_client_keys"]: site.curve_client_keys,
    }
    return Process(argv, env)


def redis(site: Site) -> Process:
    """``redis-server`` on :attr:`Site.redis_conf` with the password from :attr:`Site.redis_password_file`."""
    return Process(("sh", "-c", REDIS_START, "redis", site.redis_conf, site.redis_password_file))


def redis_conf(data_dir: str, port: int = 6379, bind: str = "* -::*", maxmemory_mb: int = 3072) -> str:
    """The text of the Redis config file for data in ``data_dir`` (``* -::*``: every IPv4 and, where there is one,
    IPv6 interface; Redis 7 syntax). ``maxmemory_mb``: below the Redis pod's memory limit (4 GiB), with room for the
    AOF rewrite's buffers."""
    return REDIS_CONF.format(bind=bind, port=port, data_dir=data_dir, maxmemory_mb=maxmemory_mb)


def shell(process: Process) -> str:
    """``process`` as one POSIX shell command: its environment as assignments before its argv, each word quoted
    (``shlex``), so that a person pasting it runs exactly what a launcher starts from :attr:`Process.argv`."""
    assignments = [f"{name}={shlex.quote(value)}" for name, value in process.env.items()]
    return " ".join([*assignments, shlex.join(process.argv)])


# ------------------------------------------------------------------------------------------- across hosts


@dataclass(frozen=True)
class Step:
    """One command of a run across hosts, run in that host's folder of the run (paths are relative to it)."""

    host: str
    """The address of the host that runs it (its ``$ASYNCRL_ADVERTISE_HOST``)."""
    command: str
    """The command as a person types it (POSIX shell; may span lines)."""
    process: Process | None = None
    """For a process that keeps running (Redis, the learner, workers): what :attr:`command` starts; None for a
    command that runs to completion."""


def host_site(run: str, host: str) -> Site:
    """The :class:`Site` of one host of a run across hosts: literal addresses, paths relative to the host's folder
    (``keys/`` from ``rl-launch keys keys``, ``redis-url``, ``password``, ``redis.conf``, ``run.toml``)."""
    return Site(
        run=run,
        config="run.toml",
        redis_url_file="redis-url",
        advertise_host=host,
        curve_server_key="keys/server.key_secret",
        curve_client_keys="keys/authorized",
        curve_client_key="keys/client.key_secret",
    )


def cluster_steps(run: str, learner_host: str, worker_hosts: Sequence[str], redis_port: int = 6379) -> list[Step]:
    """Every command of a run across hosts, in the order to run them.

    On ``learner_host``: the CURVE keys, the Redis password and URL (files only their owner reads), the Redis config
    (bound to that host's address, AOF on), Redis and the learner. Then on each of ``worker_hosts`` an actor, the first
    also checking that the run is readable (``rl-actor show-config``) and running a reward worker. Between the two,
    ``redis-url`` and ``keys/`` are copied to the worker hosts (a reward worker needs ``keys/server.key_secret`` and
    ``keys/authorized/``, an actor ``keys/client.key_secret``).
    """
    here = host_site(run, learner_host)
    url = f"redis://:$(cat {here.redis_password_file})@{learner_host}:{redis_port}/0"
    conf = redis_conf("redis-data", redis_port, bind=learner_host)
    steps = [
        Step(learner_host, "rl-launch keys keys"),
        Step(learner_host, f"(umask 077 && openssl rand -hex 32 > {here.redis_password_file})"),
        Step(learner_host, f'(umask 077 && echo "{url}" > {here.redis_url_file})'),
        Step(learner_host, f"mkdir -p redis-data && cat > {here.redis_conf} <<'EOF'\n{conf}EOF"),
        Step(learner_host, shell(redis(here)), redis(here)),
        Step(learner_host, shell(learner(here)), learner(here)),
    ]
    for n, host in enumerate(worker_hosts):
        site = host_site(run, host)
        if n == 0:
            show = ("rl-actor", "show-config", "--run", run, "--redis-url-file", site.redis_url_file)
            steps.append(Step(host, shlex.join(show)))
            steps.append(Step(host, shell(reward(site, f"reward-{n}")), reward(site, f"reward-{n}")))
        steps.append(Step(host, shell(actor(site, f"actor-{n}")), actor(site, f"actor-{n}")))
    return steps


CLUSTER_EXAMPLE = {"run": "exp1", "learner_host": "10.77.0.1", "worker_hosts": ("10.77.0.2", "10.77.0.3", "10.77.0.4")}
"""The docs' run across hosts (``docs/cluster.md``): ``10.77.0.4`` is the host that joins mid-run (the multi-host test
builds these four hosts as network namespaces, with exactly these addresses)."""


KEEPS_RUNNING = "# keeps running: in a terminal (or a service) of its own"
"""The line above each long-running command of the cluster doc's block: pasted into one shell, it would stop there."""


def cluster_doc(steps: Sequence[Step]) -> str:
    """The steps as the cluster doc's shell block: each host's commands after a ``# on HOST`` line, each command
    that keeps running after a :data:`KEEPS_RUNNING` line."""
    lines: list[str] = []
    host = None
    for step in steps:
        if step.host != host:
            lines += [""] if lines else []
            lines.append(f"# on {step.host}")
            host = step.host
        lines += [KEEPS_RUNNING] if step.process is not None else []
        lines.append(step.command)
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- Kubernetes

SECRETS = "/var/run/asyncrl"
"""Where pods mount the run's Secrets (each one read-only, mode 0440)."""

KUBE = Site(
    run="$(ASYNCRL_RUN)",
    config="/etc/asyncrl/config/run.toml",
    redis_url_file=f"{SECRETS}/redis/url",
    advertise_host="$(POD_IP)",
    root="/var/lib/asyncrl/runs",
    nproc="$(ASYNCRL_NPROC)",
    shutdown_timeout_s="3600",  # never before the kubelet: terminationGracePeriodSeconds is the bound that counts
    sigterm_exit_code=143,  # a Job's learner stopped by a drain is restarted and resumes; only a finished run completes
    curve_server_key=f"{SECRETS}/curve/server/server.key_secret",
    curve_client_keys=f"{SECRETS}/curve/authorized",
    curve_client_key=f"{SECRETS}/curve/client/client.key_secret",
    alive_file="/tmp/asyncrl-alive",
    redis_conf="/etc/asyncrl/redis/redis.conf",
    redis_password_file=f"{SECRETS}/redis/password",
)
"""The site of every pod: the paths the manifests mount, the ports they open."""

ALIVE_CHECK = 'test $(( $(date +%s) - $(stat -c %Y "$1") )) -lt "$2"'
"""``sh -c`` liveness check of an actor: its alive file (:data:`ALIVE_ENV`) was touched less than ``$2`` seconds ago.
The actor touches it every 10 s while its engine makes progress (``actors/liveness.py``), so a hung engine — or a
hung event loop — fails the check while a thread that serves ``/metrics`` would still answer."""

REDIS_DATA = "/data"
"""The Redis pod's AOF folder (its PersistentVolumeClaim)."""

RUN_CONFIGMAP = "asyncrl-run"
"""The ConfigMap of the run's settings (``run``, ``nproc_per_node``) that each overlay sets."""

POD_INPUTS: dict[str, dict] = {
    "POD_IP": {"fieldRef": {"fieldPath": "status.podIP"}},
    "POD_NAME": {"fieldRef": {"fieldPath": "metadata.name"}},
    "ASYNCRL_RUN": {"configMapKeyRef": {"name": RUN_CONFIGMAP, "key": "run"}},
    "ASYNCRL_NPROC": {"configMapKeyRef": {"name": RUN_CONFIGMAP, "key": "nproc_per_node"}},
}
"""Variables the kubelet fills (``valueFrom``) for ``$(NAME)`` references in :data:`KUBE` and the process ids."""

ROLES = ("learner", "actor", "reward", "redis")
"""Each role is one container, named so, in the workload labelled ``app.kubernetes.io/component: <role>``."""


def kube_process(role: str) -> Process:
    """The process of ``role`` in its pod (the process id is the pod's name: stable across container restarts)."""
    if role == "learner":
        return learner_job(KUBE)
    if role == "actor":
        return actor(KUBE, "$(POD_NAME)")
    if role == "reward":
        return reward(KUBE, "$(POD_NAME)")
    if role == "redis":
        return redis(KUBE)
    raise ValueError(f"unknown role {role!r}; known: {', '.join(ROLES)}")


def kube_container(role: str) -> dict:
    """``command``, ``args`` and ``env`` of the container of ``role``, exactly as in the manifests: first the
    :data:`POD_INPUTS` its ``$(NAME)`` references use (kubelet expansion needs them listed earlier), then its own."""
    process = kube_process(role)
    text = " ".join((*process.argv, *process.env.values()))
    used = set(re.findall(r"\$\(([A-Z_][A-Z0-9_]*)\)", text))
    env = [{"name": name, "valueFrom": source} for name, source in POD_INPUTS.items() if name in used]
    env += [{"name": name, "value": value} for name, value in process.env.items()]
    return {"command": list(process.argv[:1]), "args": list(process.argv[1:]), "env": env}
