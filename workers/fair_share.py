"""`FairShare`: which tenant's requests a worker runs next, by weighted virtual token counters.

After the virtual token counter of Sheng et al., "Fairness in Serving Large Language Models"
(OSDI 2024). Each tenant has a counter of the service it received, in cost units divided by
its weight; the next request comes from the backlogged tenant with the smallest counter. The
cost of a request is what the worker pays for it: the tokens its forward pass computes plus a
fixed cost per call. A request is charged its estimate when picked (so that the rest of the
same batch is chosen fairly) and corrected once the forward pass reports what it computed
(a prefix found in the KV cache costs less than its length); the estimate is its length times
the share of their length that its tenant's requests computed lately (`observe`).

* No credit for idling: a tenant that becomes backlogged again has its counter lifted to the
  smallest counter of the backlogged tenants (or, with none, to where the last one left off),
  so time spent idle is not saved up to crowd others out later.
* Work-conserving: a tenant alone gets every slot; an idle tenant's share goes to the others.
* Bound: while two tenants stay backlogged, their counters differ by at most one request's
  largest cost over the smaller weight (the paper's bound is 2x the largest request's cost).

Pure logic with no I/O: the worker adds entries as it reads them, asks for a batch, and
reports each batch's actual costs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["FairShare", "Pick"]

T = TypeVar("T")

#: The weight of the latest forward in a tenant's computed share (`FairShare.observe`).
_SHARE_WEIGHT = 0.5


@dataclass(slots=True)
class Pick(Generic[T]):
    """One request chosen for a batch: whose it is, the item, and the cost charged for it (a
    value, made once a request: not declared frozen, as `lmqueue.shared.wire.Request`)."""

    tenant: str
    item: T
    tokens: int
    charged: float


@dataclass(slots=True)
class _Tenant(Generic[T]):
    weight: float
    counter: float
    queue: deque[tuple[T, int]] = field(default_factory=deque)
    served_cost: float = 0.0
    #: What its forwards computed per token its requests' envelopes named, lately (`observe`).
    computed_share: float = 1.0


class FairShare(Generic[T]):
    """Weighted fair queuing of tenants' requests by virtual token counters.

    Args:
        call_cost_tokens: cost of one request beyond its tokens, in tokens (the per-call
            overhead of a forward pass row, reply and bookkeeping).
        weights: initial weights by tenant (default 1 each; change with `set_weight`).
    """

    def __init__(
        self, call_cost_tokens: float = 0.0, weights: Mapping[str, float] | None = None
    ) -> None:
        if call_cost_tokens < 0:
            raise ValueError("call_cost_tokens must be >= 0")
        self.call_cost_tokens = call_cost_tokens
        self._tenants: dict[str, _Tenant[T]] = {}
        self._floor = 0.0  # where the last backlogged tenant left off
        for tenant, weight in (weights or {}).items():
            self.set_weight(tenant, weight)

    # -- tenants -----------------------------------------------------------------------------------
    def set_weight(self, tenant: str, weight: float) -> None:
        """Give `tenant` this weight from now on (a tenant of weight 2 gets twice the share)."""
        if not weight > 0:
            raise ValueError(f"weight of {tenant!r} must be > 0: {weight!r}")
        state = self._tenants.get(tenant)
        if state is None:
            self._tenants[tenant] = _Tenant(weight, self._lift_level())
        else:
            state.weight = weight

    def weight(self, tenant: str) -> float:
        """The tenant's weight (1 for a tenant never seen)."""
        state = self._tenants.get(tenant)
        return state.weight if state else 1.0

    def counter(self, tenant: str) -> float:
        """The tenant's virtual counter: service received divided by weight, plus lifts."""
        return self._tenants[tenant].counter

    def served_cost(self, tenant: str) -> float:
        """Total cost charged to the tenant so far (not divided by weight)."""
        state = self._tenants.get(tenant)
        return state.served_cost if state else 0.0

    def backlog(self, tenant: str | None = None) -> int:
        """Requests waiting: of one tenant, or of all."""
        if tenant is not None:
            state = self._tenants.get(tenant)
            return len(state.queue) if state else 0
        return sum(len(state.queue) for state in self._tenants.values())

    def backlogged(self) -> list[str]:
        """Tenants with requests waiting."""
        return [name for name, state in self._tenants.items() if state.queue]

    def queued(self) -> list[T]:
        """Every request waiting, of every tenant (not picked yet)."""
        return [item for state in self._tenants.values() for item, _ in state.queue]

    def wanting(self, tenants: Iterable[str], depth: int) -> list[str]:
        """Of `tenants`, those with fewer than `depth` requests waiting: the streams to read."""
        return [tenant for tenant in tenants if self.backlog(tenant) < depth]

    # -- requests ----------------------------------------------------------------------------------
    def add(self, tenant: str, item: T, tokens: int, credit: float = 0.0) -> None:
        """Queue one request of `tokens` prompt tokens; lift a returning tenant's counter.

        `credit` (cost units) is how much of what it was owed a tenant coming back from idle
        keeps: a closed loop idles only between its replies and its next calls, each round,
        and lifted to the others' level every time it would get less than its share though
        it asks for no more (the caller bounds the credit: one batch's worth at most).
        """
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant(1.0, self._lift_level())
        elif not state.queue:
            state.counter = max(state.counter, self._lift_level() - credit / state.weight)
        state.queue.append((item, tokens))

    def cost(self, tokens: float) -> float:
        """The cost of a request that computes `tokens` tokens."""
        return tokens + self.call_cost_tokens

    def cost_of(self, prompts: int, tokens: int) -> float:
        """The cost of computing `prompts` distinct prompts of `tokens` tokens in all."""
        return tokens + prompts * self.call_cost_tokens

    def pick(self, batch_size: int, max_batch_tokens: int | None = None) -> list[Pick[T]]:
        """Up to `batch_size` requests, smallest counter first, charging each its estimate.

        A request that would take the batch past `max_batch_tokens` ends it, unless the batch
        is empty (a long prompt still runs, alone).
        """
        picks: list[Pick[T]] = []
        tokens_total = 0
        while len(picks) < batch_size:
            tenant = self._next_tenant()
            if tenant is None:
                break
            state = self._tenants[tenant]
            item, tokens = state.queue[0]
            if picks and max_batch_tokens is not None and tokens_total + tokens > max_batch_tokens:
                break
            state.queue.popleft()
            tokens_total += tokens
            charged = self.cost(tokens * state.computed_share)
            self._charge(tenant, charged)
            picks.append(Pick(tenant, item, tokens, charged))
            if not state.queue and not self._lift_level_of_backlogged():
                self._floor = max(self._floor, state.counter)  # the last one left off here
        return picks

    def observe(self, tenant: str, named_tokens: int, computed_tokens: int) -> None:
        """A forward computed `computed_tokens` for requests of `tenant` whose envelopes named
        `named_tokens`: its next requests are estimated at that share (a moving average), so
        that a batch holds as many of its requests as their cost, not their length, allows.

        A sampler's prompts extend its last step's, whose KV the backend kept: charged their
        whole length when picked, its next step shared a forward with several times fewer of
        its rows than its work deserved, and waited for more forwards (BENCHMARKS.md,
        fairness, real model). An envelope may lie about its length; the share then grows,
        and the charge is corrected after the forward either way (`adjust`).
        """
        state = self._tenants.get(tenant)
        if state is not None and named_tokens > 0:
            share = computed_tokens / named_tokens
            state.computed_share += _SHARE_WEIGHT * (share - state.computed_share)

    def settle(self, pick: Pick[T], tokens_computed: int) -> None:
        """Correct a pick's charge to what its forward pass actually computed."""
        self._charge(pick.tenant, self.cost(tokens_computed) - pick.charged)

    def adjust(self, tenant: str, cost: float) -> None:
        """Add `cost` (negative: take back) to what `tenant` was charged."""
        if tenant in self._tenants:
            self._charge(tenant, cost)

    def refund(self, pick: Pick[T]) -> None:
        """Take back a pick's whole charge (answered without computing: a cache hit)."""
        self._charge(pick.tenant, -pick.charged)

    # -- internals ---------------------------------------------------------------------------------
    def _charge(self, tenant: str, cost: float) -> None:
        state = self._tenants[tenant]
        state.counter += cost / state.weight
        state.served_cost += cost

    def _next_tenant(self) -> str | None:
        best: str | None = None
        best_counter = 0.0
        for name, state in self._tenants.items():
            if state.queue and (best is None or state.counter < best_counter):
                best, best_counter = name, state.counter
        return best

    def _lift_level(self) -> float:
        """The smallest counter of the backlogged tenants, else where the last one left off."""
        self._lift_level_of_backlogged()
        return self._floor

    def _lift_level_of_backlogged(self) -> bool:
        """Raise the floor to the smallest backlogged counter; False if none is backlogged."""
        counters = [state.counter for state in self._tenants.values() if state.queue]
        if counters:
            self._floor = max(self._floor, min(counters))
        return bool(counters)
