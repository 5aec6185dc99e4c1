"""FairShare: weighted virtual token counters choose which tenant's requests run next."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmqueue.workers.fair_share import FairShare


def _serve(share: FairShare[int], batches: int, batch_size: int = 8) -> dict[str, float]:
    """Run `batches` batches, each charged as estimated; tokens served per tenant."""
    served: dict[str, float] = {}
    for _ in range(batches):
        for pick in share.pick(batch_size):
            served[pick.tenant] = served.get(pick.tenant, 0) + pick.tokens
    return served


def _flood(share: FairShare[int], tenant: str, count: int, tokens: int = 10) -> None:
    for i in range(count):
        share.add(tenant, i, tokens)


def test_two_backlogged_tenants_of_weights_1_and_2_are_served_1_to_2() -> None:
    share: FairShare[int] = FairShare(call_cost_tokens=4, weights={"a": 1, "b": 2})
    _flood(share, "a", 5000)
    _flood(share, "b", 5000)
    served = _serve(share, 300)
    assert served["b"] / served["a"] == pytest.approx(2.0, rel=0.02)


def test_a_tenant_alone_gets_every_slot() -> None:
    share: FairShare[int] = FairShare(weights={"a": 1, "b": 5})
    _flood(share, "a", 20)
    picks = share.pick(16)
    assert [p.tenant for p in picks] == ["a"] * 16
    assert [p.item for p in picks] == list(range(16))  # each tenant's order is kept


def test_a_flood_does_not_delay_a_light_tenant_behind_it() -> None:
    share: FairShare[int] = FairShare()
    _flood(share, "flood", 2000)
    share.pick(32)
    share.add("light", 0, 10)
    assert "light" in [p.tenant for p in share.pick(2)]


def test_a_tenant_returning_from_idle_gets_no_credit_for_it() -> None:
    share: FairShare[int] = FairShare()
    _flood(share, "a", 10_000)
    share.add("b", 0, 10)
    share.pick(2)  # b served, then idle while a runs on alone
    _serve(share, 100)
    assert share.backlog("b") == 0
    _flood(share, "b", 1000)
    assert share.counter("b") == pytest.approx(share.counter("a"))
    served = _serve(share, 50)
    assert served["a"] == pytest.approx(served["b"], rel=0.05)


def test_a_newcomer_after_everyone_idled_starts_where_the_last_left_off() -> None:
    share: FairShare[int] = FairShare()
    _flood(share, "a", 100)
    _serve(share, 20)  # a drains and leaves
    assert share.backlog() == 0
    _flood(share, "b", 100)
    _flood(share, "a", 100)
    served = _serve(share, 10)
    assert served["a"] == pytest.approx(served["b"], rel=0.1)


def test_the_token_budget_ends_a_batch_but_a_long_prompt_still_runs_alone() -> None:
    share: FairShare[int] = FairShare()
    share.add("a", 0, 5000)
    share.add("a", 1, 10)
    assert [p.item for p in share.pick(8, max_batch_tokens=100)] == [0]
    share.add("a", 2, 60)
    share.add("a", 3, 60)
    assert [p.item for p in share.pick(8, max_batch_tokens=100)] == [1, 2]


def test_actual_costs_correct_the_estimate() -> None:
    """A tenant whose prompts hit the KV cache pays for what was computed, not their length."""
    share: FairShare[int] = FairShare(call_cost_tokens=2)
    _flood(share, "cached", 500, tokens=100)
    _flood(share, "fresh", 500, tokens=100)
    served_batches = {"cached": 0, "fresh": 0}
    for _ in range(40):
        for pick in share.pick(4):
            served_batches[pick.tenant] += 1
            share.settle(pick, 10 if pick.tenant == "cached" else 100)
    assert served_batches["cached"] > 5 * served_batches["fresh"]


def test_weights_change_at_once_and_bad_weights_are_refused() -> None:
    share: FairShare[int] = FairShare()
    share.set_weight("a", 3)
    assert share.weight("a") == 3 and share.weight("unseen") == 1
    with pytest.raises(ValueError):
        share.set_weight("a", 0)


def test_wanting_names_the_streams_worth_reading() -> None:
    share: FairShare[int] = FairShare()
    _flood(share, "a", 40)
    _flood(share, "b", 3)
    assert share.wanting(["a", "b", "c"], depth=32) == ["b", "c"]


@settings(max_examples=200, deadline=None)
@given(
    weights=st.tuples(st.sampled_from([1, 2, 3, 0.5]), st.sampled_from([1, 2, 3, 0.5])),
    tokens=st.lists(st.integers(1, 500), min_size=40, max_size=200),
    batch_sizes=st.lists(st.integers(1, 16), min_size=5, max_size=30),
    call_cost=st.sampled_from([0, 1, 16]),
)
def test_backlogged_tenants_stay_within_one_request_of_their_weighted_share(
    weights: tuple[float, float], tokens: list[int], batch_sizes: list[int], call_cost: int
) -> None:
    """|served_a / w_a - served_b / w_b| <= largest request cost / smallest weight, always."""
    share: FairShare[int] = FairShare(call_cost, {"a": weights[0], "b": weights[1]})
    for i, n in enumerate(tokens):
        share.add("a", i, n)
        share.add("b", i, tokens[-1 - i])
    bound = (max(tokens) + call_cost) / min(weights)
    for size in batch_sizes:
        share.pick(size)
        if not (share.backlog("a") and share.backlog("b")):
            break
        gap = share.served_cost("a") / weights[0] - share.served_cost("b") / weights[1]
        assert abs(gap) <= bound + 1e-9


def test_adjusting_a_charge_moves_the_counter_by_cost_over_weight() -> None:
    share: FairShare[int] = FairShare(call_cost_tokens=4, weights={"a": 2})
    share.add("a", 0, 10)
    [pick] = share.pick(1)
    assert share.counter("a") == pytest.approx(14 / 2)
    share.adjust("a", share.cost_of(0, 0) - pick.charged)  # a cache hit: nothing computed
    assert share.counter("a") == pytest.approx(0) and share.served_cost("a") == pytest.approx(0)
    share.adjust("unknown", 5)  # a tenant the scheduler never saw: nothing to correct


def test_a_returning_tenant_keeps_the_credit_it_is_given_and_no_more() -> None:
    share: FairShare[int] = FairShare()
    _flood(share, "a", 10_000)
    share.add("b", 0, 10)
    share.pick(2)
    _serve(share, 100)  # b idle while a runs on: b's counter falls far behind a's
    behind = share.counter("a") - share.counter("b")
    assert behind > 100
    share.add("b", 1, 10, credit=30.0)  # a closed loop back from its replies
    assert share.counter("b") == pytest.approx(share.counter("a") - 30.0)
    picks = share.pick(3)  # ahead of a by its credit: first, and only as far as the credit
    assert [p.tenant for p in picks] == ["b", "a", "a"]


def test_credit_is_divided_by_weight_like_any_cost() -> None:
    share: FairShare[int] = FairShare(weights={"a": 1.0, "b": 2.0})
    _flood(share, "a", 1000)
    share.add("b", 0, 10)
    share.pick(1)
    _serve(share, 20)
    share.add("b", 1, 10, credit=40.0)
    assert share.counter("b") == pytest.approx(share.counter("a") - 20.0)


def test_a_tenant_whose_prompts_cost_less_than_their_length_gets_more_of_a_batch() -> None:
    """A sampler's prompts extend its last step's (the backend reuses their KV): once its
    forwards report that, its next requests are charged their cost, not their length."""

    def picked(observed: bool) -> list[float]:
        share: FairShare[int] = FairShare(call_cost_tokens=1)
        if observed:
            share.add("sampler", -1, tokens=48)
            share.pick(1)
            for _ in range(6):  # its steps' forwards: one new token a prompt
                share.observe("sampler", named_tokens=48 * 8, computed_tokens=8)
        for i in range(64):
            share.add("flood", i, tokens=8)
        for i in range(8):
            share.add("sampler", 100 + i, tokens=48)
        return [p.charged for p in share.pick(16) if p.tenant == "sampler"]

    assert len(picked(observed=False)) < 4
    charges = picked(observed=True)
    assert len(charges) == 8  # its whole step in one batch
    assert sum(charges) < 8 * 48 / 2  # charged about its cost, not its length


def test_the_computed_share_follows_what_forwards_report_and_ignores_empty_parts() -> None:
    share: FairShare[int] = FairShare()
    share.add("t", 0, tokens=10)
    share.observe("t", named_tokens=0, computed_tokens=5)  # nothing named: nothing learned
    assert share.pick(1)[0].charged == pytest.approx(10)
    share.observe("t", named_tokens=10, computed_tokens=30)  # the envelope said less
    share.add("t", 1, tokens=10)
    assert share.pick(1)[0].charged == pytest.approx(20)  # half way to 3x
    share.observe("unknown", named_tokens=10, computed_tokens=1)  # no such tenant: ignored
