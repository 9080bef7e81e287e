"""The Kubernetes objects the ``kuberay`` backend sends and reads. What it reads of a RayCluster is typed
(``RayCluster``: its name, the annotations naming its run, KubeRay's status); what it sends is a ``Manifest`` -- a
JSON object built in control/backends/kubemanifests.py and validated by the client against its own models on the way out,
so this side keeps it opaque."""

from __future__ import annotations

from typing import TypedDict

Manifest = dict[str, object]  # a Kubernetes object to send (the client's pydantic validate_call checks its shape)


class Condition(TypedDict, total=False):
    type: str
    status: str  # "True" | "False" | "Unknown"
    message: str


class RayClusterStatus(TypedDict, total=False):
    """KubeRay's ``status`` of a RayCluster, the fields unbroken reads."""

    state: str  # "ready" once every pod runs
    reason: str
    conditions: list[Condition]


class ObjectMeta(TypedDict, total=False):
    name: str
    namespace: str
    labels: dict[str, str]
    annotations: dict[str, str]


class RayCluster(TypedDict, total=False):
    """A RayCluster as the API server returns it (the client decodes it to a dict and annotates ``object``)."""

    metadata: ObjectMeta
    status: RayClusterStatus


class RayClusterList(TypedDict, total=False):
    items: list[RayCluster]
