"""Where each stored `/v1/responses` answer lives.

vLLM keeps a Responses answer (and the conversation that led to it) in the memory of the
engine that produced it (engine.responses_store); a request that continues it by
`previous_response_id` can only be served there. The router remembers, per answer it
relayed, the model and the replica, and pins the continuation to it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

# Answers remembered (a few hundred bytes each): the oldest are forgotten first, and a
# continuation of one forgotten is routed as a new request (the engine answers 404 unless it
# happens to be the one holding it).
REMEMBERED = 200_000


class Home(NamedTuple):
    tenant: str
    """The API key's id that made it: no other key may continue it."""
    model: str
    replica: str


class ResponseHomes:
    def __init__(self, capacity: int = REMEMBERED) -> None:
        self.capacity = capacity
        self._homes: OrderedDict[str, Home] = OrderedDict()

    def stored(self, response_id: str, tenant: str, model: str, replica: str) -> None:
        self._homes[response_id] = Home(tenant, model, replica)
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.capacity:
            self._homes.popitem(last=False)

    def home(self, response_id: str) -> Home | None:
        return self._homes.get(response_id)
