"""Values every layer of a forward computes alike are computed by the first layer to run and taken
by the others, never across forwards (:class:`~hf_kvpolicies.retention.step_share.StepShare`)."""

from __future__ import annotations

from hf_kvpolicies.retention.step_share import StepShare


def test_the_first_to_take_leads_and_recomputes_in_every_forward():
    share, probe, first, second = StepShare(), object(), object(), object()
    computed = []

    def compute(value):
        def run():
            computed.append(value)
            return value
        return run

    assert share.leader is None  # built (a constructor's probe) but never run: no leader yet
    assert share.take(first, ("step", 1), compute("first 1")) == "first 1"
    assert share.take(second, ("step", 1), compute("second 1")) == "first 1"  # taken, not computed
    assert share.take(first, ("step", 2), compute("first 2")) == "first 2"  # the leader computes anew
    assert share.take(second, ("step", 2), compute("second 2")) == "first 2"
    assert share.take(second, ("other", 2), compute("own")) == "own"  # a forward of another shape: its own
    assert share.leader is first and probe is not share.leader
    assert computed == ["first 1", "first 2", "own"]
