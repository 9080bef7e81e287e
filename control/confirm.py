"""One confirmation rule for ambiguous signs (a Jobs API that does not answer, a job the cluster does not know): a
blip of the observer's path -- a proxy's 502, a restarting dashboard, an auth hiccup -- must not restart a healthy
job, so such a sign is acted on only once it held for a while over several looks, as a Kubernetes controller acts
only on what held across observations. The finetune flow's watch and the watchdog both judge by it; each says how
long and over how many looks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Suspicion:
    """An ambiguous sign seen since ``first_at`` (seconds, on the caller's clock), in ``observations`` looks."""

    first_at: float
    observations: int = 0

    def seen(self) -> Suspicion:
        """One more look that showed the sign."""
        self.observations += 1
        return self

    def held_s(self, now: float) -> float:
        return now - self.first_at

    def held(self, now: float, confirm_s: float, min_observations: int) -> bool:
        """Whether the sign is confirmed: it held for ``confirm_s`` and was seen in at least ``min_observations``
        looks (a long gap between two looks is not two looks' worth of evidence)."""
        return self.held_s(now) >= confirm_s and self.observations >= min_observations
