"""deploy/: every manifest is schema-valid, and every command it runs is a valid coordd command.

Kubernetes objects are validated with kubernetes-validate (strict: unknown fields fail). The
LeaderWorkerSet is a custom resource that kubernetes-validate has no schema for, so it gets a
structural check written from its CRD (leaderworkerset.x-k8s.io/v1: the fields of spec and of
spec.leaderWorkerTemplate, the enums, workerTemplate required), and its leader and worker pod
templates are validated strictly as Kubernetes PodTemplates. Commands are parsed by coordd's
own CLI (`coordd.cli.parse`, the parser `coordd` runs) with the environment the file gives
them, and must pass the same option checks `coordd serve` does before it starts.
"""

from __future__ import annotations

import argparse
import configparser
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import tomllib
import yaml

from coordd import cli
from coordd.core._daemon_defaults import DEFAULT_METRICS_PORT

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S_FILES = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
#: Native sidecars (initContainers with restartPolicy: Always) are GA from 1.33.
K8S_VERSIONS = ["1.33", kubernetes_validate.utils.latest_version()]
COORDD_IMAGE = "coordd:"

LWS_SPEC_FIELDS = {"leaderWorkerTemplate", "networkConfig", "replicas", "rolloutStrategy",
                   "startupPolicy"}
LWS_TEMPLATE_FIELDS = {"leaderTemplate", "workerTemplate", "size", "restartPolicy",
                       "subGroupPolicy"}
LWS_RESTART_POLICIES = {"Default", "None", "RecreateGroupOnPodRestart"}
LWS_STARTUP_POLICIES = {"LeaderCreated", "LeaderReady"}
LWS_TEMPLATE_METADATA = {"annotations", "finalizers", "labels", "name", "namespace"}


# -- helpers -------------------------------------------------------------------------------------


def k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    return [(f.name, d) for f in K8S_FILES for d in yaml.safe_load_all(f.read_text()) if d]


def image_env() -> dict[str, str]:
    """The ENV of deploy/Containerfile's final stage (what every coordd container starts with)."""
    env: dict[str, str] = {}
    text = (DEPLOY / "Containerfile").read_text().replace("\\\n", " ")
    final = text.split("\nFROM ")[-1]
    for line in final.splitlines():
        if line.startswith("ENV "):
            for pair in shlex.split(line[4:]):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def containerfile_instruction(name: str) -> str:
    text = (DEPLOY / "Containerfile").read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if line.startswith(name + " ")]
    assert len(lines) == 1, f"expected one {name} in the Containerfile, found {len(lines)}"
    return lines[0][len(name) + 1:].strip()


def parse_coordd(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
                 ) -> tuple[argparse.Namespace, Any]:
    """Parse `coordd ARGS` as the coordd CLI does, in exactly `env` (COORDD_* variables)."""
    assert argv and os.path.basename(argv[0]) == "coordd", f"not a coordd command: {argv}"
    for key in list(os.environ):
        if key.startswith("COORDD_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        args, chosen = cli.parse(argv[1:])
    except SystemExit as exc:
        raise AssertionError(f"coordd cannot parse {argv} (env {env}): exit {exc.code}") from None
    if chosen is None:
        cli.check_server_args(args)  # the checks `coordd serve` makes before it starts
    return args, chosen


def pod_specs(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    kind = doc["kind"]
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        yield "template", doc["spec"]["template"]["spec"]
    elif kind == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        if "leaderTemplate" in lwt:
            yield "leader", lwt["leaderTemplate"]["spec"]
        yield "worker", lwt["workerTemplate"]["spec"]
    elif kind == "Pod":
        yield "pod", doc["spec"]


def containers(spec: dict[str, Any]) -> Iterator[tuple[dict[str, Any], bool]]:
    for c in spec.get("initContainers", []):
        yield c, True
    for c in spec.get("containers", []):
        yield c, False


def is_coordd(container: dict[str, Any]) -> bool:
    return str(container.get("image", "")).startswith(COORDD_IMAGE)


def container_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def coordd_argv(container: dict[str, Any], pod_env: dict[str, str] | None = None) -> list[str]:
    """What the container runs: its command, else the image's ENTRYPOINT (coordd), plus args,
    with the kubelet's $(VAR) expansion from `pod_env` (the LWS variables, the downward API)."""
    argv = [*(container.get("command") or ["coordd"]), *container.get("args", [])]
    if pod_env is None:
        return argv
    return [re.sub(r"\$\((\w+)\)", lambda m: pod_env.get(m[1], m[0]), a) for a in argv]


#: What LeaderWorkerSet and the downward API give pod `index` (a relay's --relay-ranks).
def lws_env(index: int = 0) -> dict[str, str]:
    return {"LWS_LEADER_ADDRESS": "leader.vllm-dp", "LWS_WORKER_INDEX": str(index),
            "NODE_INDEX": str(index)}


def is_relay(container: dict[str, Any]) -> bool:
    return "--relay-to" in container.get("args", [])


def mount_source(spec: dict[str, Any], container: dict[str, Any], path: str
                 ) -> tuple[dict[str, Any], str]:
    """The volume a file path in `container` comes from, and the path inside that volume."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    best = None
    for m in container.get("volumeMounts", []):
        root = m["mountPath"].rstrip("/") + "/"
        if path.startswith(root) and (best is None or len(root) > len(best[1])):
            best = (m, root)
    assert best is not None, f"{path} is on no volume of container {container['name']}"
    return volumes[best[0]["name"]], path[len(best[1]):]


def secret_holds(volume: dict[str, Any], inner: str) -> str:
    """The Secret key that a secret volume puts at `inner` (a file, or a directory's files)."""
    assert "secret" in volume, f"volume {volume['name']} is not a Secret"
    items = volume["secret"].get("items")
    assert items, f"secret volume {volume['name']} should list its items"
    for item in items:
        if item["path"] == inner or item["path"].startswith(inner.rstrip("/") + "/"):
            return str(item["key"])
    raise AssertionError(f"secret volume {volume['name']} has nothing at {inner}")


def probe_paths(container: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    out = {}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        if probe in container:
            get = container[probe]["httpGet"]
            out[probe] = (get["path"], get["port"])
    return out


def port_number(container: dict[str, Any], port: Any) -> int:
    if isinstance(port, int):
        return port
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise AssertionError(f"container {container['name']} has no port named {port}")


# -- Kubernetes ---------------------------------------------------------------------------------


def test_there_are_manifests_for_both_layouts() -> None:
    kinds = {d["kind"] for _, d in k8s_docs()}
    assert {"Deployment", "LeaderWorkerSet"} <= kinds


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_kubernetes_object_is_schema_valid(version: str) -> None:
    checked = 0
    for name, doc in k8s_docs():
        assert doc.get("metadata", {}).get("name"), name
        if doc["kind"] == "LeaderWorkerSet":
            check_leaderworkerset(doc, version)
        else:
            kubernetes_validate.validate(doc, version, strict=True)
        checked += 1
    assert checked >= 3


def check_leaderworkerset(doc: dict[str, Any], version: str) -> None:
    """The structural check from the LeaderWorkerSet CRD (see the module docstring)."""
    assert doc["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert isinstance(doc["metadata"]["name"], str) and doc["metadata"]["name"]
    spec = doc["spec"]
    assert set(spec) <= LWS_SPEC_FIELDS, f"unknown spec fields {set(spec) - LWS_SPEC_FIELDS}"
    assert "leaderWorkerTemplate" in spec
    assert isinstance(spec.get("replicas", 1), int) and spec.get("replicas", 1) >= 0
    assert spec.get("startupPolicy", "LeaderCreated") in LWS_STARTUP_POLICIES
    lwt = spec["leaderWorkerTemplate"]
    assert set(lwt) <= LWS_TEMPLATE_FIELDS, f"unknown fields {set(lwt) - LWS_TEMPLATE_FIELDS}"
    assert "workerTemplate" in lwt, "the CRD requires workerTemplate"
    assert isinstance(lwt.get("size", 1), int) and lwt.get("size", 1) >= 1
    assert lwt.get("restartPolicy", "Default") in LWS_RESTART_POLICIES
    for key in ("leaderTemplate", "workerTemplate"):
        if key in lwt:
            template = lwt[key]
            assert set(template.get("metadata", {})) <= LWS_TEMPLATE_METADATA
            kubernetes_validate.validate(
                {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": key},
                 "template": template},
                version,
                strict=True,
            )


def test_the_structural_check_catches_mistakes() -> None:
    (doc,) = [d for _, d in k8s_docs() if d["kind"] == "LeaderWorkerSet"]
    version = K8S_VERSIONS[0]
    broken = []
    for mutate in (
        lambda d: d["spec"].update(leaderWorkerTemplat={}),
        lambda d: d["spec"]["leaderWorkerTemplate"].pop("workerTemplate"),
        lambda d: d["spec"]["leaderWorkerTemplate"].update(restartPolicy="Always"),
        lambda d: d["spec"]["leaderWorkerTemplate"].update(size="4"),
        lambda d: d["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
        .update(imag="x"),
    ):
        copy = json.loads(json.dumps(doc))
        mutate(copy)
        with pytest.raises((AssertionError, kubernetes_validate.ValidationError)):
            check_leaderworkerset(copy, version)
        broken.append(copy)
    assert len(broken) == 5


def test_every_coordd_container_runs_a_valid_coordd_command(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    base_env = image_env()
    seen = 0
    for name, doc in k8s_docs():
        for where, spec in pod_specs(doc):
            for container, _ in containers(spec):
                if not is_coordd(container):
                    continue
                env = {**base_env, **container_env(container)}
                argv = coordd_argv(container, lws_env())
                args, chosen = parse_coordd(argv, env, monkeypatch)
                assert chosen is None, f"{name} {where}: coordd should serve"
                if args.relay_to:
                    from coordd.proto.relay import parse_ranks

                    assert max(parse_ranks(args.relay_ranks)) < args.dp, (name, where)
                seen += 1
    assert seen == 4, "the single-node coordd, and the multi-node root and a relay per pod"



@pytest.mark.parametrize("name", [f.name for f in K8S_FILES])
def test_coordd_is_a_probed_native_sidecar(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = [d for n, d in k8s_docs() if n == name]
    sidecars = [(spec, c, init) for d in docs for _, spec in pod_specs(d)
                for c, init in containers(spec) if is_coordd(c)]
    roots = [s for s in sidecars if not is_relay(s[1])]
    assert len(roots) == 1, "one deciding coordd per manifest, beside rank 0"
    for spec, container, init in sidecars:
        assert init and container.get("restartPolicy") == "Always", "a native sidecar"
        args, _ = parse_coordd(coordd_argv(container, lws_env()),
                               {**image_env(), **container_env(container)}, monkeypatch)
        assert args.metrics_host == "0.0.0.0", "the kubelet probes the pod IP"
        probes = probe_paths(container)
        assert probes["livenessProbe"][0] == "/livez"
        assert probes["startupProbe"][0] == "/livez"
        # the deciding coordd takes relays (--relay-root) exactly where relays speak to it
        has_relays = len(sidecars) > len(roots)
        assert args.relay_root == (container is roots[0][1] and has_relays), name
        if container is roots[0][1]:
            assert args.metrics_port == DEFAULT_METRICS_PORT
            assert probes["readinessProbe"][0] == "/readyz"
        else:
            assert "readinessProbe" not in probes, "the root's /readyz says when the tree formed"
        for path, port in probes.values():
            assert port_number(container, port) == args.metrics_port, path
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert security["readOnlyRootFilesystem"] is True
        assert spec["securityContext"]["runAsNonRoot"] is True



def test_single_node_ranks_share_the_ipc_socket_directory(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    (doc,) = [d for n, d in k8s_docs() if n == "vllm-dp-sidecar.yaml" and d["kind"] ==
              "Deployment"]
    spec = doc["spec"]["template"]["spec"]
    coordd = next(c for c, _ in containers(spec) if is_coordd(c))
    vllm = next(c for c, _ in containers(spec) if not is_coordd(c))
    args, _ = parse_coordd(coordd_argv(coordd), {**image_env(), **container_env(coordd)},
                           monkeypatch)
    assert args.bind.startswith("ipc://")
    socket_path = args.bind[len("ipc://"):]
    volume, _ = mount_source(spec, coordd, socket_path)
    assert "emptyDir" in volume
    assert mount_source(spec, vllm, socket_path)[0] is volume, "the ranks see the same socket"
    assert container_env(vllm)["COORDD_ADDRESS"] == args.bind
    dp_flag = vllm["args"][vllm["args"].index("--data-parallel-size") + 1]
    assert int(dp_flag) == args.dp


def test_multi_node_relays_use_curve_keys_from_one_secret(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The root on the leader listens on tcp with CURVE; every pod (the leader's too) runs a
    relay that authenticates to it with the admitted key pair, and its ranks reach the relay
    over ipc in a shared emptyDir."""
    (doc,) = [d for _, d in k8s_docs() if d["kind"] == "LeaderWorkerSet"]
    assert doc["spec"].get("startupPolicy") != "LeaderReady", (
        "the leader is ready only once every rank registered: LeaderReady would deadlock"
    )
    lwt = doc["spec"]["leaderWorkerTemplate"]
    leader = lwt["leaderTemplate"]["spec"]
    root = next(c for c, _ in containers(leader) if is_coordd(c) and not is_relay(c))
    args, _ = parse_coordd(coordd_argv(root), {**image_env(), **container_env(root)},
                           monkeypatch)
    assert args.bind.startswith("tcp://") and not args.insecure
    secret_key = secret_holds(*mount_source(leader, root, args.curve_secret_key))
    assert secret_key.endswith(".key_secret")
    (clients,) = args.curve_client_keys
    client_public = secret_holds(*mount_source(leader, root, clients))
    assert client_public.endswith(".key")
    port = int(args.bind.rsplit(":", 1)[1])
    secrets = set()
    for index, (where, spec) in enumerate(pod_specs(doc)):
        relays = [c for c, _ in containers(spec) if is_coordd(c) and is_relay(c)]
        assert len(relays) == 1, f"{where}: one relay per pod"
        relay = relays[0]
        rargs, _ = parse_coordd(coordd_argv(relay, lws_env(index)),
                                {**image_env(), **container_env(relay)}, monkeypatch)
        assert rargs.relay_to == f"tcp://leader.vllm-dp:{port}"
        assert rargs.dp == args.dp
        server = secret_holds(*mount_source(spec, relay, rargs.relay_curve_server_key))
        own = secret_holds(*mount_source(spec, relay, rargs.relay_curve_key))
        assert server == secret_key.removesuffix("_secret"), "the root's public key"
        assert own == client_public + "_secret", "the admitted relay key's own pair"
        assert rargs.bind.startswith("ipc://")
        socket_path = rargs.bind[len("ipc://"):]
        volume, _ = mount_source(spec, relay, socket_path)
        assert "emptyDir" in volume
        for c in [c for c, _ in containers(spec) if not is_coordd(c)]:
            env = container_env(c)
            assert env["COORDD_ADDRESS"] == rargs.bind, "the ranks talk to their pod's relay"
            assert mount_source(spec, c, socket_path)[0] is volume
            assert "COORDD_CURVE_CLIENT_KEY" not in env, "ipc: no keys in the engines"
        for volume in spec["volumes"]:
            if "secret" in volume:
                secrets.add(volume["secret"]["secretName"])
                assert volume["secret"]["defaultMode"] & 0o007 == 0, "not world-readable"
    assert len(secrets) == 1
    worker = lwt["workerTemplate"]["spec"]
    assert not any(is_coordd(c) and not is_relay(c) for c, _ in containers(worker))



# -- container image, systemd, compose ------------------------------------------------------------


def test_containerfile_runs_coordd_as_non_root_with_a_health_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    user = containerfile_instruction("USER")
    assert user.split(":")[0] not in ("0", "root")
    entrypoint = json.loads(containerfile_instruction("ENTRYPOINT"))
    cmd = json.loads(containerfile_instruction("CMD"))
    env = image_env()
    assert env["COORDD_METRICS_PORT"] == str(DEFAULT_METRICS_PORT)
    assert containerfile_instruction("EXPOSE") == env["COORDD_METRICS_PORT"]
    # `docker run coordd:0.1.0` with COORDD_DP set, as the deploy files do
    args, chosen = parse_coordd(entrypoint + cmd, {**env, "COORDD_DP": "8"}, monkeypatch)
    assert chosen is None and args.metrics_port == DEFAULT_METRICS_PORT
    assert args.bind is None, "the default bind: ipc in a private runtime directory"
    health = containerfile_instruction("HEALTHCHECK")
    health_argv = json.loads(health.split(" CMD ", 1)[1])
    args, chosen = parse_coordd(health_argv, env, monkeypatch)
    assert chosen is not None and chosen.__name__ == "coordd.cli.status"
    assert args.probe == "livez"
    from coordd.cli.status import targets

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert targets(args.url) == [f"http://127.0.0.1:{DEFAULT_METRICS_PORT}"]


def test_systemd_unit_runs_a_valid_coordd_command(monkeypatch: pytest.MonkeyPatch) -> None:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(DEPLOY / "systemd" / "coordd.service")
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    service = unit["Service"]
    assert service["User"] not in ("root", "0")
    env = dict(part.split("=", 1) for part in shlex.split(service["Environment"]))
    env_file = DEPLOY / "systemd" / "coordd.env"
    for line in env_file.read_text().splitlines():
        if line and not line.startswith("#"):
            key, value = line.split("=", 1)
            env[key] = value
    args, chosen = parse_coordd(shlex.split(service["ExecStart"]), env, monkeypatch)
    assert chosen is None
    assert args.bind == f"ipc:///run/{service['RuntimeDirectory']}/coordd.sock"
    assert service["RuntimeDirectoryMode"] == "0700"
    assert args.metrics_host == "127.0.0.1"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    """systemd's own check: unknown keys or bad values are reported (it exits 0 on those, so
    any output fails the test); ExecStart points at this environment's coordd."""
    beside = Path(sys.executable).parent / "coordd"  # the venv's console script
    coordd = str(beside) if beside.exists() else shutil.which("coordd")
    assert coordd, "the coordd console script is installed"
    text = (DEPLOY / "systemd" / "coordd.service").read_text()
    unit = tmp_path / "coordd.service"
    unit.write_text(text.replace("/usr/local/bin/coordd", coordd))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done


def test_compose_example_runs_valid_coordd_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    coordd = compose["services"]["coordd"]
    vllm = compose["services"]["vllm"]
    assert coordd["build"]["dockerfile"] == "deploy/Containerfile"
    env = {**image_env(), **coordd.get("environment", {})}
    args, chosen = parse_coordd(["coordd", *coordd["command"]], env, monkeypatch)
    assert chosen is None and args.bind.startswith("ipc://")
    check = coordd["healthcheck"]["test"]
    assert check[0] == "CMD"
    _, chosen = parse_coordd(check[1:], env, monkeypatch)
    assert chosen is not None
    socket_dir = os.path.dirname(args.bind[len("ipc://"):])
    shared = {v.split(":")[0] for v in coordd["volumes"] if v.split(":")[1] == socket_dir}
    assert shared and shared == {v.split(":")[0] for v in vllm["volumes"]
                                 if v.split(":")[1] == socket_dir}
    assert vllm["environment"]["COORDD_ADDRESS"] == args.bind
    assert all(p.startswith("127.0.0.1:") for p in coordd["ports"]), "loopback only"
    assert coordd["user"].split(":")[0] == vllm["user"].split(":")[0], "same uid: the socket"


def test_a_tcp_bind_without_keys_is_refused_by_the_same_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(SystemExit, match="needs CURVE"):
        parse_coordd(["coordd", "serve", "--dp", "2", "--bind", "tcp://0.0.0.0:5555"], {},
                     monkeypatch)


# -- vLLM with the coordd plugin: images, ranks, GPUs, readiness --------------------------------

VLLM_IMAGE = "coordd-vllm:"
PYPROJECT = DEPLOY.parent / "pyproject.toml"


def is_vllm(container: dict[str, Any]) -> bool:
    return str(container.get("image", "")).startswith(VLLM_IMAGE)


FAKE_VLLM = """#!/usr/bin/env python3
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "COORDD_ADDRESS": os.environ.get("COORDD_ADDRESS"),
                  "COORDD_VLLM": os.environ.get("COORDD_VLLM")}))
"""


def run_vllm_command(container: dict[str, Any], env: dict[str, str], tmp_path: Path
                     ) -> dict[str, Any]:
    """Run the container's command as its shell would, with a stand-in `vllm` on PATH that
    prints what it was given: the real expansion of LWS_WORKER_INDEX and friends."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "vllm"
    fake.write_text(f"#!{sys.executable}\n" + FAKE_VLLM.split("\n", 1)[1])
    fake.chmod(0o755)
    argv = [*(container.get("command") or ["vllm", "serve"]), *container.get("args", [])]
    full_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **container_env(container), **env}
    done = subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=30,
                          check=False)
    assert done.returncode == 0, done
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def vllm_flags(argv: list[str]) -> dict[str, str | bool]:
    """`vllm serve MODEL --flag value --switch ...` as {flag: value or True}."""
    assert argv[:1] == ["serve"], argv
    flags: dict[str, str | bool] = {}
    i = 2
    while i < len(argv):
        flag = argv[i]
        assert flag.startswith("--"), argv
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            flags[flag] = argv[i + 1]
            i += 2
        else:
            flags[flag] = True
            i += 1
    return flags


def gpus(container: dict[str, Any]) -> int:
    return int(container["resources"]["limits"]["nvidia.com/gpu"])


def test_the_vllm_image_adds_coordd_with_its_plugin_to_vllms_image() -> None:
    text = (DEPLOY / "Containerfile.vllm").read_text().replace("\\\n", " ")
    (arg,) = [line for line in text.splitlines() if line.startswith("ARG VLLM_IMAGE=")]
    base = arg.split("=", 1)[1]
    assert base.startswith("vllm/vllm-openai:v0.33."), "the vLLM release the plugin is pinned to"
    stages = [line.split()[1] for line in text.splitlines() if line.startswith("FROM ")]
    assert stages[-1] == "${VLLM_IMAGE}"
    final = text.split("\nFROM ${VLLM_IMAGE}")[-1]
    assert "ENTRYPOINT" not in final, "vLLM's own entrypoint (vllm serve) stays"
    assert "coordd-*.whl)[vllm]" in final, "installs coordd[vllm] from the wheel built here"
    assert "vllm.general_plugins" in final, "the build checks the entry point"
    ignore = (DEPLOY / "Containerfile.vllm.dockerignore").read_text()
    assert ignore == (DEPLOY / "Containerfile.dockerignore").read_text().replace(
        "deploy/Containerfile ", "deploy/Containerfile.vllm ")
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"coordd": "coordd.vllm:register"}
    assert any(req.startswith("vllm") for req in project["optional-dependencies"]["vllm"])


def test_no_manifest_runs_stock_vllm_or_an_unread_variable() -> None:
    texts = {f.name: f.read_text() for f in [*K8S_FILES, DEPLOY / "compose" / "compose.yaml"]}
    for name, text in texts.items():
        assert "vllm/vllm-openai" not in text, f"{name} runs stock vLLM (it never talks to coordd)"
        assert "COORDD_DP_RANK" not in text, f"{name}: nothing reads COORDD_DP_RANK"
    vllm_containers = [c for _, d in k8s_docs() for _, spec in pod_specs(d)
                       for c, _ in containers(spec) if not is_coordd(c)]
    assert vllm_containers and all(is_vllm(c) for c in vllm_containers)


def test_single_node_vllm_runs_the_plugin_with_one_gpu_per_rank(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (doc,) = [d for n, d in k8s_docs() if n == "vllm-dp-sidecar.yaml" and d["kind"] ==
              "Deployment"]
    spec = doc["spec"]["template"]["spec"]
    coordd = next(c for c, _ in containers(spec) if is_coordd(c))
    vllm = next(c for c, _ in containers(spec) if is_vllm(c))
    args, _ = parse_coordd(coordd_argv(coordd), {**image_env(), **container_env(coordd)},
                           monkeypatch)
    ran = run_vllm_command(vllm, {}, tmp_path)
    flags = vllm_flags(ran["argv"])
    assert ran["COORDD_ADDRESS"] == args.bind, "the plugin is on and finds coordd"
    assert int(str(flags["--data-parallel-size"])) == args.dp == gpus(vllm)
    assert args.expect_groups == ["dp-tp0-pp0", "enginecore"], "ready once both are formed"


def test_multi_node_ranks_come_from_vllms_flags_and_the_worker_index(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (doc,) = [d for _, d in k8s_docs() if d["kind"] == "LeaderWorkerSet"]
    lwt = doc["spec"]["leaderWorkerTemplate"]
    size = lwt["size"]
    leader = lwt["leaderTemplate"]["spec"]
    coordd = next(c for c, _ in containers(leader) if is_coordd(c))
    args, _ = parse_coordd(coordd_argv(coordd), {**image_env(), **container_env(coordd)},
                           monkeypatch)
    assert args.expect_groups == ["dp-tp0-pp0", "enginecore"]
    from coordd.proto.relay import parse_ranks

    ranks: list[int] = []
    for index in range(size):
        template = lwt["leaderTemplate"] if index == 0 else lwt["workerTemplate"]
        (vllm,) = [c for c, _ in containers(template["spec"]) if is_vllm(c)]
        (relay,) = [c for c, _ in containers(template["spec"]) if is_coordd(c) and is_relay(c)]
        rargs, _ = parse_coordd(coordd_argv(relay, lws_env(index)),
                                {**image_env(), **container_env(relay)}, monkeypatch)
        ran = run_vllm_command(vllm, {"LWS_WORKER_INDEX": str(index),
                                      "LWS_LEADER_ADDRESS": "leader.vllm-dp"}, tmp_path)
        flags = vllm_flags(ran["argv"])
        assert ran["COORDD_ADDRESS"] == rargs.bind, "the pod's ranks talk to its relay"
        assert int(str(flags["--data-parallel-size"])) == args.dp
        local = int(str(flags["--data-parallel-size-local"]))
        start = int(str(flags.get("--data-parallel-start-rank", 0)))
        assert gpus(vllm) == local, f"pod {index}: one GPU per local DP rank (TP=1)"
        assert (index == 0) != bool(flags.get("--headless")), "the leader serves the API"
        assert flags["--data-parallel-address"] == "leader.vllm-dp"
        assert sorted(parse_ranks(rargs.relay_ranks)) == list(range(start, start + local)), (
            f"pod {index}: the relay speaks for exactly the pod's DP ranks"
        )
        ranks += range(start, start + local)
    assert ranks == list(range(args.dp)), "every DP rank exactly once, in pod order"


def test_compose_runs_vllm_with_the_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    coordd, vllm = compose["services"]["coordd"], compose["services"]["vllm"]
    assert vllm["build"]["dockerfile"] == "deploy/Containerfile.vllm"
    assert vllm["image"].startswith(VLLM_IMAGE)
    args, _ = parse_coordd(["coordd", *coordd["command"]],
                           {**image_env(), **coordd.get("environment", {})}, monkeypatch)
    command = vllm["command"]
    dp = int(command[command.index("--data-parallel-size") + 1])
    (devices,) = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert dp == args.dp == devices["count"]
    assert vllm["depends_on"]["coordd"]["condition"] == "service_healthy"
    assert coordd["healthcheck"]["test"][-1] == "livez", (
        "vLLM waits for coordd to be alive; /readyz would wait for vLLM: a deadlock")


def systemd_env(env_file_text: str) -> dict[str, str]:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(DEPLOY / "systemd" / "coordd.service")
    env = dict(part.split("=", 1) for part in shlex.split(unit["Service"]["Environment"]))
    for line in env_file_text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.split("=", 1)
            env[key] = value
    return env


def test_the_env_files_tcp_switch_takes_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    """Uncommenting the documented tcp lines must change the bind: no flag on ExecStart
    overrides them."""
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(DEPLOY / "systemd" / "coordd.service")
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert argv[1:] == ["serve"], "every setting from the environment"
    text = (DEPLOY / "systemd" / "coordd.env").read_text()
    switched = "\n".join(line[2:] if line.startswith("# COORDD_") else line
                         for line in text.splitlines())
    assert switched != text
    args, _ = parse_coordd(argv, systemd_env(switched), monkeypatch)
    assert args.bind.startswith("tcp://") and args.curve_secret_key
    assert args.expect_groups == ["dp-tp0-pp0", "enginecore"]
    args, _ = parse_coordd(argv, systemd_env(text), monkeypatch)
    assert args.bind == "ipc:///run/coordd/coordd.sock"
    assert (args.metrics_port, args.log_format) == (DEFAULT_METRICS_PORT, "json")


def test_the_systemd_install_steps_work_for_a_new_user() -> None:
    text = (DEPLOY / "systemd" / "coordd.service").read_text()
    comments = [line for line in text.splitlines() if line.startswith("#")]
    install = "\n".join(comments)
    assert not any(line.rstrip().endswith("pip install coordd") for line in comments), (
        "coordd is not on PyPI"
    )
    assert ".whl" in install and "install -d" in install and "/etc/coordd" in install
