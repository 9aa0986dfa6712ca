"""A test kubelet: runs every pod bound to one node as real local processes, straight from the pod spec.

Why: the operator's own pod template (commands, args, env, volumes, probes) is then exactly what runs
in the k8s tests, with no container engine. What a container would give and how it is emulated here:

- Network namespace: each pod gets its own loopback address 127.0.1.N (status.podIP, never reused in a
  run), but all pods share the host's network, so a listen address on `0.0.0.0` in command, args or env
  values is rewritten to the pod IP. A process that binds all interfaces by itself would clash.
- Image: there is none, so `command` is required; it is looked up on PATH with this Python's bin
  directory first (`pagedserve` is the checkout's console script). The child gets this process's
  environment (minus KUBECONFIG: a pod has no admin credentials), PYTHONUNBUFFERED=1, PYTHONSAFEPATH=1,
  then the container's env on top.
- Service account: client libraries read a mounted token at fixed paths (/var/run/secrets/...), which
  cannot be rewritten; a pod that automounts its token gets KUBECONFIG instead, a kubeconfig holding its
  ServiceAccount's token (the same identity and rights, through the same API server).
- Mounts: a volumeMount's mountPath is rewritten (longest first, as a path prefix) in command, args, env
  values and exec probes to a local directory: emptyDir is a fresh per-pod directory, hostPath is the
  path itself, configMap/secret are their keys written as files in a per-pod directory (other volume
  kinds become empty directories).
  Directories are kept short (DIR/v/<uid[:8]>/<volume>): unix socket paths must fit in 108 bytes.
- Probes (exec, httpGet, tcpSocket), restarts with backoff (1 s doubling to 10 s), status patches (so a
  Deployment's readyReplicas is right), graceful deletion (SIGTERM, SIGKILL after the grace period,
  capped at 10 s) of whole process groups. Probes and clients only ever reach the pod IP. Not supported:
  initContainers, lifecycle hooks, envFrom, valueFrom other than fieldRef/resourceFieldRef, resource limits.

Files in DIR: <namespace>_<pod>_<container>.log (stdout+stderr, appended across restarts, with this
kubelet's own notes), <namespace>_<pod>_<container>.pid (the running PID), `pids` (every PID started).
Usage: python local_kubelet.py --node fake-node-1 --logs DIR [--kubeconfig PATH]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

Obj = dict[str, Any]
MAX_GRACE_S = 10.0
MAX_BACKOFF_S = 10.0
VENV_BIN = os.path.dirname(sys.executable)
MERGE_PATCH = "application/merge-patch+json"


def as_dict(response: Any) -> Obj:
    """The JSON of a call made with `_preload_content=False` (the client's annotations promise a model)."""
    return dict(json.loads(response.data))


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined names are replaced, `$$` gives `$`, anything else stays."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
        elif text[i + 1] == "$":
            out.append("$")
            i += 2
        elif text[i + 1] == "(" and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2 : end]
            out.append(env.get(name, f"$({name})"))
            i = end + 1
        else:
            out.append(text[i : i + 2])
            i += 2
    return "".join(out)


def rewriter(mounts: dict[str, str], pod_ip: str) -> Callable[[str], str]:
    """Maps mount paths (as path prefixes, longest first) to local directories and 0.0.0.0 to the pod IP."""
    paths = sorted((p.rstrip("/") for p in mounts if p.rstrip("/")), key=len, reverse=True)
    local = {p.rstrip("/"): d for p, d in mounts.items()}
    path_re = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, paths)) + r")(?![\w.-])") if paths else None
    any_re = re.compile(r"(?<![\w.])0\.0\.0\.0(?![\w.])")

    def rewrite(text: str) -> str:
        if path_re is not None:
            text = path_re.sub(lambda m: local[m.group(1)], text)
        return any_re.sub(pod_ip, text)

    return rewrite


def _probe_opener() -> urllib.request.OpenerDirector:
    tls = ssl.create_default_context()
    tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
    return urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=tls))


PROBE_OPENER = _probe_opener()  # never through a proxy; TLS unverified, as the kubelet does


def http_ok(url: str, headers: dict[str, str], timeout: float) -> bool:
    """httpGet probe: success is 200 <= code < 400."""
    try:
        with PROBE_OPENER.open(urllib.request.Request(url, headers=headers), timeout=timeout) as response:
            return 200 <= response.status < 400
    except urllib.error.HTTPError as error:
        return 200 <= error.code < 400
    except (OSError, ValueError):
        return False


def kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class Probe:
    """One probe's schedule and consecutive counts (timeouts, thresholds and delays from its spec)."""

    def __init__(self, spec: Obj, container_start: float) -> None:
        self.spec = spec
        self.period = float(spec.get("periodSeconds", 10))
        self.timeout = float(spec.get("timeoutSeconds", 1))
        self.failure_threshold = int(spec.get("failureThreshold", 3))
        self.success_threshold = int(spec.get("successThreshold", 1))
        self.next_at = container_start + float(spec.get("initialDelaySeconds", 0))
        self.successes = self.failures = 0

    def due(self) -> bool:
        return time.monotonic() >= self.next_at

    def record(self, ok: bool) -> None:
        self.next_at = time.monotonic() + self.period
        self.successes, self.failures = (self.successes + 1, 0) if ok else (0, self.failures + 1)


class Container(threading.Thread):
    """Runs one container's process: start, probes, restarts per restartPolicy, stop on pod stop."""

    def __init__(self, pod: PodWorker, spec: Obj) -> None:
        super().__init__(daemon=True, name=f"{pod.name}/{spec['name']}")
        self.pod, self.spec, self.name = pod, spec, spec["name"]
        self.base = pod.kubelet.state_dir / f"{pod.namespace}_{pod.name}_{self.name}"
        self.restart_count, self.ready, self.started, self.ever_ran = 0, False, False, False
        self.state: Obj = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: Obj = {}
        self.env: dict[str, str] = {}
        self.rewrite: Callable[[str], str] = str
        self.cwd = str(pod.root)

    def note(self, message: str) -> None:
        with open(f"{self.base}.log", "a") as log:
            log.write(f"[local-kubelet {now()}] {message}\n")

    def set(self, **changes: Any) -> None:
        for key, value in changes.items():
            setattr(self, key, value)
        self.pod.changed.set()

    def status(self) -> Obj:
        return {"name": self.name, "image": self.spec.get("image", ""), "imageID": "", "containerID": "",
                "ready": self.ready, "started": self.started, "restartCount": self.restart_count,
                "state": self.state, "lastState": self.last_state}

    def run(self) -> None:
        backoff = 1.0
        while not self.pod.stopping.is_set():
            ran_from = time.monotonic()
            exit_code = self.start_and_supervise()
            if self.pod.stopping.is_set():
                return
            policy = self.pod.spec.get("restartPolicy", "Always")
            if policy == "Never" or (policy == "OnFailure" and exit_code == 0):
                return
            backoff = 1.0 if time.monotonic() - ran_from > MAX_BACKOFF_S else backoff
            if exit_code is not None:
                self.set(state={"waiting": {"reason": "CrashLoopBackOff",
                                            "message": f"back-off {backoff:.0f}s restarting container {self.name}"}})
            self.pod.stopping.wait(backoff)
            backoff = min(2 * backoff, MAX_BACKOFF_S)

    def prepare(self) -> list[str]:
        """Env (fieldRefs, then `$(VAR)` expansion in order) and argv, with mounts and 0.0.0.0 rewritten."""
        mounts: dict[str, str] = {}
        for mount in self.spec.get("volumeMounts", []):
            if mount["name"] not in self.pod.volumes:
                raise ValueError(f"volumeMount {mount['name']!r} names no volume of the pod")
            mounts[mount["mountPath"]] = os.path.join(self.pod.volumes[mount["name"]], mount.get("subPath", ""))
            os.makedirs(mounts[mount["mountPath"]], exist_ok=True)
        mounts = {path: local.rstrip("/") for path, local in mounts.items()}
        self.rewrite = rewriter(mounts, self.pod.ip)
        env: dict[str, str] = {}
        for var in self.spec.get("env", []):
            source = var.get("valueFrom")
            value = expand(var.get("value", ""), env) if source is None else self.pod.value_from(source, self.spec)
            env[var["name"]] = value
        self.env = {k: self.rewrite(v) for k, v in env.items()}
        if not self.spec.get("command"):
            raise ValueError(f"container {self.name} has no command: this test kubelet runs no images")
        self.cwd = self.rewrite(self.spec.get("workingDir", "")) or str(self.pod.root)
        os.makedirs(self.cwd, exist_ok=True)
        argv = self.spec["command"] + self.spec.get("args", [])
        return [self.rewrite(expand(arg, env)) for arg in argv]

    def child_env(self) -> dict[str, str]:
        inherited = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        credentials = {"KUBECONFIG": self.pod.kubeconfig} if self.pod.kubeconfig else {}
        child = {**inherited, "PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1", **credentials, **self.env}
        child["PATH"] = os.pathsep.join([VENV_BIN, child.get("PATH", os.defpath)])
        return child

    def start_and_supervise(self) -> int | None:
        """Starts the process and watches it; returns its exit code (None if it could not start)."""
        try:
            argv = self.prepare()
            with open(f"{self.base}.log", "ab") as log:
                proc = subprocess.Popen(argv, env=self.child_env(), cwd=self.cwd, stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        except (OSError, ValueError, ApiException) as error:
            reason = "CreateContainerConfigError" if isinstance(error, ValueError) else "RunContainerError"
            self.note(f"cannot start: {error}")
            self.set(state={"waiting": {"reason": reason, "message": str(error)}}, ready=False)
            return None
        Path(f"{self.base}.pid").write_text(f"{proc.pid}\n")
        with open(self.pod.kubelet.state_dir / "pids", "a") as pids:
            pids.write(f"{proc.pid}\n")
        started_at = now()
        restarts = self.restart_count + 1 if self.ever_ran else 0
        self.set(state={"running": {"startedAt": started_at}}, ready=False, restart_count=restarts, ever_ran=True)
        code = self.supervise(proc)
        exit_code = 128 - code if code < 0 else code
        terminated = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                      "startedAt": started_at, "finishedAt": now(), "containerID": ""}
        self.note(f"exited with code {exit_code}")
        self.set(state={"terminated": terminated}, last_state={"terminated": terminated}, ready=False, started=False)
        return exit_code

    def supervise(self, proc: subprocess.Popen[bytes]) -> int:
        """Polls the process and runs due probes until it exits, fails liveness, or the pod stops."""
        start = time.monotonic()
        probes = {kind: Probe(self.spec[kind], start) for kind in ("startupProbe", "livenessProbe", "readinessProbe")
                  if self.spec.get(kind)}
        if "startupProbe" not in probes:
            self.set(started=True)
        while (code := proc.poll()) is None:
            if self.pod.stopping.wait(0.05):
                return self.stop(proc)
            for kind in ("startupProbe",) if not self.started else ("livenessProbe", "readinessProbe"):
                probe = probes.get(kind)
                if probe is None or not probe.due():
                    continue
                probe.record(self.check(probe))
                if kind == "readinessProbe":
                    if probe.successes >= probe.success_threshold and not self.ready:
                        self.set(ready=True)
                    elif probe.failures >= probe.failure_threshold and self.ready:
                        self.note("readiness probe failing: not ready")
                        self.set(ready=False)
                elif probe.successes and kind == "startupProbe":
                    self.set(started=True)
                elif probe.failures >= probe.failure_threshold:
                    self.note(f"{kind} failed {probe.failures} times: restarting")
                    return self.stop(proc)
            if "readinessProbe" not in probes and self.started and not self.ready:
                self.set(ready=True)
        kill_group(proc.pid, signal.SIGKILL)  # whatever the leader left behind
        return code

    def stop(self, proc: subprocess.Popen[bytes]) -> int:
        """SIGTERM to the process group, SIGKILL after the pod's grace period."""
        kill_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(self.pod.grace_s)
        kill_group(proc.pid, signal.SIGKILL)
        return proc.wait()

    def check(self, probe: Probe) -> bool:
        spec, ip = probe.spec, self.pod.ip
        if "exec" in spec:
            argv = [self.rewrite(arg) for arg in spec["exec"]["command"]]
            try:
                child = subprocess.Popen(argv, env=self.child_env(), cwd=self.cwd, start_new_session=True,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            except OSError:
                return False
            try:
                return child.wait(probe.timeout) == 0
            except subprocess.TimeoutExpired:
                kill_group(child.pid, signal.SIGKILL)
                child.wait()
                return False
        action = spec.get("httpGet") or spec.get("tcpSocket") or {}
        port = self.port_number(action.get("port"))
        if port is None:
            return False
        if "httpGet" in spec:
            headers = {"User-Agent": "kube-probe/1.20"} | {h["name"]: h["value"] for h in action.get("httpHeaders", [])}
            scheme = action.get("scheme", "HTTP").lower()
            return http_ok(f"{scheme}://{ip}:{port}{action.get('path', '/')}", headers, probe.timeout)
        try:
            socket.create_connection((ip, port), timeout=probe.timeout).close()
            return True
        except OSError:
            return False

    def port_number(self, port: int | str | None) -> int | None:
        if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
            return int(port)
        named = [p["containerPort"] for p in self.spec.get("ports", []) if p.get("name") == port]
        return named[0] if named else None


class PodWorker(threading.Thread):
    """One pod: its volumes, its containers' threads, its status patches, its deletion."""

    def __init__(self, kubelet: Kubelet, pod: Obj, ip: str) -> None:
        meta = pod["metadata"]
        super().__init__(daemon=True, name=f"{meta['namespace']}/{meta['name']}")
        self.kubelet, self.pod, self.spec, self.ip = kubelet, pod, pod["spec"], ip
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.root = kubelet.state_dir / "v" / self.uid[:8]
        self.grace_s = min(float(self.spec.get("terminationGracePeriodSeconds", 30)), MAX_GRACE_S)
        self.stopping, self.changed = threading.Event(), threading.Event()
        self.finalise = False
        self.volumes: dict[str, str] = {}
        self.kubeconfig = ""  # the ServiceAccount's credentials, when the pod automounts them
        self.containers = [Container(self, c) for c in self.spec["containers"]]
        self.start_time = now()
        self.conditions: dict[str, tuple[bool, str]] = {}
        self.patched: Obj | None = None

    def request_stop(self, grace_s: float | None, finalise: bool) -> None:
        if grace_s is not None:
            self.grace_s = min(grace_s, MAX_GRACE_S)
        self.finalise = self.finalise or finalise
        self.stopping.set()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.prepare_volumes()
                break
            except (ApiException, OSError, ValueError) as error:
                for container in self.containers:
                    container.set(state={"waiting": {"reason": "ContainerCreating", "message": str(error)}})
                self.patch_status()
                self.stopping.wait(1.0)
        else:
            self.containers = []
        for container in self.containers:
            container.start()
        while any(c.is_alive() for c in self.containers):
            self.changed.wait(0.5)
            self.changed.clear()
            if not self.stopping.is_set():
                self.patch_status()
        if not self.stopping.is_set():
            self.patch_status()  # every container ended for good (restartPolicy Never or OnFailure)
        shutil.rmtree(self.root, ignore_errors=True)
        if self.finalise:
            try:
                # with a body, the API server reads only the body: gracePeriodSeconds must be in it
                options = kubernetes.client.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=kubernetes.client.V1Preconditions(uid=self.uid))
                self.kubelet.api.delete_namespaced_pod(self.name, self.namespace, body=options)
            except ApiException as error:
                if error.status not in (404, 409):
                    raise

    def prepare_credentials(self) -> None:
        """A kubeconfig with the pod's ServiceAccount token (ValueError until the token controller made it)."""
        if self.spec.get("automountServiceAccountToken") is False:
            return
        account = self.spec.get("serviceAccountName") or "default"
        found = as_dict(self.kubelet.api.read_namespaced_service_account(account, self.namespace,
                                                                         _preload_content=False))
        secrets = [s["name"] for s in found.get("secrets") or []]
        if not secrets:
            raise ValueError(f"ServiceAccount {account} has no token Secret yet")
        token = base64.b64decode(self.read("secret", secrets[0], False)["data"]["token"]).decode()
        user = f"system:serviceaccount:{self.namespace}:{account}"
        config = {"apiVersion": "v1", "kind": "Config", "current-context": user,
                  "clusters": [{"name": "cluster", "cluster": self.kubelet.cluster}],
                  "users": [{"name": user, "user": {"token": token}}],
                  "contexts": [{"name": user, "context": {"cluster": "cluster", "user": user,
                                                          "namespace": self.namespace}}]}
        path = self.root / "serviceaccount.kubeconfig"
        path.write_text(json.dumps(config))  # JSON is YAML
        path.chmod(0o600)
        self.kubeconfig = str(path)

    def prepare_volumes(self) -> None:
        """Local directories for the pod's volumes; configMap and secret keys become files."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.prepare_credentials()
        for volume in self.spec.get("volumes", []):
            name, path = volume["name"], self.root / volume["name"]
            if "hostPath" in volume:
                self.volumes[name] = volume["hostPath"]["path"]
                if volume["hostPath"].get("type") == "DirectoryOrCreate":
                    os.makedirs(self.volumes[name], exist_ok=True)
                continue
            path.mkdir(parents=True, exist_ok=True)
            self.volumes[name] = str(path)
            files: dict[str, bytes] = {}
            if "configMap" in volume or "secret" in volume:
                source = volume.get("configMap") or volume["secret"]
                data = self.read("secret" if "secret" in volume else "configMap",
                                 source.get("name") or source["secretName"], bool(source.get("optional")))
                files = {k: base64.b64decode(v) for k, v in data.get("binaryData", {}).items()}
                decode: Callable[[str], bytes] = base64.b64decode if "secret" in volume else str.encode
                files.update({k: decode(v) for k, v in data.get("data", {}).items()})
                if source.get("items"):
                    files = {item["path"]: files[item["key"]] for item in source["items"] if item["key"] in files}
            for relative, content in files.items():
                (path / relative).parent.mkdir(parents=True, exist_ok=True)
                (path / relative).write_bytes(content)

    def read(self, kind: str, name: str, optional: bool) -> Obj:
        reader = (self.kubelet.api.read_namespaced_secret if kind == "secret"
                  else self.kubelet.api.read_namespaced_config_map)
        try:
            return as_dict(reader(name, self.namespace, _preload_content=False))
        except ApiException as error:
            if error.status == 404 and optional:
                return {}
            raise

    def field(self, path: str) -> str:
        meta = self.pod["metadata"]
        values = {"metadata.name": self.name, "metadata.namespace": self.namespace, "metadata.uid": self.uid,
                  "status.podIP": self.ip, "status.hostIP": "127.0.0.1", "spec.nodeName": self.spec.get("nodeName", ""),
                  "spec.serviceAccountName": self.spec.get("serviceAccountName", "")}
        if path in values:
            return values[path]
        if m := re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path):
            return str(meta.get(m.group(1), {}).get(m.group(2), ""))
        raise ValueError(f"unsupported fieldRef {path!r}")

    def value_from(self, source: Obj, container: Obj) -> str:
        if "fieldRef" in source:
            return self.field(source["fieldRef"]["fieldPath"])
        if "resourceFieldRef" in source:  # the raw quantity, divisor ignored
            ref = source["resourceFieldRef"]
            name = ref.get("containerName", container["name"])
            owner = next((c for c in self.spec["containers"] if c["name"] == name), container)
            kind, _, resource = ref["resource"].partition(".")
            return str(owner.get("resources", {}).get(kind, {}).get(resource, ""))
        raise ValueError(f"unsupported valueFrom {source} (fieldRef and resourceFieldRef only)")

    def condition(self, kind: str, value: bool) -> Obj:
        if self.conditions.get(kind, (None, ""))[0] is not value:
            self.conditions[kind] = (value, now())
        return {"type": kind, "status": str(value), "lastTransitionTime": self.conditions[kind][1]}

    def patch_status(self) -> None:
        statuses = [c.status() for c in self.containers]
        ready = bool(statuses) and all(s["ready"] for s in statuses)
        ended = [s["state"].get("terminated") for s in statuses]
        if statuses and all(ended) and not any(c.is_alive() for c in self.containers):
            phase = "Succeeded" if all(t["exitCode"] == 0 for t in ended if t) else "Failed"
        else:
            phase = "Running" if all(c.ever_ran for c in self.containers) else "Pending"
        status = {"phase": phase, "podIP": self.ip, "podIPs": [{"ip": self.ip}], "hostIP": "127.0.0.1",
                  "startTime": self.start_time, "containerStatuses": statuses,
                  "conditions": [self.condition("PodScheduled", True), self.condition("Initialized", True),
                                 self.condition("ContainersReady", ready), self.condition("Ready", ready)]}
        if status == self.patched:
            return
        try:
            self.kubelet.api.patch_namespaced_pod_status(self.name, self.namespace, {"status": status},
                                                         _content_type=MERGE_PATCH)
            self.patched = status
        except ApiException as error:
            if error.status == 404:
                self.request_stop(None, finalise=False)
            elif error.status != 409:
                print(f"status patch of {self.namespace}/{self.name} failed: {error.status} {error.reason}")
        except Exception as error:  # API unreachable: self.patched stays stale, so the next tick retries
            print(f"status patch of {self.namespace}/{self.name} failed: {error!r}")


class Kubelet:
    """Keeps one PodWorker per pod uid bound to the node; hands out loopback pod IPs."""

    def __init__(self, api: kubernetes.client.CoreV1Api, node: str, state_dir: Path, cluster: Obj) -> None:
        self.api, self.node, self.state_dir = api, node, state_dir
        self.cluster = cluster  # the API server and its CA, as a kubeconfig's cluster entry
        self.workers: dict[str, PodWorker] = {}  # every pod seen in this run, by uid (a uid never comes back)
        self.ips_given = 0
        self.lock = threading.Lock()
        self.closed = False

    def next_ip(self) -> str:
        k, self.ips_given = self.ips_given, self.ips_given + 1
        return f"127.0.{1 + k // 250}.{2 + k % 250}"

    def sync(self, pod: Obj) -> None:
        with self.lock:
            if not self.closed:
                self._sync(pod)

    def _sync(self, pod: Obj) -> None:
        meta, worker = pod["metadata"], self.workers.get(pod["metadata"]["uid"])
        deleting = meta.get("deletionTimestamp") is not None
        grace = meta.get("deletionGracePeriodSeconds")
        if worker is not None:
            if deleting:
                worker.request_stop(None if grace is None else float(grace), finalise=True)
        elif deleting:  # nothing of it runs here: confirm the deletion at once
            try:
                self.api.delete_namespaced_pod(meta["name"], meta["namespace"], grace_period_seconds=0)
            except ApiException as error:
                if error.status not in (404, 409):
                    raise
        elif pod.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
            worker = self.workers[meta["uid"]] = PodWorker(self, pod, self.next_ip())
            print(f"running {meta['namespace']}/{meta['name']} at {worker.ip}")
            worker.start()

    def resync(self, pods: list[Obj]) -> None:
        for pod in pods:
            self.sync(pod)
        for uid in set(self.workers) - {p["metadata"]["uid"] for p in pods}:
            self.forget(uid)

    def forget(self, uid: str) -> None:
        """The pod is gone from the API: stop what runs of it (nothing to finalise)."""
        with self.lock:
            if uid in self.workers:
                self.workers[uid].request_stop(None, finalise=False)

    def stop_all(self) -> None:
        with self.lock:
            self.closed = True
        for worker in self.workers.values():
            worker.request_stop(None, finalise=False)
        for worker in self.workers.values():
            worker.join()


def watch_pods(kubelet: Kubelet, stop: threading.Event) -> None:
    """List, then watch from that list's resourceVersion; re-list on expiry, errors or ERROR events."""
    selector, announced = f"spec.nodeName={kubelet.node}", False
    api = kubelet.api
    while not stop.is_set():
        try:
            listing = as_dict(api.list_pod_for_all_namespaces(field_selector=selector, _preload_content=False))
            kubelet.resync(listing["items"])
            if not announced:
                print(f"watching pods on node {kubelet.node}")
                announced = True
            for event in kubernetes.watch.Watch().stream(
                api.list_pod_for_all_namespaces, field_selector=selector, timeout_seconds=30,
                resource_version=listing["metadata"]["resourceVersion"],
            ):
                if stop.is_set() or event["type"] == "ERROR":
                    break
                pod = event["raw_object"]
                if event["type"] == "DELETED":
                    kubelet.forget(pod["metadata"]["uid"])
                else:
                    kubelet.sync(pod)
        except Exception as error:  # the watch must outlive any API hiccup: re-list after a pause
            print(f"watch failed, re-listing: {error!r}")
            stop.wait(1.0)


def current_cluster(kubeconfig: str | None) -> Obj:
    """The current context's cluster entry (server, CA) of the kubeconfig (or $KUBECONFIG)."""
    import yaml

    path = kubeconfig or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    config = yaml.safe_load(Path(path).read_text())
    context = next(c["context"] for c in config["contexts"] if c["name"] == config["current-context"])
    return dict(next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"]))


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--node", default="fake-node-1")
    parser.add_argument("--logs", required=True, type=Path, help="container logs, pid files and volumes")
    parser.add_argument("--kubeconfig", default=None)
    args = parser.parse_args()
    kubernetes.config.load_kube_config(config_file=args.kubeconfig)
    args.logs.mkdir(parents=True, exist_ok=True)
    kubelet = Kubelet(kubernetes.client.CoreV1Api(), args.node, args.logs.resolve(), current_cluster(args.kubeconfig))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    threading.Thread(target=watch_pods, args=(kubelet, stop), daemon=True, name="watch").start()
    while not stop.wait(1.0):
        pass
    kubelet.stop_all()
    print("stopped every container")
    return 0


if __name__ == "__main__":
    sys.exit(main())
