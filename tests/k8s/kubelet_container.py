"""The container side of the test kubelet (local_kubelet.py): one container's process from its spec, with
Kubernetes' `$(VAR)` expansion, mount paths and 0.0.0.0 rewritten (the emulation of a container's
filesystem and network namespace, explained in local_kubelet.py), its probes, and restarts with backoff.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
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
from typing import TYPE_CHECKING, Any

from kubernetes.client.exceptions import ApiException

if TYPE_CHECKING:
    from local_kubelet import PodWorker

Obj = dict[str, Any]
MAX_BACKOFF_S = 10.0
VENV_BIN = os.path.dirname(sys.executable)


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
        child = {**inherited, "PYTHONUNBUFFERED": "1", **credentials, **self.env}
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
