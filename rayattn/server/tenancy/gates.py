"""What limits the router as a whole, whichever model a request names: its admission cap
(router.max_inflight), each key's rate and fair share, and the watch on its event loop. One
set per router, shared by its models' dispatchers."""

from __future__ import annotations

from dataclasses import dataclass

from rayattn.config.schema import RouterConfig
from rayattn.server.loop_watch import LoopWatch
from rayattn.server.tenancy.admission import Admission, FairQueue, RateLimits


@dataclass
class Gates:
    admission: Admission
    rates: RateLimits
    fair: FairQueue
    stalls: LoopWatch

    @classmethod
    def of(cls, rc: RouterConfig) -> Gates:
        return cls(Admission(rc.max_inflight), RateLimits(rc.key_requests_per_s),
                   FairQueue(rc.key_max_inflight), LoopWatch())

    def apply(self, rc: RouterConfig) -> None:
        if rc.max_inflight != self.admission.limit:
            # The peak is read against the limit in force: a new limit starts it again.
            self.admission.peak = self.admission.inflight
        self.admission.limit = rc.max_inflight
        self.rates.rate, self.fair.key_cap = rc.key_requests_per_s, rc.key_max_inflight
        self.fair.wake_all()

    def counts(self) -> dict[str, float]:
        return {"admitted_now": self.admission.inflight, "admitted_peak": self.admission.peak,
                **self.stalls.counts()}
