"""`pagedserve delete-models`: delete PagedModels and wait until the operator has released them.

Why it exists: the operator keeps a finalizer on every PagedModel (kopf stops the model's loop before the
object goes). `helm uninstall` deletes the operator's Deployment before the custom resources, so without
this step a PagedModel would wait forever for an operator that is gone, and its GPU pods would keep
running. The chart runs this as a pre-delete hook, while the operator still runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, cast

import kubernetes
from kubernetes.client.rest import ApiException

from .kube import load_credentials
from .specs import API_GROUP, API_VERSION


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", required=True, help="where the PagedModels are")
    parser.add_argument("--selector", "-l", default="", help="label selector of the PagedModels to delete")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for them to be gone")


def main(args: argparse.Namespace) -> None:
    load_credentials()
    api = kubernetes.client.CustomObjectsApi()

    def names() -> list[str]:
        found = cast(dict[str, Any], api.list_namespaced_custom_object(
            API_GROUP, API_VERSION, args.namespace, "pagedmodels", label_selector=args.selector))
        return sorted(item["metadata"]["name"] for item in found.get("items", []))

    for name in names():
        try:
            api.delete_namespaced_custom_object(API_GROUP, API_VERSION, args.namespace, "pagedmodels", name)
            print(f"deleting pagedmodel {args.namespace}/{name}", flush=True)
        except ApiException as exc:
            if exc.status != 404:
                raise
    deadline = time.monotonic() + args.timeout
    while left := names():
        if time.monotonic() > deadline:
            sys.exit(f"still there after {args.timeout:.0f} s (is the operator running?): {', '.join(left)}")
        time.sleep(1.0)
    print("every PagedModel is gone", flush=True)
