"""A test kubelet: runs every pod bound to one node as real local processes, straight from the pod spec.

Why: the operator's own pod template (commands, args, env, volumes, probes) is then exactly what runs
in the k8s tests, with no container engine. What a container would give and how it is emulated here:

- Network namespace: each pod gets its own loopback address 127.0.1.N (status.podIP, never reused in a
  run), but all pods share the host's network, so a listen address on `0.0.0.0` in command, args or env
  values is rewritten to the pod IP. A process that binds all interfaces by itself would clash.
- Image: there is none, so `command` is required; it is looked up on PATH with this Python's bin
  directory first (`pagedserve` is the checkout's console script). The child gets this process's
  environment (minus KUBECONFIG: a pod has no admin credentials), PYTHONUNBUFFERED=1,
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

The pod and node side is here (volumes, credentials, status, deletion, the watch); each container's
process, probes and restarts are in kubelet_container.py.

Files in DIR: <namespace>_<pod>_<container>.log (stdout+stderr, appended across restarts, with this
kubelet's own notes), <namespace>_<pod>_<container>.pid (the running PID), `pids` (every PID started).
Usage: python local_kubelet.py --node fake-node-1 --logs DIR [--kubeconfig PATH]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
from kubelet_container import Container, Obj, now
from kubernetes.client.exceptions import ApiException

MAX_GRACE_S = 10.0
MERGE_PATCH = "application/merge-patch+json"


def as_dict(response: Any) -> Obj:
    """The JSON of a call made with `_preload_content=False` (the client's annotations promise a model)."""
    return dict(json.loads(response.data))


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
