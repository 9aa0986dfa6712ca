"""Another autoscaler on the same model: a HorizontalPodAutoscaler whose `scaleTargetRef` is a PagedModel's scale
subresource. Pure: the HPAs of one namespace in, the names of those that target the model out.

The operator does not fight one (KServe's controller and an HPA fought over `spec.replicas`, kserve issue 4996):
while autoscaling is on and such an HPA exists, the loop holds the size and says why; with autoscaling off the
HPA drives `spec.replicas` through the scale subresource, as it drives a Deployment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .specs import API_GROUP


def conflicting_hpas(hpas: Iterable[Mapping[str, Any]], model_name: str) -> list[str]:
    """The names (sorted) of the HPAs that scale the PagedModel `model_name` of their own namespace. Every
    version of the HPA API (autoscaling/v1, v2) has the same `spec.scaleTargetRef`."""
    names = []
    for hpa in hpas:
        ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
        group = str(ref.get("apiVersion", "")).rpartition("/")[0]  # "pagedserve.io/v1alpha1"; "" for the core group
        if group == API_GROUP and ref.get("kind") == "PagedModel" and ref.get("name") == model_name:
            names.append(str(hpa["metadata"]["name"]))
    return sorted(names)


def conflict_message(hpa_names: Sequence[str]) -> str:
    """The ScalingConflict condition's message and the Warning Event's: the same words for the same HPAs, so
    that the Event is posted once per conflict."""
    return (f"HorizontalPodAutoscaler {', '.join(hpa_names)} also targets this PagedModel's scale subresource: "
            f"the operator holds the size while it exists (delete it, or set spec.autoscaling.enabled: false "
            f"to let it drive spec.replicas)")
