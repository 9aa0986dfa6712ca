"""What the e2e tests do in a namespace of their own (test_*_e2e.py): kubectl in it, objects as JSON, the ready
pods, and `pagedserve operator` run as the chart's ServiceAccount, stopped as a pod would be."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from polling import free_port


class Namespaced:
    def __init__(self, cluster: Any, kubelet: Any, namespace: str) -> None:
        self.cluster, self.kubelet, self.namespace = cluster, kubelet, namespace

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        return str(self.cluster.kubectl("-n", self.namespace, *args, input=input, check=check))

    def get(self, kind: str, name: str = "") -> Any:
        out = self.kubectl("get", kind, *([name] if name else []), "-o", "json", check=False)
        return json.loads(out) if out.strip() else None

    def apply(self, manifest: dict[str, Any]) -> str:
        # the API server validates, not kubectl (1.34 would check the 1.20 schema itself, and say it differently)
        return self.kubectl("apply", "--validate=false", "-f", "-", input=json.dumps(manifest))

    def ready_pods(self, component: str | None = None) -> list[dict[str, Any]]:
        """Ready pods not being deleted; with `component`, only those of that app.kubernetes.io/component."""
        return [p for p in self.get("pods")["items"]
                if (component is None or p["metadata"]["labels"].get("app.kubernetes.io/component") == component)
                and not p["metadata"].get("deletionTimestamp") and any(
                    c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))]

    def launch_operator(self, log: Path, interval: float, *args: str) -> tuple[subprocess.Popen[str], int]:
        """`pagedserve operator` over this namespace as the ServiceAccount `pagedserve-operator` (exactly the
        chart's RBAC rights), its output appended to `log`: the process and its health port."""
        kubeconfig = self.cluster.service_account_kubeconfig(self.namespace, "pagedserve-operator")
        port = free_port()
        operator = subprocess.Popen(
            [sys.executable, "-m", "pagedserve", "operator", "--namespace", self.namespace, "--interval", str(interval),
             "--scrape-timeout", "0.5", "--health-listen", f"127.0.0.1:{port}", *args],
            stdout=log.open("a"), stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "KUBECONFIG": str(kubeconfig)})
        return operator, port


def stop(process: subprocess.Popen[str] | None) -> None:
    """SIGTERM, as the kubelet sends, then SIGKILL after 30 s."""
    if process is not None and process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class WithOperator(Namespaced):
    """A namespace with one operator, polling every second, its log in the kubelet's logs folder."""

    def __init__(self, cluster: Any, kubelet: Any, namespace: str) -> None:
        super().__init__(cluster, kubelet, namespace)
        self.operator: subprocess.Popen[str] | None = None
        self.log = Path(kubelet.logs_dir) / f"operator-{namespace}.log"

    def start_operator(self) -> None:
        self.operator, _ = self.launch_operator(self.log, 1)

    def stop_operator(self) -> None:
        stop(self.operator)

    def operator_log_tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else ""
