"""The router's holder scoreboard: circuit breaker, probation, half-open probes, observed order."""
from __future__ import annotations

from types import SimpleNamespace

from router.scoreboard import Scoreboard


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def holder(provider, residency="Warm", reputation=500):
    return SimpleNamespace(provider=provider, residency=residency, reputation=reputation)


def names(hs):
    return [h.provider for h in hs]


def proven(sb, provider, ms=10.0, n=4):
    for _ in range(n):
        sb.success(provider, ms, 8)


def test_new_holders_keep_the_view_order_until_observed():
    sb = Scoreboard(clock=Clock())
    hs = [holder("b"), holder("a"), holder("c")]
    assert names(sb.order(hs)) == ["b", "a", "c"]
    assert sb.state("b") == "probation"


def test_a_fault_opens_the_circuit_then_half_open_then_closed_by_a_success():
    clock = Clock()
    sb = Scoreboard(clock=clock, cooldown_s=2.0, max_cooldown_s=5.0)
    for p in "abc":
        proven(sb, p)
    sb.fault("a")
    sb.fault("a")  # its other requests in flight at the time: no longer cooldown
    assert sb.state("a") == "open"
    assert names(sb.order([holder("a"), holder("b"), holder("c")])) == ["b", "c", "a"]
    clock.t += 2.0
    assert sb.state("a") == "half_open"
    assert names(sb.order([holder("a"), holder("b")])) == ["b", "a"]  # still behind the proven
    sb.fault("a")  # the probe failed: twice the cooldown
    clock.t += 3.9
    assert sb.state("a") == "open"
    clock.t += 0.1
    assert sb.state("a") == "half_open"
    sb.fault("a")
    clock.t += 4.9  # capped at max_cooldown_s
    assert sb.state("a") == "open"
    clock.t += 0.1
    sb.success("a", 10.0, 8)
    assert sb.state("a") == "proven"


def test_probation_ranks_a_newcomer_behind_proven_holders_until_it_earns_successes():
    sb = Scoreboard(clock=Clock(), probation=3)
    proven(sb, "old", n=3)
    hs = [holder("new", reputation=900), holder("old")]  # the newcomer declares/looks better
    assert names(sb.order(hs)) == ["old", "new"]
    assert sb.claim_probe("new") and not sb.claim_probe("new")  # one probe in flight at a time
    sb.probe_done("new")
    for _ in range(3):
        sb.success("new", 10.0, 8)
    assert sb.state("new") == "proven" and names(sb.order(hs)) == ["new", "old"]  # then reputation decides
    assert not sb.claim_probe("old")  # proven holders are not probed


def test_probe_interval_limits_probes_of_one_holder():
    clock = Clock()
    sb = Scoreboard(clock=clock, probe_interval_s=0.5)
    assert sb.claim_probe("x")
    sb.probe_done("x")
    assert not sb.claim_probe("x")
    clock.t += 0.5
    assert sb.claim_probe("x")


def test_order_by_observed_latency_and_success_rate_not_declared_numbers():
    sb = Scoreboard(clock=Clock())
    proven(sb, "slow", ms=900.0)
    proven(sb, "fast", ms=20.0)
    proven(sb, "close", ms=60.0)  # within 2x best + 50 ms: same bucket as "fast"
    hs = [holder("slow"), holder("close"), holder("fast")]
    # one bucket, equal reputation: the nearer first (issue 22; least recent round trip)
    assert names(sb.order(hs)) == ["fast", "close", "slow"]
    for _ in range(3):  # "close" answers but often fails: success rate below 0.9
        sb.fault("close")
        sb.success("close", 60.0, 8)
    assert names(sb.order(hs)) == ["fast", "slow", "close"]  # a failure costs a deadline: worse than slow


def test_warm_holders_stay_before_cold_ones():
    sb = Scoreboard(clock=Clock())
    proven(sb, "cold")
    sb.fault("warm")
    assert names(sb.order([holder("warm"), holder("cold", residency="Cold")])) == ["warm", "cold"]


def test_a_disconnect_skips_the_holder_for_one_cooldown_and_a_reconnect_restores_it():
    clock = Clock()
    sb = Scoreboard(clock=clock)
    proven(sb, "a")
    sb.disconnected("a")
    assert sb.state("a") == "open"
    sb.connected("a")
    assert sb.state("a") == "proven"
    sb.fault("a")
    sb.connected("a")  # a reconnect does not close a circuit opened by a fault
    assert sb.state("a") == "open"
    snap = sb.snapshot()["a"]
    assert snap["faults"] == 1 and snap["successes"] == 4 and snap["state"] == "open"


def test_a_new_process_is_seeded_from_what_other_processes_recorded():
    sb = Scoreboard(clock=Clock())
    sb.success("seen", 5.0, 8)  # this process's own record is never overwritten by a seed
    records = {"hole": {"batches_served": 0, "latency_ms": None, "failing": True},
               "good": {"batches_served": 40, "latency_ms": 12.5, "failing": False},
               "young": {"batches_served": 1, "latency_ms": 3.0, "failing": False},
               "seen": {"batches_served": 0, "latency_ms": None, "failing": True}}
    assert sb.unseeded(["hole", "good", "young", "seen", "absent"]) == ["hole", "good", "young", "absent"]
    sb.seed(records, ["absent"])
    assert sb.unseeded(["hole", "good", "young", "seen", "absent"]) == []  # looked up once per process
    assert sb.state("hole") == "half_open" and sb.failed_recently("hole")  # a black hole others caught
    assert sb.state("good") == "proven" and sb.snapshot()["good"]["latency_ms"] == 12.5
    assert sb.state("young") == "probation" and sb.state("absent") == "probation"
    assert sb.state("seen") == "probation"  # its own one success so far, not the seed's failure
    assert names(sb.order([holder("hole"), holder("young"), holder("good")])) == ["good", "young", "hole"]
    assert sb.claim_probe("hole")  # it earns real batches back through a probe
    sb.probe_done("hole")
    sb.success("hole", 9.0, 8)
    assert sb.state("hole") == "probation"


def test_a_holder_whose_socket_this_process_holds_ranks_before_an_equal_relayed_one():
    sb = Scoreboard(clock=Clock(), here=lambda p: p.startswith("here"))
    for p in ("here", "there", "here-slow"):
        proven(sb, p)
    hs = [holder("there", reputation=900), holder("here")]  # the relayed one has the better reputation
    assert names(sb.order(hs)) == ["here", "there"]
    proven(sb, "here-slow", ms=500.0, n=8)  # a latency bucket worse than the best: locality does not save it
    assert names(sb.order([holder("here-slow"), holder("there")])) == ["there", "here-slow"]
    sb.fault("here")  # nor a failing holder
    assert names(sb.order(hs)) == ["there", "here"]
    assert names(Scoreboard(clock=Clock()).order([holder("b", reputation=100), holder("a")])) == ["a", "b"]


def test_p99_follows_every_new_round_trip():
    """The p99 is kept between round trips (each batch's deadline asks for it) and follows
    each new one, also once the window is full and old round trips drop out."""
    from router.scoreboard import LATENCY_WINDOW

    sb = Scoreboard()
    proven(sb, "a", ms=10.0, n=LATENCY_WINDOW)
    stats = sb._stats["a"]
    assert stats.p99_ms() == stats.p99_ms() == 10.0
    sb.success("a", 500.0, 8)
    assert stats.p99_ms() == 10.0  # one slow answer in 128 is above the 99th percentile
    sb.success("a", 700.0, 8)
    assert stats.p99_ms() == 500.0
    proven(sb, "a", ms=20.0, n=LATENCY_WINDOW)  # the slow ones left the window
    assert stats.p99_ms() == 20.0


def test_rank_counts_the_leading_peers_reputation_aside():
    """``rank``'s peers: the run from the first holder of those equal in tier, success rate,
    latency bucket, held here and nearness; reputation orders them but does not end the run,
    a farther or unproven holder does (the planner spreads batches over peers only)."""
    sb = Scoreboard(clock=Clock(), probation=2)
    for p in ("a", "b", "c"):
        proven(sb, p, ms=3.0, n=16)
    proven(sb, "far", ms=40.0, n=16)  # same latency bucket (under 2 x 3 + 50 ms), 40 ms away
    hs = [holder("c", reputation=510), holder("a", reputation=520), holder("b"), holder("far"), holder("new")]
    ordered, lead = sb.rank(hs)
    assert names(ordered) == ["a", "c", "b", "far", "new"] and lead == 3
    assert names(sb.order(hs)) == names(ordered)
    sb.fault("c")  # its circuit opens: no longer a peer of the others
    ordered, lead = sb.rank(hs)
    assert names(ordered)[:2] == ["a", "b"] and lead == 2
    rank = sb.planner_rank()
    got, lead = rank(hs)
    assert names(got) == names(ordered) and lead == 2 and rank(hs) == (got, lead)  # one call's cached ranking


def test_nearness_is_not_held_against_a_holder_with_few_round_trips():
    """A holder whose only round trips were its first, slow ones (a cold start) is still a peer
    of near holders until ``DEADLINE_SAMPLES`` round trips are on record: otherwise it would
    look far, get no batch, and never show that it is near. Once measured, a far one is not."""
    from router.scoreboard import DEADLINE_SAMPLES

    sb = Scoreboard(clock=Clock(), probation=2)
    proven(sb, "a", ms=2.4, n=DEADLINE_SAMPLES)
    proven(sb, "b", ms=2.6, n=DEADLINE_SAMPLES)  # another rounded 5 ms step, but within 5 ms: a peer
    proven(sb, "cold", ms=20.0, n=4)
    hs = [holder("a"), holder("b"), holder("cold")]
    ordered, lead = sb.rank(hs)
    assert names(ordered) == ["a", "b", "cold"] and lead == 3
    proven(sb, "cold", ms=20.0, n=DEADLINE_SAMPLES)  # measured, and still 20 ms away: no longer a peer
    assert sb.rank(hs) == (ordered, 2)
    for _ in range(DEADLINE_SAMPLES):  # its batches show it near after all
        sb.success("cold", 2.5, 8)
    assert sb.rank(hs)[1] == 3
