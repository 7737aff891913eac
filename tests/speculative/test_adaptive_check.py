"""The depth chooser's realized-rate check (``speculative.adaptive.RateCheck``), driven by synthetic launch times:
where the host's medians alone make the choice a round, the round is verified against plain steps on tokens per
second of wall, and the bucket is held at plain steps where the round does not win; a pair of blocks that another
bucket's step crossed is discarded. (The slow-spell replay is in test_adaptive_replay.py.)"""

from __future__ import annotations

import pytest

from speculative.adaptive import DepthChooser, RateCheck

# two tiers; plain steps win on the table (1 / 2.0 against 1.5 / (3.4 * 1.05) at acceptance 0.5)
TABLE = {64: {0: 1.2, 1: 1.6}, 256: {0: 2.0, 1: 3.4}}
PLAIN_HOST, ROUND_HOST = 2.7, 3.6  # ms of host a step: the model then takes rounds (1 / 2.7 < 1.5 / (3.6 * 1.05))


class Loop:
    """The engine's decode loop as the chooser sees it (ms, overlap schedule): step n is launched once the host has
    done step n - 1's own work (``host[depth]``) and waited for step n - 2's result (``wait[depth of n - 2]``: a
    device-bound round's), then the verdicts of step n - 1 arrive (a round: half the requests accept their draft)."""

    def __init__(self, chooser: DepthChooser, host: dict, wait: dict):
        self.c, self.host, self.wait = chooser, host, wait
        self.now, self.depths, self.sizes = 0.0, [], []

    def step(self, bs: int = 256) -> int:
        d = self.c.choose(bs)
        waited = self.wait[self.depths[-2]] if len(self.depths) >= 2 else 0.0
        if self.depths:
            self.now += self.host[self.depths[-1]] + waited
        self.c.launched(self.now, waited, True)
        if self.depths:
            prev, n = self.depths[-1], self.sizes[-1]
            self.c.observe(prev, [i % 2 for i in range(n)] if prev else [0] * n)
        self.depths.append(d)
        self.sizes.append(bs)
        return d

    def run(self, steps: int, bs: int = 256) -> list[int]:
        return [self.step(bs) for _ in range(steps)]


def _chooser(**kw) -> DepthChooser:
    c = DepthChooser(TABLE, num_steps=1, host_unit=1.0, probe_interval=10**6, **kw)
    c.estimate.accepted = [0.5]  # (acceptance 0.5: a round emits 1.5 tokens a request on average)
    return c


def _learn(c: DepthChooser, loop: Loop) -> None:
    """Plain steps, then rounds, until both host medians are measured at bucket 256 and the model takes rounds."""
    c.estimate.accepted = [0.0]
    loop.run(6)
    c.estimate.accepted = [0.5]
    loop.run(6)
    c._flush()  # (what a steady run deferred, taken in as the next full choice would)
    assert c.host[256] == {0: pytest.approx(PLAIN_HOST), 1: pytest.approx(ROUND_HOST)}
    assert c.best(256, lag=0) == 1 and c.best(256, lag=0, table=True) == 0


def test_a_round_slower_in_wall_is_pinned_to_plain_steps():
    """The model charges a round its host time (3.6 ms) and takes it; its wall holds a 0.8 ms wait for the device
    (4.4 ms for 1.5 tokens a request, plain steps 2.7 for 1): the check measures the round at about 0.92x plain steps,
    and the bucket runs plain steps for the hold though the model still prefers rounds."""
    c = _chooser()
    loop = Loop(c, {0: PLAIN_HOST, 1: ROUND_HOST}, {0: 0.0, 1: 0.8})
    _learn(c, loop)
    depths = loop.run(60)
    verdict = c.stats()["rate_check"]["256"]
    assert verdict["verdict"] == "pinned" and verdict["depth"] == 1 and verdict["base"] == 0, verdict
    assert verdict["rate_vs_base"] == pytest.approx((1.5 / 4.4) / (1 / 2.7), abs=0.02)
    assert 0 in depths and 1 in depths  # (its blocks: rounds, then plain steps, ...)
    after = loop.run(200)
    assert set(after) == {0} and c.best(256, lag=0) == 1  # (the model's choice, overridden)
    assert c.stats()["rate_check"]["256"]["recheck_in"] == c.verdicts[256]["until"] - c._step > 0
    assert c.stats()["checking"] is None


def test_a_round_faster_in_wall_is_kept():
    """The same host medians, the round device-free (3.6 ms of wall for 1.5 tokens a request): the check measures
    it at about 1.12x plain steps and leaves the model's rounds."""
    c = _chooser()
    loop = Loop(c, {0: PLAIN_HOST, 1: ROUND_HOST}, {0: 0.0, 1: 0.0})
    _learn(c, loop)
    loop.run(64)  # (the check starts within ``steady_steps`` of the choice resting on the host's medians)
    verdict = c.stats()["rate_check"]["256"]
    assert verdict["verdict"] == "kept", verdict
    assert verdict["rate_vs_base"] == pytest.approx((1.5 / 3.6) / (1 / 2.7), abs=0.02)
    assert set(loop.run(100)) == {1}


def test_no_check_where_the_table_agrees_or_the_gain_is_large():
    """A choice the table makes too (bucket 64: 1.5 / (1.6 * 1.05) against 1 / 1.2), or one whose expected gain is
    past ``check_band``, is not checked."""
    c = _chooser()
    loop = Loop(c, {0: 1.0, 1: 1.3}, {0: 0.0, 1: 0.0})
    c.estimate.accepted = [0.0]
    loop.run(6, bs=64)
    c.estimate.accepted = [0.5]
    assert set(loop.run(40, bs=64)) == {1} and c.check is None and not c.verdicts
    c = _chooser()
    loop = Loop(c, {0: 4.0, 1: 3.6}, {0: 0.0, 1: 0.0})  # (a gain of 1.5 * 4.0 / 3.6: no misreading)
    c.estimate.accepted = [0.0]
    loop.run(6)
    c.estimate.accepted = [0.5]
    assert set(loop.run(40)) == {1} and c.check is None and not c.verdicts


def test_a_bucket_change_discards_its_pair():
    """A step at another bucket inside a block of the check: that block is discarded, and its base block's ratio
    rests on the intact neighbour (a base block's own crossing drops its ratio)."""
    c = _chooser()
    loop = Loop(c, {0: PLAIN_HOST, 1: ROUND_HOST}, {0: 0.0, 1: 0.8})
    _learn(c, loop)
    check = None
    while check is None or check.issued < 12:  # (into the check's first base block, steps 8-15)
        loop.step()
        check = check or c.check
    loop.step(bs=64)
    assert c.check is check and check.crossed == [False, True] + [False] * 5
    loop.run(60)
    assert c.verdicts[256]["kept"] is False and c.verdicts[256]["ratio"] < 1.0

    r = RateCheck(256, 1, 0, block=8, pairs=3, settle=1)
    for i in range(56):
        depth, block = r.next(i)
        if block >= 0:
            r.add(block, 384 if depth else 256, 4.4 if depth else 2.7)
        if i == 20:
            r.cross()  # (block 2, a round block: base blocks 1 and 3 keep their other neighbour)
        if i == 44:
            r.cross()  # (block 5, a base block: its ratio is dropped)
    assert r.crossed == [False, False, True, False, False, True, False]
    ratios = r.ratios()
    assert len(ratios) == 2 and all(x == pytest.approx((384 / 4.4) / (256 / 2.7)) for x in ratios)


def test_a_pin_ends_where_acceptance_rises():
    """A pinned bucket's verdict ends once the acceptance estimates would carry its measured ratio past the
    margin (a round of 1 at acceptance 0.9 emits 1.9 tokens a request, not 1.5), within 16 steps."""
    c = _chooser()
    loop = Loop(c, {0: PLAIN_HOST, 1: ROUND_HOST}, {0: 0.0, 1: 0.8})
    _learn(c, loop)
    loop.run(60)
    assert c.verdicts[256]["kept"] is False
    c.estimate.accepted = [0.9 * c.estimate.tried[0]]
    loop.run(16)  # (the trigger is read again every 16 steps)
    assert 256 not in c.verdicts


def test_check_is_off_with_no_pairs():
    c = _chooser(check_pairs=0)
    loop = Loop(c, {0: PLAIN_HOST, 1: ROUND_HOST}, {0: 0.0, 1: 0.8})
    _learn(c, loop)
    assert set(loop.run(100)) == {1} and c.check is None and not c.verdicts


class GappedLoop(Loop):
    """``Loop`` where some steps are not launched by the decode loop's clock (``unlaunched``: a structured-output
    step, launched by its own path) or fail (``failed``: no verdicts; the engine reports it as ``lost``)."""

    def __init__(self, *args, unlaunched=(), failed=()):
        super().__init__(*args)
        self.unlaunched, self.failed = set(unlaunched), set(failed)

    def step(self, bs: int = 256) -> int:
        d = self.c.choose(bs)
        n = self.c._step
        waited = self.wait[self.depths[-2]] if len(self.depths) >= 2 else 0.0
        if self.depths:
            self.now += self.host[self.depths[-1]] + waited
        if n not in self.unlaunched:
            self.c.launched(self.now, waited, True)
        if self.depths:
            prev, k = self.depths[-1], self.sizes[-1]
            if n - 1 in self.failed:
                self.c.lost()
            else:
                self.c.observe(prev, [i % 2 for i in range(k)] if prev else [0] * k)
        self.depths.append(d)
        self.sizes.append(bs)
        return d


def test_a_step_launched_off_the_clock_inside_a_check():
    """A check's step whose launch the clock never saw (a structured-output step) has no interval of its own: the
    step before it is still measured on its wait, and the check reaches its verdict."""
    c = _chooser()
    loop = GappedLoop(c, {0: PLAIN_HOST, 1: ROUND_HOST}, {0: 0.0, 1: 0.8})
    _learn(c, loop)
    while c.check is None:
        loop.step()
    loop.unlaunched = {c._step + 4}  # (the check's fifth step: the fourth's interval never comes)
    loop.run(60)
    assert c.verdicts[256]["kept"] is False, c.stats()


def test_a_failed_step_keeps_verdicts_paired_with_their_steps():
    """A decode step that failed (no verdicts for it, ``lost``) before and during checks: later verdicts still go
    to the steps they are for, so checks conclude (a step's tokens paired with the step after it would cross every
    block at its end, every check inconclusive, and the bucket would alternate its depths for good)."""
    c = _chooser()
    loop = GappedLoop(c, {0: PLAIN_HOST, 1: ROUND_HOST}, {0: 0.0, 1: 0.8}, failed={3})
    _learn(c, loop)
    while c.check is None:
        loop.step()
    loop.failed.add(c._step + 10)  # (one of the check's own: its block is discarded)
    loop.run(60)
    assert c.verdicts[256]["kept"] is False and not c._pending, c.stats()
    assert c.check_counts["inconclusive"] == 0, c.check_counts
    assert set(loop.run(200)) == {0}


def test_a_run_not_carried_leaves_the_check_reading_to_the_full_choice():
    """A run of rounds at bucket 64 (the table's choice there), the batch then grown to bucket 256, where the host's
    medians alone make a round the choice, its expected gain over plain steps (1.5 * 2.7 / 3.02 at the run's
    acceptance 0.5) just under ``check_band``: the run is not carried (two depths measured there: the check's
    reading is the full choice's). The full choice that follows takes the run's verdict in (acceptance 0.55: a gain
    past the band) and starts no check, as the chooser that makes the full choice every step (a reading taken at
    the run's estimates would have started one)."""
    table = {64: {0: 1.2, 1: 1.6}, 256: {0: 2.0, 1: 2.9}}
    for steady in (16, 1):
        c = DepthChooser(table, num_steps=1, host_unit=1.0, probe_interval=10**6, steady_steps=steady)
        c.host[256] = {0: 2.7, 1: 3.02}
        c._host_gen += 1
        c.estimate.accepted = [0.5]
        for i in range(2):
            assert c.choose(64) == 1
            c.launched(i + 1.0, 0.0, True)
            if i:
                c.observe(1, [1] * 35 + [0] * 29)
        assert (c._steady is not None) == (steady > 1)
        full = c.full_choices
        assert c.choose(256) == 1 and c.full_choices == full + 1
        assert c.check is None and c._rests[256][1] == (), (steady, c._rests[256], c.check and c.check.stats())
