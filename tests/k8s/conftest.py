"""Fixtures for tests against a real control plane (scripts/test-cluster.sh) and the test kubelet.

- `cluster` (session): a fresh control plane, KUBECONFIG set for the session, kubectl and client helpers,
  and kubeconfigs for ServiceAccounts, so a process can run with exactly one account's RBAC rights.
- `kubelet` (session): tests/k8s/local_kubelet.py, which runs the pods bound to the fake node as local
  processes; at the end it is stopped by PID and no container process may survive it.
- `namespace` (function): a fresh `t-<random>` namespace, deleted afterwards.
A failed test that used the kubelet gets the recent container logs in its report.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import kubernetes
import pytest

REPO = Path(__file__).resolve().parents[2]
K8S_HOME = Path(os.environ.get("K8S_HOME", "/opt/k8s-local"))  # where test-cluster.sh installs, too
KUBECTL = K8S_HOME / "bin" / "kubectl"
NODE = "fake-node-1"


class KubectlError(RuntimeError):
    """kubectl exited non-zero; the message holds its arguments and stderr."""


@dataclass
class Cluster:
    kubeconfig: str  # the admin's kubeconfig (system:masters)
    config_dir: Path  # where service_account_kubeconfig writes

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, as_token: str | None = None) -> str:
        """Runs kubectl against the cluster (as the admin, or as the bearer of `as_token`); returns stdout."""
        token = [f"--token={as_token}"] if as_token else []
        result = subprocess.run([str(KUBECTL), f"--kubeconfig={self.kubeconfig}", *token, *args],
                                input=input, capture_output=True, text=True, timeout=120)
        if check and result.returncode != 0:
            raise KubectlError(f"kubectl {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
        return result.stdout

    def api_client(self) -> kubernetes.client.ApiClient:
        return kubernetes.config.new_client_from_config(config_file=self.kubeconfig)

    def service_account_token(self, namespace: str, name: str, timeout: float = 30.0) -> str:
        """The token from the ServiceAccount's token Secret, once the token controller has made it."""
        deadline = time.monotonic() + timeout
        while True:
            secret = self.kubectl("get", "serviceaccount", name, "-n", namespace,
                                  "-o", "jsonpath={.secrets[0].name}", check=False)
            token = secret and self.kubectl("get", "secret", secret, "-n", namespace,
                                            "-o", "jsonpath={.data.token}", check=False)
            if token:
                return base64.b64decode(token).decode()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no token Secret for ServiceAccount {namespace}/{name} after {timeout:.0f} s")
            time.sleep(0.2)

    def service_account_kubeconfig(self, namespace: str, name: str) -> str:
        """A kubeconfig that authenticates as the ServiceAccount (same server and CA): only its rights."""
        token = self.service_account_token(namespace, name)
        admin = json.loads(self.kubectl("config", "view", "--raw", "-o", "json"))
        user = f"system:serviceaccount:{namespace}:{name}"
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": user,
            "clusters": [{"name": "local", "cluster": admin["clusters"][0]["cluster"]}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": user, "context": {"cluster": "local", "user": user, "namespace": namespace}}],
        }
        path = self.config_dir / f"{namespace}_{name}.kubeconfig"
        path.write_text(json.dumps(config, indent=1))  # JSON is YAML
        path.chmod(0o600)
        return str(path)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    script = REPO / "scripts" / "test-cluster.sh"
    missing = [b for b in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd", "kubectl")
               if not (K8S_HOME / "bin" / b).exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing in {K8S_HOME}/bin: run scripts/test-cluster.sh install; "
                    "make test does", pytrace=False)
    started = subprocess.run(["bash", str(script), "start"], capture_output=True, text=True, timeout=300)
    if started.returncode != 0:
        pytest.fail(f"scripts/test-cluster.sh start failed:\n{started.stderr}", pytrace=False)
    kubeconfig = started.stdout.strip().splitlines()[-1].removeprefix("KUBECONFIG=")
    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = kubeconfig
    try:
        yield Cluster(kubeconfig, tmp_path_factory.mktemp("kubeconfigs"))
    finally:
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous
        subprocess.run(["bash", str(script), "stop"], capture_output=True, timeout=120)


@dataclass
class Kubelet:
    logs_dir: Path  # container logs, pid files, volumes, and the kubelet's own kubelet.log
    process: subprocess.Popen[bytes]

    def logs(self, namespace: str, pod_prefix: str) -> str:
        """Every container log of the namespace's pods named POD_PREFIX..., each under a header."""
        return "\n".join(f"----- {path.stem} -----\n{path.read_text(errors='replace')}"
                         for path in sorted(self.logs_dir.glob(f"{namespace}_{pod_prefix}*.log")))

    def pid(self, namespace: str, pod: str, container: str) -> int:
        """The PID of the container's current (or last) process."""
        return int((self.logs_dir / f"{namespace}_{pod}_{container}.pid").read_text())

    def recent_logs(self, seconds: float = 120.0, tail: int = 3000) -> str:
        """The tails of the logs written in the last `seconds`, the kubelet's own included."""
        since = time.time() - seconds
        paths = [p for p in sorted(self.logs_dir.glob("*.log")) if p.stat().st_mtime >= since]
        return "\n".join(f"----- {p.stem} -----\n{p.read_text(errors='replace')[-tail:]}" for p in paths)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report: pytest.TestReport = yield
    kubelet = getattr(item, "funcargs", {}).get("kubelet")
    if report.failed and isinstance(kubelet, Kubelet):
        report.sections.append(("test kubelet: recent logs", kubelet.recent_logs()))
    return report


def live_processes_in_groups(groups: set[int]) -> list[int]:
    """PIDs of processes (zombies aside) whose process group is one of `groups`: a container's and its children."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in groups:
            alive.append(int(stat.parent.name))
    return alive


@pytest.fixture(scope="session")
def kubelet(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kubelet]:
    # a short directory: emptyDirs live under it, and unix socket paths must fit in 108 bytes
    logs_dir = tmp_path_factory.mktemp("kubelet")
    with open(logs_dir / "kubelet.log", "wb") as own_log:
        process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("local_kubelet.py")), "--node", NODE,
             "--logs", str(logs_dir), "--kubeconfig", cluster.kubeconfig],
            stdout=own_log, stderr=subprocess.STDOUT)
    handle = Kubelet(logs_dir, process)
    deadline = time.monotonic() + 30
    while "watching pods" not in (own := (logs_dir / "kubelet.log").read_text(errors="replace")):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the test kubelet did not start watching:\n{own}", pytrace=False)
        time.sleep(0.1)
    try:
        yield handle
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        pids_file = logs_dir / "pids"
        started = {int(p) for p in pids_file.read_text().split()} if pids_file.exists() else set()
        survivors = live_processes_in_groups(started)
        for pid in survivors:  # do not leak them into the rest of the session, then fail
            os.kill(pid, signal.SIGKILL)
        assert not survivors, f"container processes outlived the test kubelet: {survivors}"


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = f"t-{secrets.token_hex(4)}"
    cluster.kubectl("create", "namespace", name)
    yield name
    # Its pods first (gracefully: the kubelet stops their processes), since the namespace controller takes
    # seconds to reach them; then waits (30 s at most) until they are gone, not for the namespace itself.
    cluster.kubectl("delete", "pods", "--all", "-n", name, "--wait=false", check=False)
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and cluster.kubectl("get", "pods", "-n", name, "-o", "name", check=False):
        time.sleep(0.5)
