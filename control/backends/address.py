"""Backend ``address``: a Ray cluster someone else runs, reached at ``cluster.address`` (its Jobs API). unbroken
neither creates nor removes it: ``up`` only checks that it answers, ``down`` leaves it as it was."""

from __future__ import annotations

from control.backends.base import Backend, ClusterHandle, ClusterUnreachable, reachable
from ray_jobs.config import ClusterConfig


class Address(Backend):
    name = "address"
    mode = "existing"

    @classmethod
    def problems(cls, cluster: ClusterConfig, storage: str) -> list[str]:
        if cluster.address:
            return []
        return ["cluster.address: cluster.backend is address, but no address is given (http://head:8265)"]

    def spec(self) -> dict:
        return {"address": self.cfg.cluster.address}

    def up(self, run: str | None = None) -> ClusterHandle:
        address = self.cfg.cluster.address
        why = reachable(address)
        if why:
            raise ClusterUnreachable(f"cluster.address {address} is not reachable: {why}")
        return self._handle(address, False)

    def address(self) -> str | None:
        return self.cfg.cluster.address if reachable(self.cfg.cluster.address) is None else None

    def down(self, handle: ClusterHandle, run: str | None = None) -> str:
        return f"left the Ray cluster at {handle.address} running (not unbroken's to stop)"


BACKEND = Address
