"""Affinity's model of what a replica choice costs, refitted online from engine timings."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class CostModel:
    prefill_s_per_token: float
    ctx_s_per_token: float
    decode_s_per_request: float
    reload_fraction: float = 0.1
    """What reloading a token from an engine's host KV tier costs, as a fraction of
    prefilling it: a copy over the host link instead of the model's compute."""
    adapter_load_s: float = 0.25
    """Loading a LoRA adapter into an engine that does not hold it (read from disk, copied
    into the engine's LoRA buffers): the price of sending a request for it elsewhere than
    where it runs already. Not refitted: the engines report no load times."""
    alpha: float = 0.2
    window: int = 64
    """Finished prefills per engine that the prefill rate is measured over."""
    output_tokens: float | None = None
    """Output tokens a request ran to, averaged over finished requests (None until one
    finishes): what a running request still has to decode, where max_tokens is only a cap
    (256 where a client sends none, thousands from agent clients)."""
    _spans: dict[str, deque[tuple[float, float, int]]] = field(
        default_factory=dict, init=False, repr=False)
    _rates: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def observe_prefill(self, engine: str, start: float, end: float,
                        computed_tokens: int) -> None:
        """Refit c_prefill from an engine's prefill throughput: over its last `window`
        prefills, the time during which any of them was in progress (the union of their
        scheduled → first-token spans, on the engine's own clock) per token they computed.
        One request's span alone covers every prompt batched with it: a cache hit that
        computed a few tokens next to cold prompts took seconds, which per token is many
        times the engine's rate and made every queued prefill look prohibitive. The fleet's rate is
        the upper median engine's (of two engines the slower one's: pricing prefill on the
        slow side keeps conversations home). Only this router's requests are measured; with
        several routers sharing an engine the others' prefills fill the same spans, so the
        rate errs slow (docs/routing.md)."""
        if end <= start or computed_tokens < 0:
            return
        spans = self._spans.setdefault(engine, deque(maxlen=self.window))
        spans.append((start, end, computed_tokens))
        tokens = sum(n for _, _, n in spans)
        if tokens < 256:  # too little to measure: keep what we have
            return
        busy, reach = 0.0, float("-inf")
        for a, b, _ in sorted(spans):
            if b > reach:
                busy += b - max(a, reach)
                reach = b
        self._rates[engine] = busy / tokens
        self._refit_fleet()

    @property
    def reload_s_per_token(self) -> float:
        return self.prefill_s_per_token * self.reload_fraction

    def forget(self, engine: str) -> None:
        """A departed engine's rate must not stay in the fleet's median."""
        self._spans.pop(engine, None)
        if self._rates.pop(engine, None) is not None:
            self._refit_fleet()

    def _refit_fleet(self) -> None:
        if self._rates:
            rates = sorted(self._rates.values())
            self.prefill_s_per_token = rates[len(rates) // 2]

    def observe_decode(self, itl_s: float | None, running: int = 1) -> None:
        """Refit what one in-flight request costs a newcomer: the marginal step time of one
        more co-running sequence, i.e. the observed inter-token latency shared by the
        sequences that were running (the whole ITL would charge each of them a full step
        and make the router flee any replica holding a few decodes)."""
        if itl_s is None or itl_s <= 0:
            return
        per_seq = min(itl_s / max(running, 1), max(self.decode_s_per_request, 1e-3) * 10)
        self.decode_s_per_request += self.alpha * (per_seq - self.decode_s_per_request)

    def observe_output(self, tokens: int) -> None:
        """A request finished after generating `tokens`."""
        if tokens <= 0:
            return
        if self.output_tokens is None:
            self.output_tokens = float(tokens)
        else:
            self.output_tokens += self.alpha * (tokens - self.output_tokens)

    def expected_output(self, max_tokens: int) -> float:
        """Output a request will run to: the measured average, at most its cap."""
        return max_tokens if self.output_tokens is None else min(self.output_tokens, max_tokens)

    def request_decode_s(self, max_tokens: int) -> float:
        """A running request's decode, in steps of its batch priced per sequence: what a
        newcomer waits, per running request, for a place (a batch slot, an adapter slot)."""
        return self.expected_output(max_tokens) * self.decode_s_per_request
