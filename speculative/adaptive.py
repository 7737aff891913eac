"""Adaptive speculation: the draft depth of each step, chosen on the host (no torch: the engine imports it).

A step at depth d verifies a chain of d drafts (depth 0: the target's plain decode step alone; the draft catches up
on the tokens of plain steps lazily, before the next round). ``DepthChooser`` picks the depth that maximises the
expected tokens per second of the batch it is about to run, from

- a cost model: the time of a step at each depth per batch-size bucket, measured by the worker at start-up
  (``workers.graphs.DecodeGraphs.depth_costs``: graph replays on a GPU, eager calls otherwise), and the time of the
  draft's catch-up over L plain steps' tokens per request (negative keys -L of the same table), which a round after
  L plain steps pays first; and per bucket and depth the time a step gains per token of the batch's context
  (``context_costs``, timed at start-up with every row at a longer context): the table's padding rows hold one token
  each, while a loaded server's steps read the whole batch's KV, a cost every depth pays (the verify reads a
  request's KV once for its rows) that makes a round's share of a step smaller, as the context grows;
- live acceptance estimates (``AcceptanceEstimate``): per draft position i, the chance that draft i is accepted
  given that the i - 1 before it were, as decayed averages over the verdicts the host reads anyway;
- the host's time per step: the table times the device alone, but where the host's work per step outlasts the
  device's (a small model at a large batch) the loop runs at the host's pace. The engine tells the chooser when
  each decode step is launched and how long the host waited for the device since the last launch (``launched``:
  host clocks around the waits the loop has anyway, no sync). The interval between launches less that wait is the
  host's own work (planning, launching, reading and applying a step), which moves far less with the device's load
  than the interval itself; per (bucket, depth) its median over recent steps (steps with a draft catch-up or a
  garbage collection of the older generations left out) is the host cost, and a step's cost is max(table, host).
  Likewise a round's catch-up after fewer plain steps than the stash holds: the host time of the steps that carried
  one, less their depth's host cost, per bucket (its median), and the catch-up charged is max(table, host): where
  it runs eagerly its launches cost the host several plain steps on a host-bound shape, while the table times the
  device alone.

Expected tokens of a round at depth d: 1 + sum_{j<=d} prod_{i<=j} p_i; the choice is argmax_d E(d) / cost(d, bucket),
cost being max(table + context, host), a round's cost including the catch-up the plain steps before it left (so a
marginal gain does not leave depth 0 only to come back: the catch-up is paid on leaving), and weighed up by
``margin`` against depth 0: a batch's requests finish apart, so a round it shows barely ahead is a coin flip whose
losing side costs a round; speculation must win clearly to be chosen.
Before any verdict the estimates are the prior (0.5: a neutral guess, which at a large batch, where a round costs
1.5 plain steps or more, keeps plain steps until a probe measures acceptance).
Positions deeper than the chosen depth get no verdicts, so one step at the next tier above the choice (a probe)
refreshes the first unseen position, spaced so that its expected extra time stays under ``probe_budget`` of a
plain step's time at that bucket (and at least ``probe_interval`` steps apart): a rise in acceptance is seen within one
interval per tier, while at a large batch, where a deeper step costs several plain steps, probes stay rare.

Where the host's medians alone move the choice (the table's own costs would keep a shallower depth, and the model's
expected gain is under ``check_band``), the choice is verified on what matters, tokens per second of wall
(``RateCheck``): blocks of ``check_block`` steps alternate the choice and the table's depth, so that a slow spell of
the machine longer than a block weighs on both arms; each base block is compared with the mean of the two around it.
Unless the choice wins by ``check_margin`` the bucket is held at the table's depth (probes still run) for
``check_hold`` steps, or until the acceptance estimates would carry the measured ratio past the margin; a choice that
wins is left to the model as long (a narrow win a quarter of it, or until the choice's host median moves by the
margin). A host median is one spell's reading, and with the decision's margin the size of the machines' noise no
model of it decides reliably; paired blocks of the two arms do.

Where plain steps are firmly the choice (``pause_after`` of them in a row at the batch's bucket, none a probe or a
check's, with acceptance measured) the draft is paused: its pending inputs are dropped, and each step runs what an
engine without speculation runs (no stash, no catch-up, no chooser bookkeeping, no probes) until the batch reaches
a bucket whose choice is a round, or for ``pause_hold`` steps (then a probe measures acceptance again). Its requests'
draft KV then has holes (lossless: verification decides every token), and their verdicts are kept from the
estimates (the engine's ``Request.draft_holes``).

``DepthSchedule`` forces a depth sequence instead (tests, benchmarks: ``Engine.depth_policy``).
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import statistics
from collections import Counter, deque
from typing import Protocol

_VERSIONS = itertools.count()  # (``AcceptanceEstimate.version``)


class DepthPolicy(Protocol):
    # whether the draft is paused (``DepthChooser``, "The draft's pause"): read after ``choose``, which then returned
    # 0; the step runs what no speculation runs, and is no chosen step (no ``observe``, ``lost`` or ``launched``)
    paused: bool

    def choose(self, batch_size: int, context_tokens: int = 0) -> int:
        """The draft depth of the next speculative step over ``batch_size`` requests holding ``context_tokens``
        tokens of context in all."""

    def unpause(self) -> None:
        """Leave a pause now, and begin none at the next ``choose`` (the engine runs a round whatever is chosen, a
        structured-output step, which then sends verdicts: a pause begun on it would count no chosen step)."""

    def observe(self, depth: int, accepted: list[int]) -> None:
        """A round's verdicts: its depth and each request's accepted drafts."""

    def lost(self) -> None:
        """The oldest chosen step whose verdicts are still to come failed: none will (the next ``observe`` is for
        the step after it)."""

    def sync_lag(self, lag: int) -> None:
        """The batch about to be chosen for has run ``lag`` plain steps since its draft last caught up (the most of
        its requests'), told where no decode step is in flight (so the engine's counts are the worker's)."""

    def launched(self, now: float, waited: float, contiguous: bool) -> None:
        """The step just chosen is launched at host time ``now`` (seconds); since the previous launch the host waited
        ``waited`` seconds for the device; ``contiguous``: that previous launch was a decode step this loop chose
        and launched, with no prefill, idle loop or collection of the older GC generations in between."""

    def stats(self) -> dict:
        """What /v1/stats shows of the policy."""


_FIRST, _SECOND, _THIRD = operator.itemgetter(0), operator.itemgetter(1), operator.itemgetter(2)


def _size(verdicts) -> int:
    return -1 if verdicts is None else len(verdicts)


def stretches(events: list[tuple]) -> list[tuple[int, int]]:
    """(start, length) of each stretch of ``events`` ((depth, verdicts, step) in order) alike: of one depth and
    batch size, one step apart, or lost steps (depth and verdicts None) one step apart. Found in C, as a run's
    verdicts are most of what a full choice takes in: along a stretch, step less index stays."""
    sizes = map(_size, map(_SECOND, events)) if None in map(_FIRST, events) else map(len, map(_SECOND, events))
    out, at = [], 0
    for _, group in itertools.groupby(zip(map(_FIRST, events), sizes,
                                          map(operator.sub, map(_THIRD, events), itertools.count()))):
        k = len(list(group))
        out.append((at, k))
        at += k
    return out


def keeps_newest(window: int) -> bool:
    """Whether a plain step that catches the draft up leaves each request's newest stashed position for the next
    catch-up (``Proposer.catch_up_behind``): where the stash holds more than two positions (with two kept at 2, every
    plain step would catch up, and none would sample depth 0's host cost)."""
    return window > 2


def lag_after_plain_step(lag: int, window: int, caught_up: bool | None = None) -> int:
    """A request's draft lag (plain steps whose positions its draft has not consumed) after a plain step that found
    it at ``lag``, with a stash of ``window`` positions (0: no draft to keep): one more; where the step caught up
    first (``caught_up``; None: where this request's stash is full) the draft consumes all but the newest position
    (``Proposer.catch_up_behind``), so 2 (1 where nothing was behind, or the stash is consumed whole:
    ``keeps_newest``). The worker catches up every row behind once any row's stash is full, so a row short of full
    is caught up too: the scheduler counts by the step's ``caught_up``, the chooser (the batch's most) by its own
    lag."""
    if caught_up is None:
        caught_up = bool(window) and lag >= window
    if not caught_up:
        return lag + 1
    return 2 if lag and keeps_newest(window) else 1


def _median(values) -> float:
    """``statistics.median`` of numbers, without its type checks (a host sample's median is taken every step)."""
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def context_level(tokens: int) -> int:
    """``tokens`` with its four leading bits kept (at most 12.5 % below it): the context the choice is cached for, so
    that a batch whose context grows by a token a step reuses its choices."""
    shift = max(0, tokens.bit_length() - 4)
    return tokens >> shift << shift


def context_range(tokens: int) -> tuple[int, int]:
    """The contexts of ``tokens``'s level: [level, next level)."""
    shift = max(0, tokens.bit_length() - 4)
    return tokens >> shift << shift, (tokens >> shift) + 1 << shift


def expected_tokens(p: list[float], depth: int) -> float:
    """1 + sum_{j<=depth} prod_{i<=j} p_i: the tokens a chain round of ``depth`` drafts emits on average."""
    total, run = 1.0, 1.0
    for i in range(depth):
        run *= p[i]
        total += run
    return total


class AcceptanceEstimate:
    """Per draft position i (1-based), P(draft i accepted | drafts 1..i-1 accepted), as decayed sums over rounds:
    each round multiplies the sums by ``decay`` and adds its own counts, so a change shows within a few rounds
    whatever the batch size. A round of fewer than ``full_round`` requests decays them by decay ** (n /
    full_round): at bs 1, a few rejections in a row would otherwise take the estimate below what a round needs,
    and at depth 0 only a probe, many steps later, brings it back. Starts at ``prior`` with the weight of one
    observation."""

    def __init__(self, num_positions: int, decay: float = 0.8, prior: float = 0.5, full_round: int = 4):
        self.decay = decay
        self.full_round = full_round
        self._accepted = [prior] * num_positions
        self._tried = [1.0] * num_positions
        self.at = [0] * num_positions  # the step of each position's last update
        self.version = next(_VERSIONS)  # (new at every change: a cache key unique across estimates)
        self._p = self._ratios()

    @property
    def accepted(self) -> list[float]:
        return self._accepted

    @accepted.setter
    def accepted(self, value: list[float]) -> None:
        self._accepted, self.version = list(value), next(_VERSIONS)
        self._p = self._ratios()

    @property
    def tried(self) -> list[float]:
        return self._tried

    @tried.setter
    def tried(self, value: list[float]) -> None:
        self._tried, self.version = list(value), next(_VERSIONS)
        self._p = self._ratios()

    @property
    def p(self) -> list[float]:
        """(Kept up to date by each change, a new list each time: the chooser reads it several times a step.)"""
        return self._p

    def _ratios(self) -> list[float]:
        return [a / t if t > 0 else 0.0 for a, t in zip(self._accepted, self._tried)]

    def update(self, depth: int, accepted: list[int], step: int | None = None, rounds: int = 1) -> None:
        """One round at ``depth``: a request that accepted a drafts tried positions 1..min(a + 1, depth) and passed
        1..a. ``step``: the round's step number, where positions are seen only now and then (probes): their sums
        decay once per step since their last update, so a probe's verdicts are not outweighed by stale ones.
        ``rounds``: the verdicts of that many rounds of one batch size in a row, one step apart (the last at
        ``step``), as one: their counts weighted so that rounds alike leave the sums where updates one by one do."""
        if depth <= 0 or not len(accepted):
            return
        if not isinstance(accepted, list):
            accepted = list(accepted)
        # position i + 1 is reached by the requests that accepted i drafts or more (``reached``) and passed by those
        # of them that accepted more than i: counted by ``list.count`` (in C: a batch of 256 costs a microsecond)
        reached = len(accepted)
        size = reached / rounds
        decay = self.decay if size >= self.full_round else self.decay ** (size / self.full_round)
        if rounds > 1:  # (sum over the rounds of decay ** age, over rounds: each round's share of the counts)
            scale = (1.0 - decay ** rounds) / ((1.0 - decay) * rounds) if decay < 1.0 else 1.0
            reached = scale * reached
        acc, tried, at, p = self._accepted, self._tried, self.at, list(self._p)
        count = 1 if rounds == 1 else scale
        for i in range(depth):
            passed = reached - accepted.count(i) * count
            # (a step's decay per step since the position's last; at least one per round, as one by one: a round at
            # the step of the last update decays once)
            gap = rounds if step is None else max(step - at[i], rounds)
            keep = decay if gap <= 1 else decay ** gap
            a = acc[i] = keep * acc[i] + passed
            t = tried[i] = keep * tried[i] + reached
            p[i] = a / t if t > 0 else 0.0
            at[i] = at[i] + rounds if step is None else step
            reached = passed
            if reached <= 0:  # (no request got further)
                break
        self.version, self._p = next(_VERSIONS), p


class RateCheck:
    """An A/B of ``depth`` against ``base`` at one bucket on realized throughput: ``2 * pairs + 1`` blocks of ``block``
    steps at depth, base, depth, ..., depth (the choice first: the check starts where it runs). A block's rate is
    the tokens its measured steps appended over the sum of their walls. A step's wall is the host's own time of
    the interval from its launch to the next one, less the wait in it (which is for the step before), plus the
    host's wait for this step's own result in the next interval: so a device-bound block's backlog is its own, not
    handed to the block after it. The first ``settle`` steps of a block are left out (the transition: its host time
    holds the read of the other arm's step, its wait a round's catch-up).
    Each base block is compared with the mean of the depth blocks on either side, so that a slow spell longer than
    a block weighs on both arms; a block that another bucket's step or an unexpected round crossed is discarded with
    its pair."""

    def __init__(self, bucket: int, depth: int, base: int, block: int, pairs: int, settle: int):
        self.bucket, self.depth, self.base = bucket, depth, base
        self.block, self.settle = block, settle
        n = 2 * pairs + 1
        self.tokens, self.seconds, self.steps = [0] * n, [0.0] * n, [0] * n
        self.crossed = [False] * n
        self.waiting = [0] * n  # per block, measured steps whose interval or tokens are still to come
        self.total = block * n
        self.issued = 0  # the check's steps chosen so far
        self.last = 0  # the chooser's step number of the last of them

    def next(self, step: int) -> tuple[int, int]:
        """The depth of the check's next step, and its block where it is measured (else -1)."""
        i, k = divmod(self.issued, self.block)
        self.issued, self.last = self.issued + 1, step
        if k < self.settle:
            return (self.base if i % 2 else self.depth), -1
        self.waiting[i] += 1
        return (self.base if i % 2 else self.depth), i

    def cross(self, block: int | None = None) -> None:
        """A step between the check's that was not its own (another bucket), or one of its own that ran another
        depth (a structured round): the block it fell in is discarded."""
        if block is None:
            if not 0 < self.issued < self.total or self.issued % self.block == 0:
                return  # (between blocks: the next block's first steps are not measured)
            block = self.issued // self.block
        self.crossed[block] = True

    def add(self, block: int, tokens: int, seconds: float) -> None:
        self.waiting[block] -= 1
        if seconds < 0:  # (no interval: a launch after a prefill or an idle loop)
            return
        self.tokens[block] += tokens
        self.seconds[block] += seconds
        self.steps[block] += 1

    def ratios(self) -> list[float]:
        """Per base block whose neighbours are in: the mean of their rates (those intact) over its rate."""
        need = max(2, (self.block - self.settle) // 2)
        done = self.issued // self.block
        rate = [t / s if i < done and not (x or wait) and n >= need and s > 0 else None
                for i, (t, s, n, x, wait) in enumerate(zip(self.tokens, self.seconds, self.steps, self.crossed,
                                                           self.waiting))]
        out = []
        for i in range(1, len(rate), 2):
            around = [r for r in (rate[i - 1], rate[i + 1]) if r]
            if rate[i] and around and (len(around) == 2 or i + 1 < done):  # (one side where the other is lost)
                out.append(sum(around) / len(around) / rate[i])
        return out

    def complete(self) -> bool:
        return self.issued >= self.total and not any(self.waiting)

    def stats(self) -> dict:
        return {"bucket": self.bucket, "depth": self.depth, "base": self.base, "steps": self.issued,
                "of": self.total}


class DepthChooser:
    """The adaptive policy. ``costs``: batch bucket → {depth: seconds (or ms) of one step at that depth}; its
    depths are the tiers it chooses among (each bucket has every tier). Negative keys -L: the draft's catch-up over
    L plain steps per request (measured at a few L, interpolated; the largest L is the stash's size, where a plain
    step catches up too). ``context_costs``: bucket → {depth: what a step's time grows by per token of the batch's
    context} (None or a missing entry: 0)."""

    def __init__(self, costs: dict[int, dict[int, float]], num_steps: int, decay: float = 0.8, prior: float = 0.5,
                 context_costs: dict[int, dict[int, float]] | None = None,
                 probe_interval: int = 50, probe_budget: float = 0.01, margin: float = 0.05,
                 host_unit: float = 1e3, host_samples: int = 15, host_min_samples: int = 3,
                 host_change: float = 0.03, host_ttl: int = 256, check_block: int = 8, check_pairs: int = 3,
                 check_settle: int = 1, check_margin: float = 0.05, check_early: float = 0.1,
                 check_band: float = 0.35, check_hold: int = 1024, pause_after: int | None = None,
                 pause_hold: int = 1024, steady_steps: int = 16, steady_tol: float = 0.03):
        if not costs:
            raise ValueError("adaptive speculation needs step costs")
        self.buckets = sorted(costs)
        self.costs = {b: {int(d): float(c) for d, c in costs[b].items() if int(d) >= 0} for b in self.buckets}
        self.catch_up_costs = {b: sorted((-int(d), float(c)) for d, c in costs[b].items() if int(d) < 0)
                               for b in self.buckets}
        # the stash's size: a plain step after this many catches up first (0: no draft to catch up, n-gram)
        self.window = max((lag for row in self.catch_up_costs.values() for lag, _ in row), default=0)
        self.lag = 0  # plain steps since the last round (the batch's draft lag, as the worker counts it)
        self.tiers = sorted(self.costs[self.buckets[0]])
        if any(sorted(self.costs[b]) != self.tiers for b in self.buckets):
            raise ValueError("every bucket needs a cost at every depth tier")
        context_costs = context_costs or {}
        self.context_costs = {b: {d: max(0.0, float(context_costs.get(b, {}).get(d, 0.0))) for d in self.tiers}
                              for b in self.buckets}
        self._context = 0  # the batch's context tokens at the last ``choose``, coarsened (``context_level``)
        self.estimate = AcceptanceEstimate(num_steps, decay, prior)
        self.probe_interval = probe_interval
        self.probe_budget = probe_budget
        self.margin = margin
        self._step = 0
        # per tier k: the step of the last round at depth >= k (its positions' estimates are that fresh)
        self._seen = {k: 0 for k in self.tiers}
        self.last_depth: int | None = None
        # per step the choice reads only (bucket, lag) and the estimates: ``choose`` keeps its answers until the
        # estimates change (a round's verdicts), so a run of plain steps costs a dict lookup each, not the argmax
        # (per bucket, so that a bucket whose costs move drops its own in one step: keyed by lag and context level,
        # they would otherwise be scanned whole, and they grow with every context level a long run passes)
        # bucket → {(lag, context level): (depth, its rate over the runner-up's, its cost: ``_argmax``)}
        self._best: dict[int, dict[tuple[int, int], tuple[int, float, float]]] = {}
        self._best_state = -1  # (the estimate's version the cached choices were made at)
        self._probe_every: dict[int, dict[tuple[int, int, int], int]] = {}  # bucket → {(base, probe, lag): steps}
        self._totals: dict[int, dict[tuple[int, int], list[float]]] = {}  # bucket → {(lag, context): tier costs}
        self._buckets: dict[int, int] = {}
        # the host's cost per step (``launched``): table units per second of host clock; the window of recent
        # samples per (bucket, depth) whose median it is (once it has ``host_min_samples``); how far a bucket's
        # step costs must move before its cached choices are recomputed
        self.host_unit, self.host_samples, self.host_min_samples, self.host_change = (
            host_unit, host_samples, host_min_samples, host_change)
        self.host: dict[int, dict[int, float]] = {b: {} for b in self.buckets}  # bucket → {depth: host median}
        self._host_runs: dict[tuple[int, int], deque[float]] = {}
        # a host median above the table that no step has sampled for ``host_ttl`` steps is dropped (``_expire``):
        # a depth it priced out is not run again, so one measured in a slow spell would otherwise stand for good
        self.host_ttl = host_ttl
        self._sampled_at: dict[tuple[int, int], int] = {}  # (bucket, depth) → the step of its last sample
        self.host_per_depth = 0.0  # host increment per request and draft depth, from buckets with two depths seen
        # the costs the choice reads: max(the table's, the host's) per bucket and depth (``_refresh``), brought up to
        # date lazily: a host median that moves may move every bucket's (those not measured borrow it), so it bumps
        # ``_host_gen`` and a bucket is refreshed when next chosen for (``_fresh``), not all of them at every move
        self.step_cost: dict[int, dict[int, float]] = {b: dict(self.costs[b]) for b in self.buckets}
        self._host_gen = 0
        self._fresh_at: dict[int, int] = {}  # bucket → the generation its step costs were refreshed at
        # (bucket, depth, caught the draft up, the lag of a round's catch-up short of a full stash else 0) of the
        # last choice
        self._chosen: tuple[int, int, bool, int] | None = None
        # the last launches: [bucket, depth, caught up, short catch-up's lag, launch time, host ms until the next
        # launch (None: unknown)]
        self._launches: deque[list] = deque(maxlen=4)
        # the host's ms of a round's catch-up short of a full stash, per bucket: its recent samples and their median
        # (from the first: such a catch-up is rare, and each one the chooser underprices costs several plain steps)
        self._catch_up_runs: dict[int, deque[float]] = {}
        self.catch_up_host: dict[int, float] = {}
        # the realized-rate check (``RateCheck``; check_pairs 0: off): per bucket, (the step it was read at, (the
        # choice, the table's depth) where the host's costs alone make the choice deeper, else ()): read again every
        # 16 steps, where the bucket's costs move, and at every step of a check there (``_rests_on_host``: not at
        # each round's new estimates, which move it slowly, for a few microseconds a step)
        self.check_block, self.check_pairs, self.check_settle = check_block, check_pairs, check_settle
        self.check_margin, self.check_band, self.check_hold = check_margin, check_band, check_hold
        self.check_early = check_early
        self._rests: dict[int, tuple[int, tuple]] = {}
        self.check: RateCheck | None = None
        # bucket → the last check's verdict: kept, ratio (the choice's rate over the base's), until (a step), depth,
        # base, q (E(depth) / E(base) then: a pin ends where the estimates would carry the ratio past the margin),
        # close (a narrow win), host (the choice's host median then: a narrow win ends where it moves)
        self.verdicts: dict[int, dict] = {}
        self.check_counts: Counter = Counter()  # checks by outcome: kept, pinned, inconclusive, dropped
        # the check's measured steps by step number: [block, depth, host seconds, wait seconds, tokens] (-1: not
        # measurable); its tokens come with its verdicts (``observe``, the n-th call for the n-th step chosen)
        self._pending: dict[int, list] = {}
        self._observed = 0
        self._launch_at = (0, 0.0)  # (step, host time) of the last launch
        # the draft's pause: after ``pause_after`` plain choices in a row (None: twice the stash's size; 0: never),
        # steps run paused (``paused``) while the batch's bucket chooses plain steps; they are no chosen steps (the
        # engine sends no verdicts or launches for them) and run no probes (a draft with holes measures little)
        self.pause_after = 2 * self.window if pause_after is None else pause_after
        self.paused = False
        # plain choices in a row (no probe or check step), with acceptance measured since the last pause ended
        # (the step it ended at: ``_resumed_at``; verdicts of drafts with holes are not sent, so a fresh verdict
        # is a whole draft's)
        self._plain_streak = 0
        self._resumed_at = 0
        # a pause ends after ``pause_hold`` steps however the batch stays, so that a probe measures acceptance again
        # (a rise would otherwise go unseen for as long as the batch stays at the bucket)
        self.pause_hold, self._paused_for = pause_hold, 0
        self.pauses = 0
        # a steady run: a round that wins clearly is chosen again without the full choice for up to
        # ``steady_steps`` steps, while the batch's bucket stays, its context stays where the same round surely
        # stays the best, the drafts its rounds accept stay near what the estimate expected (``_watch``), and no
        # draft lag, check, probe or pause is due. The run's verdicts, launches and lost steps wait in
        # ``_deferred`` / ``_run_launches`` and the next full choice takes them in, in order: on a host-bound
        # engine what the chooser runs each step, cold, is the step's (1: every step chooses anew). ``_steady``:
        # (bucket, the first step that chooses anew, the choice's ``_chosen``, its depth, the contexts [lo, hi) it
        # holds over, whether hi was extended past its level)
        self.steady_steps, self.steady_tol = max(1, steady_steps), steady_tol
        self._steady: tuple | None = None
        self.full_choices = 0  # (steps chosen by the full choice: the rest were a run's)
        self._deferred: list[tuple] = []  # verdicts (depth, accepted, step), a lost step (None, None, step)
        self._run_launches: list[tuple] = []  # ``_launched``'s arguments
        self._unsettled: set[tuple[int, int]] = set()  # (bucket, depth)s sampled since their medians were taken
        # (the run's watch, ``_watch``: the drafts a request is expected to accept, their decayed drift from it,
        # its decay and its bound)
        self._expect, self._variance, self._drift, self._drifted = 0.0, 0.0, 0.0, False
        self._drift_keep, self._drift_tol = 1.0, 0.0
        self._tier_at = {d: i for i, d in enumerate(self.tiers)}

    def bucket(self, batch_size: int) -> int:
        b = self._buckets.get(batch_size)
        if b is None:
            i = bisect.bisect_left(self.buckets, batch_size)
            b = self._buckets[batch_size] = self.buckets[min(i, len(self.buckets) - 1)]
        return b

    def _cached_best(self, batch_size: int, bucket: int, lag: int) -> int:
        """``best(batch_size, lag=lag)`` for the current estimates (which, at a bucket and lag, is all it reads)."""
        state = self.estimate.version
        if state != self._best_state:
            self._best.clear()
            self._best_state = state
        cached = self._best.get(bucket)
        if cached is None:
            cached = self._best[bucket] = {}
        key = (lag, self._context)
        got = cached.get(key)
        if got is None:
            got = cached[key] = self._argmax(bucket, self.estimate.p, lag, False)
        return got[0]

    def catch_up_cost(self, bucket: int, lag: int) -> float:
        """The draft's catch-up over ``lag`` plain steps' tokens per request (linear through the measured points)."""
        pts = self.catch_up_costs[bucket]
        if lag <= 0 or not pts:
            return 0.0
        if len(pts) == 1:
            return pts[0][1] * lag / pts[0][0]
        (l0, c0), (l1, c1) = pts[0], pts[-1]
        return max(0.0, c0 + (c1 - c0) * (lag - l0) / (l1 - l0))

    def catch_up_charge(self, bucket: int, lag: int) -> float:
        """What a round's catch-up over ``lag`` plain steps costs: max(the table's device time, the host's observed
        time at the bucket, else at the nearest observed bucket: at a smaller one scaled down by the batch, at a
        larger one as it is, since its launches do not shrink with the batch)."""
        table = self.catch_up_cost(bucket, lag)
        if lag <= 0 or not self.catch_up_host:
            return table
        at = min(self.catch_up_host, key=lambda b: (abs(math.log(b / bucket)), -b))
        return max(table, self.catch_up_host[at] * min(1.0, bucket / at))

    def best(self, batch_size: int, p: list[float] | None = None, lag: int | None = None, table: bool = False) -> int:
        """argmax_d E(d) / cost(d) at the batch's bucket and context (ties: the shallower), after ``lag`` plain steps
        (default: the steps since the last round): a round first catches the draft up on them, and so does a plain
        step whose stash is full. ``table``: from the start-up table's costs alone (no host time; not cached)."""
        bucket = self.bucket(batch_size)
        self._fresh(bucket)
        return self._argmax(bucket, self.estimate.p if p is None else p, self.lag if lag is None else lag, table)[0]

    def _argmax(self, bucket: int, p: list[float], lag: int, table: bool) -> tuple[int, float, float]:
        """``best`` at a bucket whose costs are fresh: the depth, by how much its rate beats the runner-up's, and
        its cost (a steady run's conditions, ``_clear_win`` and ``_steady_reach``)."""
        totals = None if table else self._totals.get(bucket, {}).get((lag, self._context))
        if totals is None:
            cost = self.cost_at(bucket, table)
            # on a full stash a plain step catches up as well: the catch-up is due whatever the choice, so it weighs
            # on neither (added to both, it would dilute the margin: a round barely ahead won there and again on the
            # smaller batches its accepted drafts leave at the end)
            full = self.window and lag >= self.window
            catch_up = 0.0 if full else (self.catch_up_cost if table else self.catch_up_charge)(bucket, lag)
            totals = [(cost[d] * (1.0 + self.margin) + catch_up) if d > 0 else cost[d] for d in self.tiers]
            if not table:
                self._totals.setdefault(bucket, {})[(lag, self._context)] = totals
        # E(d) for the tiers in ascending order, one pass (the same products and sums as ``expected_tokens``);
        # ties go to the shallower tier
        best, best_rate, best_total, second, e, run, at = self.tiers[0], -math.inf, 0.0, -math.inf, 1.0, 1.0, 0
        for d, total in zip(self.tiers, totals):
            while at < d:
                run *= p[at]
                e += run
                at += 1
            rate = e / total
            if rate > best_rate:
                best, best_rate, best_total, second = d, rate, total, best_rate
            elif rate > second:
                second = rate
        return best, best_rate / second if second > 0 else math.inf, best_total

    def cost_at(self, bucket: int, table: bool = False) -> dict[int, float]:
        """Each tier's step cost at the bucket and the last chosen batch's context: the table's plus the context's
        share, or (not ``table``) max(that, the host's), since ``step_cost`` = max(table, host) and the context only
        adds to the table."""
        if not table:
            self._fresh(bucket)
        ctx, per = self._context, self.context_costs[bucket]
        base = self.costs[bucket] if table else self.step_cost[bucket]
        if not ctx:
            return base
        row = self.costs[bucket]
        return {d: max(base[d], row[d] + per[d] * ctx) for d in self.tiers}

    def probe_every(self, bucket: int, depth: int, probe: int, lag: int) -> int:
        """Steps between probes at ``probe`` while ``depth`` is the choice: the probe's extra time (its catch-up
        included) over ``probe_budget`` of the shallowest tier's step (a plain one where 0 is a tier; the cheapest,
        so that where a choice flips between depths, as at a full stash, probes stay within budget of the steps
        around them), and at least ``probe_interval``."""
        self._fresh(bucket)
        cost = self.step_cost[bucket]
        due = depth == 0 and not (self.window and lag >= self.window)  # (a full stash catches up either way)
        extra = cost[probe] + (self.catch_up_charge(bucket, lag) if due else 0.0) - cost[depth]
        return max(self.probe_interval, math.ceil(extra / (self.probe_budget * cost[self.tiers[0]])))

    def choose(self, batch_size: int, context_tokens: int = 0) -> int:
        steady = self._steady
        if steady is not None:
            if self._step + 1 < steady[1] and not self._drifted:
                if (self._buckets.get(batch_size) == steady[0] and steady[4] <= context_tokens
                        and (context_tokens < steady[5] or not steady[6] and context_tokens < self._extend_run())):
                    self._step += 1
                    self._chosen = steady[2]
                    return steady[3]
                if self._carry_run(batch_size, context_tokens):
                    return steady[3]
            self._end_run()
        self.full_choices += 1
        if self._deferred or self._run_launches:
            self._flush()
        self._context = context_level(context_tokens)
        bucket = self.bucket(batch_size)
        self._fresh(bucket)
        if (self.paused or self._plain_streak >= self.pause_after > 0) and self._stays_paused(batch_size):
            return 0
        self._step += 1
        if self._step % 16 == 0 and self._sampled_at:
            self._expire()
            self._fresh(bucket)  # (a median dropped moves the bucket's costs: its cached choices go)
        depth = self._cached_best(batch_size, bucket, self.lag)
        block = None
        if self.check_pairs:
            depth, block = self._verify(batch_size, bucket, depth)
        # probes climb from the choice without a catch-up due (a round at a full stash is no step up the ladder);
        # a check's steps run its blocks' depths alone
        base = min(depth, self._cached_best(batch_size, bucket, 0))
        chosen = depth  # (before a probe)
        i = self._tier_at[base]
        if block is None and i + 1 < len(self.tiers):
            probe = self.tiers[i + 1]
            cached = self._probe_every.setdefault(bucket, {})
            key = (base, probe, self.lag)
            every = cached.get(key)
            if every is None:
                every = cached[key] = self.probe_every(bucket, base, probe, self.lag)
            if self._step - self._seen[probe] >= every:
                chosen, depth = depth, max(depth, probe)
        for k in self.tiers:
            if k <= depth:
                self._seen[k] = self._step
        # whether this step catches the draft up first (a round after plain steps; a plain step on a full stash):
        # its host time then holds the catch-up's launches, which are not the depth's own cost
        full = bool(self.window and self.lag >= self.window)
        self._chosen = (bucket, depth, self.lag > 0 if depth > 0 else full,
                        self.lag if depth > 0 and not full else 0)
        if depth > 0:
            self.lag = 0
        else:  # (a plain step on a full stash catches up first)
            self.lag = lag_after_plain_step(self.lag, self.window)
        self.last_depth = depth
        if block is not None and block >= 0:
            self._pending[self._step] = [block, depth, None, None, None]
        # (measured: on the prior alone, or on verdicts older than the last pause, a pause would keep plain steps
        # without a probe ever measuring acceptance)
        measured = self.estimate.at[0] > self._resumed_at
        self._plain_streak = self._plain_streak + 1 if depth == 0 and block is None and measured else 0
        if (self.steady_steps > 1 and chosen == depth > 0 and not self._chosen[2] and block is None
                and self.check is None and self._clear_win(bucket, depth)):
            got = self._rests.get(bucket)  # (the check's next reading there ends the run)
            until = self._step + self.steady_steps if got is None else min(self._step + self.steady_steps, got[0] + 16)
            # (its contexts: its level's, extended past it when a step reaches there, ``_extend_run``)
            self._steady = (bucket, self._steady_until(bucket, depth, self._step, until), self._chosen, depth,
                            *context_range(context_tokens), False)
            self._watch(batch_size, depth)
        return depth

    def _carry_run(self, batch_size: int, context_tokens: int) -> bool:
        """The run carried on at another bucket or context level (a batch draining as its last requests end, its
        context with it; or grown), where the full choice there would choose its round, clearly, at the run's
        estimates (its verdicts stay deferred), with no check, probe or verdict's end due: its end, contexts and
        watch set anew there, its drift kept. Such a step costs the choice at the bucket (cached per estimate)
        and none of a full choice's taking in of verdicts and launches, a step's most: done together when the run
        ends, they run warm."""
        depth, step = self._steady[3], self._step + 1
        bucket = self.bucket(batch_size)
        lo, hi = context_range(context_tokens)
        self._context = lo
        self._fresh(bucket)
        if self._cached_best(batch_size, bucket, 0) != depth or not self._clear_win(bucket, depth):
            return False
        until, rest, read = self._steady[1], self._rests.get(bucket), False
        if self.check_pairs:
            if rest is None or step - rest[0] >= 16:  # (``_verify``'s reading at the bucket is due)
                # a carry takes only the plain reading (no verdict there, under two depths measured: no check); any
                # other it leaves to the full choice, which reads it with the run's verdicts and launches taken in
                # (on the run's estimates it could start a check the full choice would not, or end a verdict)
                if bucket in self.verdicts or len(self.host[bucket]) >= 2:
                    return False
                rest, read = (step & ~15, ()), True
            elif rest[1]:  # (the choice there rests on host medians: the full choice checks it)
                return False
            until = min(until, rest[0] + 16)
        until = self._steady_until(bucket, depth, step, until)
        if until <= step:  # (a probe due now, or a verdict's end)
            return False
        if read:
            self._rests[bucket] = rest
        self._step = step
        self._chosen = (bucket, depth, False, 0)
        self._steady = (bucket, until, self._chosen, depth, lo, hi, False)
        keep = self.estimate.decay ** min(1.0, batch_size / self.estimate.full_round)
        self._drift_keep, self._drift_tol = keep, self._tolerance(depth, batch_size, keep)
        return True

    def _watch(self, batch_size: int, depth: int) -> None:
        """The run's watch on acceptance: the drafts a request is expected to accept at ``depth`` (mean, and the
        variance of one request's), and how far their decayed drift may go before the full choice
        (``_tolerance``)."""
        p, mean, sq, run = self.estimate.p, 0.0, 0.0, 1.0
        for i in range(depth):  # (P(accepted > i) = p_1 ... p_{i+1}; E[a^2] = sum over i of (2i + 1) P(a > i))
            run *= p[i]
            mean += run
            sq += (2 * i + 1) * run
        keep = self.estimate.decay ** min(1.0, batch_size / self.estimate.full_round)
        self._expect, self._variance, self._drift, self._drifted = mean, max(0.0, sq - mean * mean), 0.0, False
        self._drift_keep, self._drift_tol = keep, self._tolerance(depth, batch_size, keep)

    def _tolerance(self, depth: int, batch_size: int, keep: float) -> float:
        """``steady_tol`` a draft, or three times the drift's spread on a stationary acceptance at the batch size,
        whichever is more. Not bound by the round's win: where it wins narrowly (the shipped family's depth 3 at
        bs 16, by about 5%, about one spread of the drift), a watch bound by it ended a run every few steps on the
        batch's own noise, each end a full choice."""
        return max(self.steady_tol * depth,
                   3.0 * math.sqrt(self._variance / batch_size * (1.0 - keep) / (1.0 + keep)))

    def _end_run(self) -> None:
        """(The run's tiers were seen at its last step, as the full choice marks a choice's.)"""
        depth, self._steady = self._steady[3], None
        for k in self.tiers:
            if k <= depth:
                self._seen[k] = self._step

    def _extend_run(self) -> float:
        """The run's contexts past its level (``_steady_reach``; at the run's estimate and level, which stand still
        while it runs), once: its new end."""
        bucket, _, _, depth, lo, hi, _ = self._steady
        if (0, self._context) in self._totals.get(bucket, {}):  # (else its costs were refreshed: the run ends there)
            hi = self._steady_reach(bucket, depth, lo, hi)
        self._steady = (*self._steady[:5], hi, True)
        return hi

    def _steady_reach(self, bucket: int, depth: int, lo: int, hi: int) -> float:
        """Where a steady run's contexts end: past ``hi`` (its level's end) while its round surely stays the best.
        Each tier's cost is max(a base, the table's + its slope * context) (``cost_at``): as the context grows from
        ``lo`` (the level chosen at), the round's cost is at most that, and another tier's at least its cost at
        ``lo`` and at least its table's + slope * context; the round wins while its rate at that most beats the
        other's at that least (``_outlasts``). Halfway there: ties go to the shallower tier."""
        per = self.context_costs[bucket]
        if per[depth] <= 0:  # (the context moves no cost here)
            return math.inf
        totals, p = self._totals[bucket][0, self._context], self.estimate.p
        gain = [expected_tokens(p, d) for d in self.tiers]
        i, row, base = self.tiers.index(depth), self.costs[bucket], self.step_cost[bucket]
        mine = (gain[i], 1.0 + self.margin, row[depth], per[depth], base[depth])
        end = min(self._outlasts(*mine, gain[j], totals[j], 1.0 + self.margin if d else 1.0, row[d], per[d])
                  for j, d in enumerate(self.tiers) if j != i)
        return max(hi, lo + 0.5 * (end - lo))

    @staticmethod
    def _outlasts(e: float, s: float, row: float, per: float, base: float,
                  e2: float, t2: float, s2: float, row2: float, per2: float) -> float:
        """The context up to which a tier of ``e`` tokens a step, cost s * max(base, row + per * x), beats one of
        ``e2``, cost at least max(t2, s2 * (row2 + per2 * x)): where the other's first bound alone ensures it (x1),
        extended by the interval [a, b] where the second does, if that interval begins by x1."""
        x1 = (e * t2 / e2 / s - row) / per
        a, b = -math.inf, math.inf
        if per2 > 0:  # e * s2 * (row2 + per2 x) >= e2 * s * base
            a = (e2 * s * base / (e * s2) - row2) / per2
        elif e * s2 * row2 < e2 * s * base:
            return x1
        k, r = e * s2 * per2 - e2 * s * per, e2 * s * row - e * s2 * row2  # e s2 (row2 + per2 x) >= e2 s (row + per x)
        if k > 0:
            a = max(a, r / k)
        elif k < 0:
            b = r / k
        elif r > 0:
            return x1
        return max(x1, b) if a <= x1 and a <= b else x1

    def _clear_win(self, bucket: int, depth: int) -> bool:
        """Whether ``depth``, the choice at no lag, beats every other tier by over ``steady_tol`` in rate (``best``):
        a choice near a tie is made anew each step (estimates that move by less than the tolerance could flip it)."""
        got = self._best.get(bucket, {}).get((0, self._context))
        return got is not None and got[0] == depth and got[1] > 1.0 + self.steady_tol

    def _steady_until(self, bucket: int, depth: int, step: int, until: int) -> int:
        """The first step after ``step`` (a round at ``depth`` at the bucket) that chooses anew: ``until`` at the
        latest, and no later than the next step of ``choose``'s own schedules: host medians expired (at multiples
        of 16 steps), a verdict's end, a probe above the depth (its spacing at the bucket, as the full choice keeps
        it). (The bucket's check reading is the caller's: ``until`` is no later than its next.)"""
        until = min(until, (step // 16 + 1) * 16)
        v = self.verdicts.get(bucket)
        if v is not None and step < v["until"]:
            until = min(until, v["until"])
        i = self._tier_at[depth] + 1
        if i < len(self.tiers):
            probe = self.tiers[i]
            cached = self._probe_every.setdefault(bucket, {})
            every = cached.get((depth, probe, 0))
            if every is None:
                every = cached[depth, probe, 0] = self.probe_every(bucket, depth, probe, 0)
            until = min(until, self._seen[probe] + every)
        return until

    def _stays_paused(self, batch_size: int) -> bool:
        """Whether the next step runs paused (entering the pause where the streak of plain choices is long enough):
        while the step's choice at its bucket and context (no draft lag: its pending inputs are dropped) is a plain
        step, for ``pause_hold`` steps at most; else the pause ends. (Checked at the pause's own bucket too: its
        estimates stand still while paused, but a growing context can make a round the choice there.)"""
        bucket = self.bucket(batch_size)
        if self._cached_best(batch_size, bucket, 0) != 0:
            self.unpause()  # (where it had not begun: the streak starts again)
            return False
        if self._paused_for >= self.pause_hold:
            self.unpause()
            # the running requests' drafts have holes: the probe waits its spacing, for requests admitted since
            for k in self.tiers:
                self._seen[k] = self._step
            return False
        if not self.paused:
            self.paused, self.lag = True, 0  # (the worker drops every request's pending draft inputs)
            self.pauses += 1
            self._drop_check()
        self._paused_for += 1
        self.last_depth = 0
        return True

    def unpause(self) -> None:
        """(The count of plain steps stays 0: the draft was kept in step on none since the pause began.)"""
        if self.paused:
            self._resumed_at = self._step
        self.paused, self._plain_streak, self._paused_for = False, 0, 0

    def _rests_on_host(self, batch_size: int, bucket: int) -> tuple:
        """(the choice, the table's) at the bucket (no catch-up due) where the host's medians measured at the
        bucket alone make the choice deeper and its expected gain over the table's depth is under ``check_band``,
        else (): a median read in a slow spell is off by up to ~12 %, and a round is charged its host time, not its
        wall (up to ~10 % less); a gain past both is no misreading. A verdict at the bucket ends here where it no
        longer holds: a pin where the estimates would carry its measured ratio past the margin, a narrow win where
        the choice's host median moved by the margin (a slow spell began or ended)."""
        p = self.estimate.p
        v = self.verdicts.get(bucket)
        if v is not None and (
                v["ratio"] * expected_tokens(p, v["depth"]) / expected_tokens(p, v["base"]) / v["q"]
                > 1.0 + self.check_margin if not v["kept"] else
                v["close"] and abs(self.host[bucket].get(v["depth"], 0.0) / v["host"] - 1.0) > self.check_margin):
            del self.verdicts[bucket]
        measured = self.host[bucket]
        if len(measured) < 2:  # (no two depths measured here: below, neither choice would be; a batch draining a
            return ()  # bucket a step samples none)
        deep = self._cached_best(batch_size, bucket, 0)
        base = self.best(batch_size, lag=0, table=True)
        if deep <= base or deep not in measured or base not in measured:
            return ()  # (where either is estimated, not measured here, the model's own tries come first)
        cost = self.cost_at(bucket)
        gain = expected_tokens(p, deep) / expected_tokens(p, base) * cost[base] / cost[deep]
        return (deep, base) if gain < 1.0 + self.check_band else ()

    def _verify(self, batch_size: int, bucket: int, depth: int) -> tuple[int, int | None]:
        """The depth to run where the choice rests on host medians (``_rests_on_host``): a running check's next
        step (and its block: -1 where not measured), a verdict's (pinned: the table's depth at most; kept: the
        choice), else the choice (block None)."""
        check = self.check
        got = self._rests.get(bucket)
        if got is None or self._step - got[0] >= (1 if check is not None and check.bucket == bucket else 16):
            # (dated at the last multiple of 16, as the host medians' expiry is: one due step ends a steady run)
            got = self._rests[bucket] = (self._step & ~15, self._rests_on_host(batch_size, bucket))
        rest = got[1]
        if check is not None and check.bucket != bucket:
            check.cross()
        if not rest:
            if check is not None and check.bucket == bucket:  # (the choice no longer rests on the host's costs)
                self._drop_check()
            return depth, None
        v = self.verdicts.get(bucket)
        if v is not None and self._step < v["until"]:
            return (depth if v["kept"] else min(depth, v["base"])), None
        if check is None or check.bucket != bucket or (check.depth, check.base) != rest:
            self._drop_check()
            if depth != rest[0]:  # (it starts where the choice runs: not with a catch-up the model would not pay)
                return depth, None
            check = self.check = RateCheck(bucket, *rest, self.check_block, self.check_pairs, self.check_settle)
        if check.issued < check.total:
            return check.next(self._step)
        if self._step - check.last > 4:  # (its last steps' verdicts never came: a failed step)
            self._conclude()
        return depth, None

    def _drop_check(self, outcome: str = "dropped") -> None:
        if self.check is not None:
            self.check_counts[outcome] += 1
        self.check = None
        self._pending.clear()

    def _measured(self, step: int, rec: list) -> None:
        """A check's step with its interval and tokens both in: added to its block; the verdict where the check is
        complete, or the pairs in so far all decide it by ``check_early`` (most often the first)."""
        del self._pending[step]
        check = self.check
        own, wait = rec[2], rec[3]  # (own None: its launch was not on the clock, as a structured-output step's)
        check.add(rec[0], rec[4], own + wait if own is not None and own >= 0 and wait >= 0 else -1.0)
        if check.complete():
            self._conclude()
        elif rec[0] % 2 == 0 and rec[0] and not check.waiting[rec[0]]:  # (a pair is in)
            ratios = check.ratios()
            if ratios and (min(ratios) >= 1.0 + self.check_margin + self.check_early
                           or max(ratios) <= 1.0 + self.check_margin - self.check_early / 2):
                self._conclude(ratios)

    def _conclude(self, ratios: list[float] | None = None) -> None:
        """The check's verdict from the median of its pairs' ratios (``ratios``: those in so far, decisive; none
        where fewer than two pairs are intact: the next step at the bucket starts a new check)."""
        check = self.check
        if ratios is None:
            ratios = check.ratios()
            if len(ratios) < min(2, self.check_pairs):
                self._drop_check("inconclusive")
                return
        p, ratio = self.estimate.p, statistics.median(ratios)
        kept = ratio >= 1.0 + self.check_margin
        self._drop_check("kept" if kept else "pinned")
        # a narrow win is checked again sooner, and as soon as the choice's host median moves by the margin: in the
        # machine's slow spells the host-bound base step slows and a device-bound round does not, so a win measured
        # in one need not outlast it (nor, with it, the base's host median it left, which the choice then rests on)
        close = kept and ratio < 1.0 + self.check_margin + self.check_early
        self.verdicts[check.bucket] = {
            "kept": kept, "close": close, "host": self.host[check.bucket].get(check.depth, 0.0) or 1.0,
            "ratio": ratio, "until": self._step + (self.check_hold // 4 if close else self.check_hold),
            "depth": check.depth, "base": check.base,
            "q": expected_tokens(p, check.depth) / expected_tokens(p, check.base)}

    def observe(self, depth: int, accepted: list[int]) -> None:
        if self._steady is None and not self._deferred:
            return self._observe(depth, accepted, self._step)
        self._deferred.append((depth, accepted, self._step))
        # (no verdicts: every request's draft has holes, and the engine sends []; the estimate skips them too)
        if depth and accepted and self._steady is not None:
            # the run's watch on acceptance: its drafts accepted a request, decayed as the estimate decays, against
            # what the estimate expected when the run began; past ``steady_tol`` a draft, the full choice is made
            keep = self._drift_keep
            self._drift = keep * self._drift + (1.0 - keep) * (sum(accepted) / len(accepted) - self._expect)
            # (both ways at every tier, the deepest too: a rising mean can hide a falling position, the first
            # ones up and the last down, where a shallower tier's expected tokens gain on the deepest's)
            if abs(self._drift) > self._drift_tol:
                self._drifted = True

    def _flush(self) -> None:
        """What a steady run deferred, in the order it came: its verdicts and lost steps (a stretch of rounds alike
        as one update, ``AcceptanceEstimate.update``'s ``rounds``; the last two each on its own, as they may be
        what ended the run), then its launches, whose host samples are taken in together (``_settle``)."""
        events, self._deferred = self._deferred, []
        head = events[:-2]
        for at, k in stretches(head):
            depth = head[at][0]
            if depth is None:
                for _ in range(k):
                    self._lost()
            elif k > 1:
                stretch = head[at:at + k]
                self._observe(depth, list(itertools.chain.from_iterable(map(_SECOND, stretch))), stretch[-1][2], k)
            else:
                self._observe(depth, head[at][1], head[at][2])
        for depth, accepted, step in events[-2:]:
            if depth is None:
                self._lost()
            else:
                self._observe(depth, accepted, step)
        launches, self._run_launches = self._run_launches, []
        self._take_launches(launches)
        if self._unsettled:
            self._settle()

    def _take_launches(self, launches: list[tuple]) -> None:
        """``_launched`` for each of a run's launches, in order, but where launches follow two of their own bucket
        and depth without a catch-up, each contiguous with the one before (most of a run's), as a block: each
        interval samples the launch before it, and the block's samples enter their window together."""
        runs, i, n = self._launches, 0, len(launches)
        while i < n:
            now, waited, contiguous, chosen, step = launches[i]
            if (contiguous and chosen is not None and self.host_samples and not self._pending and len(runs) >= 2
                    and runs[-2][0] == runs[-1][0] == chosen[0] and runs[-2][1] == runs[-1][1] == chosen[1]
                    and not (runs[-2][2] or runs[-1][2] or runs[-1][3] or chosen[2] or chosen[3])):
                j = i + 1
                while j < n and launches[j][2] and launches[j][3] is chosen:
                    j += 1
                block, prev = launches[i:j], runs[-1]
                unit, t0 = self.host_unit, prev[4]
                ms = []
                for e in block:  # (each interval less its wait: a sample of the launch before it)
                    ms.append(max(0.0, e[0] - t0 - e[1]) * unit)
                    t0 = e[0]
                prev[5] = ms[0]
                if len(block) > 1:
                    runs.append([*chosen, block[-2][0], ms[-1]])
                runs.append([*chosen, block[-1][0], None])
                self._launch_at = (block[-1][4], block[-1][0])
                last = len(ms) - 1  # (the step of the newest sample above 0, as one by one)
                while last >= 0 and ms[last] <= 0:
                    last -= 1
                ms = [m for m in ms if m > 0]
                if ms:
                    self._samples(chosen[0], chosen[1], block[last][4], ms)
                i = j
            else:
                self._launched(now, waited, contiguous, chosen, step)
                i += 1

    def _samples(self, bucket: int, depth: int, step: int, ms) -> None:
        """``_sample`` of each of ``ms`` (all > 0), the last at ``step``."""
        self._sampled_at[bucket, depth] = step
        recent = self._host_runs.get((bucket, depth))
        if recent is None:
            recent = self._host_runs[bucket, depth] = deque(maxlen=self.host_samples)
        recent.extend(ms)
        self._unsettled.add((bucket, depth))

    def _observe(self, depth: int, accepted: list[int], step: int, rounds: int = 1) -> None:
        self.estimate.update(depth, accepted, step, rounds)
        self._observed += rounds
        rec = self._pending.get(self._observed) if self._pending else None
        if rec is not None:  # a check's step: the tokens it appended (one each, and a round's accepted drafts)
            if depth != rec[1]:  # (not the depth chosen: a structured round)
                self.check.cross(rec[0])
            rec[4] = len(accepted) + (sum(accepted) if depth else 0)
            if rec[3] is not None:
                self._measured(self._observed, rec)

    def lost(self) -> None:
        """A chosen step failed: its verdicts never come, so the verdicts after it pair with the steps after it (the
        n-th ``observe`` or ``lost`` is the n-th step chosen). A check's step among them discards its block."""
        if self._steady is not None or self._deferred:
            self._deferred.append((None, None, self._step))
        else:
            self._lost()

    def _lost(self) -> None:
        self._observed += 1
        rec = self._pending.pop(self._observed, None) if self._pending else None
        if rec is not None:
            check = self.check
            check.cross(rec[0])
            check.add(rec[0], 0, -1.0)
            if check.complete():
                self._conclude()

    def sync_lag(self, lag: int) -> None:
        """The count of plain steps is the batch's own: a new batch's requests start with none behind, and one
        counted on from the last batch put the chooser's full stashes (where a catch-up is due whatever the
        choice, and most probes fall) where the worker's are not."""
        self.lag = lag
        if lag and self._steady is not None:  # (a steady round runs at none: repeated, it would neither charge the
            self._end_run()  # catch-up nor count it done)

    def launched(self, now: float, waited: float, contiguous: bool) -> None:
        chosen, self._chosen = self._chosen, None
        if self._steady is not None:
            self._run_launches.append((now, waited, contiguous, chosen, self._step))
            return
        self._launched(now, waited, contiguous, chosen, self._step)
        if self._unsettled:
            self._settle()

    def _launched(self, now: float, waited: float, contiguous: bool, chosen: tuple | None, step: int) -> None:
        """Host-time samples from consecutive launches (no sync). Under the overlap schedule the interval from
        launching step n to launching step n + 1 holds step n's launch, reading and applying step n - 1's results
        (the read waits for the device where it is behind: ``waited``, left out) and planning step n + 1. So the
        interval less the wait is a sample of depth d's host cost where steps n - 1 and n both ran at d (same
        bucket, neither catching the draft up). A lone step p at depth d between steps at a base depth b (a probe)
        spreads over two intervals: their sum less host(b) samples depth d. A round that caught the draft up short
        of a full stash samples the catch-up's host time: its interval (its launch, the catch-up's included) less
        the host cost of its depth."""
        if self._pending:  # a check's steps: the host time of the step launched last, the wait for the one before
            contiguous = contiguous and self._launch_at[0] == step - 1
            rec = self._pending.get(step - 1)
            if rec is not None:
                rec[2] = now - self._launch_at[1] - waited if contiguous else -1.0
            rec = self._pending.get(step - 2)
            if rec is not None and rec[3] is None:
                rec[3] = waited if contiguous else -1.0
                if rec[4] is not None:
                    self._measured(step - 2, rec)
        self._launch_at = (step, now)
        if chosen is None or not self.host_samples:  # (host_samples 0: the table alone)
            return
        runs = self._launches
        if not contiguous:
            runs.clear()
        elif runs:
            runs[-1][5] = max(0.0, now - runs[-1][4] - waited) * self.host_unit
            if runs[-1][3]:
                self._sample_catch_up(runs[-1])
        runs.append([*chosen, now, None])
        if len(runs) < 3:
            return
        a, s = runs[-3], runs[-2]
        bucket = s[0]
        if a[0] == bucket and a[1] == s[1] and not a[2] and not s[2] and s[5] is not None:
            self._sample(bucket, s[1], s[5], step)
        elif len(runs) == 4:
            base, p = runs[0], a
            base_host = self.host[bucket].get(s[1])
            if (base[0] == p[0] == bucket and base[1] == s[1] != p[1] and not (base[2] or p[2] or s[2])
                    and p[5] is not None and s[5] is not None and base_host is not None):
                self._sample(bucket, p[1], p[5] + s[5] - base_host, step)

    def _sample_catch_up(self, run: list) -> None:
        """A round's catch-up short of a full stash: its interval less its depth's host cost (where one is known)."""
        bucket, depth, host_ms = run[0], run[1], run[5]
        own = self.host_cost(bucket, depth)
        if own <= 0:
            return
        recent = self._catch_up_runs.get(bucket)
        if recent is None:
            recent = self._catch_up_runs[bucket] = deque(maxlen=self.host_samples)
        recent.append(max(0.0, host_ms - own))
        median = _median(recent)
        old = self.catch_up_host.get(bucket)
        self._fresh(bucket)
        if old is not None and abs(median - old) <= self.host_change * max(old, self.step_cost[bucket][0]):
            return
        self.catch_up_host[bucket] = median
        for cache in (self._best, self._totals, self._probe_every, self._rests):  # (buckets not observed borrow it)
            cache.clear()

    def _sample(self, bucket: int, depth: int, ms: float, step: int) -> None:
        if ms > 0:
            self._samples(bucket, depth, step, (ms,))

    def _settle(self) -> None:
        """The host medians of the (bucket, depth)s sampled since the last call (a steady run's, together)."""
        moved = False
        for bucket, depth in self._unsettled:
            recent = self._host_runs.get((bucket, depth))
            if recent is None or len(recent) < self.host_min_samples:
                continue
            # the median: a step's own outliers (a collection of the youngest generation, a joining request's
            # catch-up, the machine's other load) move it little
            median = _median(recent)
            host = self.host[bucket]
            old = host.get(depth)
            if old is not None and abs(median - old) <= self.host_change * old:  # (kept: choices are recomputed
                continue  # rarely)
            host[depth], moved = median, True
        self._unsettled.clear()
        if moved:
            self._learn_increment()
            # (every bucket's costs may move: buckets not measured borrow the nearest measured one's)
            self._host_gen += 1

    def _expire(self) -> None:
        """Drop the host medians above the table that were last sampled over ``host_ttl`` steps ago: such a depth
        is then estimated from the depths measured since (``host_cost``: optimistic), so it is chosen again where
        the table favours it and measured anew; if the host really is that slow there, a few steps bring it back."""
        stale = [(b, d) for (b, d), at in self._sampled_at.items()
                 if self._step - at > self.host_ttl and self.host[b].get(d, 0.0) > self.costs[b][d]]
        if not stale:
            return
        for b, d in stale:
            del self.host[b][d], self._sampled_at[b, d]
            self._host_runs.pop((b, d), None)
        self._learn_increment()
        self._host_gen += 1

    def _learn_increment(self) -> None:
        """The host's increment per request and draft depth, the median over buckets where a plain step and a
        round were both measured (a deeper round reads, appends and counts more tokens per request)."""
        incs = sorted(max(0.0, (h[d] - h[0]) / (b * d)) for b, h in self.host.items() if 0 in h
                      for d in h if d > 0)
        if incs:
            self.host_per_depth = incs[len(incs) // 2]

    def host_cost(self, bucket: int, depth: int) -> float:
        """The host's time of a step at ``depth`` (0: unknown): measured, else the nearest shallower depth measured
        at the bucket plus the learnt increment per request and depth (a deeper round never costs the host less),
        else the nearest deeper one's scaled down (``_host_row``). Never raised from another depth's excess over the
        table: a device estimate plus one bucket's noisy walls overshot that way. A bucket with no depth measured (a
        batch shrinking as its requests end) takes the nearest measured bucket's, scaled by the batch (its fixed part
        scaled too: under the truth below it, so the table keeps more say there)."""
        return self._host_row(bucket)[self.tiers.index(depth)]

    def _host_row(self, bucket: int) -> list[float]:
        """``host_cost`` at every tier, in one pass (a bucket's costs are refreshed whenever a host median moves)."""
        host, at = self.host[bucket], bucket
        if not host:
            measured = [b for b in self.buckets if self.host[b]]
            if not measured:
                return [0.0] * len(self.tiers)
            at = min(measured, key=lambda b: (abs(math.log(b / bucket)), -b))
            host = self.host[at]
        scale, inc, table = bucket / at, self.host_per_depth * at, self.costs[at]
        lowest = min(host)
        row, below = [], None  # (below: the deepest depth measured under the tier)
        for d in self.tiers:
            if d in host:
                cost, below = host[d], d
            elif below is not None:
                cost = host[below] + inc * (d - below)
            else:
                # a shallower depth not yet run here: the deeper one's time scaled by the table's ratio (or less the
                # learnt increment, whichever is less). Optimistic on purpose: a depth the chooser picks gets
                # measured and corrects itself, while one it never picks would keep an overestimate for good
                cost = min(host[lowest] * table[d] / table[lowest], max(0.0, host[lowest] - inc * (lowest - d)))
            row.append(cost * scale)
        return row

    def _fresh(self, bucket: int) -> None:
        """The bucket's step costs as of the host's latest medians (``_refresh`` where one moved since)."""
        if self._fresh_at.get(bucket) != self._host_gen:
            self._fresh_at[bucket] = self._host_gen
            self._refresh(bucket)

    def _refresh(self, bucket: int) -> None:
        """The bucket's step costs, max(table, host) per depth, the host's never less at a deeper tier than at a
        shallower one (a probe's sample, two intervals less a third, is the noisiest); its cached choices are
        dropped only when one moved by more than ``host_change``."""
        new = self._refreshed(bucket)
        if new is None:
            return
        self.step_cost[bucket] = new
        for cache in (self._rests, self._best, self._totals, self._probe_every):
            cache.pop(bucket, None)

    def _refreshed(self, bucket: int) -> dict[int, float] | None:
        """``_refresh``'s new step costs of the bucket, None where they stay (reads only)."""
        table = self.costs[bucket]
        new, host = {}, 0.0
        for d, cost in zip(self.tiers, self._host_row(bucket)):
            host = max(host, cost)
            new[d] = max(table[d], host)
        cur = self.step_cost[bucket]
        if all(abs(new[d] - cur[d]) <= self.host_change * cur[d] for d in self.tiers):
            return None
        return new

    def stats(self) -> dict:
        """(As of the last full choice: what a steady run deferred is taken in by the next one, in the engine's
        thread; /v1/stats calls this from another.)"""
        # (reads only: ``_fresh`` here dropped the engine thread's cached choices under it, e.g. between
        # ``_extend_run``'s check of its totals and its read; a bucket's costs shown as its next choice reads them)
        gen, check = self._host_gen, self.check
        cost = {b: (self.step_cost[b] if self._fresh_at.get(b) == gen else self._refreshed(b) or self.step_cost[b])
                for b, o in self.host.items() if o}
        return {"policy": "adaptive", "acceptance": [round(x, 4) for x in self.estimate.p],
                "last_depth": self.last_depth, "tiers": self.tiers, "draft_lag": self.lag,
                "context_tokens": self._context,  # (the last chosen batch's, coarsened)
                # per bucket with host samples: the host's median per depth, and the costs the choice reads
                "host_ms": {str(b): {str(d): round(h, 4) for d, h in sorted(o.items())}
                            for b, o in self.host.items() if o},
                "step_cost_ms": {str(b): {str(d): round(c[d], 4) for d in self.tiers} for b, c in cost.items()},
                "host_ms_per_request_depth": round(self.host_per_depth, 6),
                # per bucket observed: the host's ms of a round's catch-up short of a full stash
                "catch_up_host_ms": {str(b): round(h, 4) for b, h in sorted(self.catch_up_host.items())},
                # the realized-rate checks: per bucket the last verdict (the choice kept, or pinned to the table's
                # depth; its rate over the base's; steps until it is checked again), and the one running
                "rate_check": {str(b): {"verdict": "kept" if v["kept"] else "pinned", "depth": v["depth"],
                                        "base": v["base"], "rate_vs_base": round(v["ratio"], 4),
                                        "recheck_in": max(0, v["until"] - self._step)}
                               for b, v in sorted(self.verdicts.items())},
                "checking": check.stats() if check is not None else None,
                "checks": dict(self.check_counts),
                # the draft's pause: on now, how many began (the engine counts the steps run paused)
                "draft_paused": self.paused, "pauses": self.pauses}


PAUSED = "paused"  # a ``DepthSchedule`` entry: a plain step with the draft paused


class DepthSchedule:
    """Depths forced in order, cycling (tests and benchmarks: a fixed depth is a one-entry schedule); an entry
    ``PAUSED`` is a plain step with the draft paused."""

    def __init__(self, depths: list[int | str]):
        if not depths:
            raise ValueError("an empty depth schedule")
        self.depths = list(depths)
        self._next = 0
        self.last_depth: int | None = None
        self.paused = False

    def choose(self, batch_size: int, context_tokens: int = 0) -> int:
        depth = self.depths[self._next % len(self.depths)]
        self._next += 1
        self.paused = depth == PAUSED
        self.last_depth = 0 if self.paused else depth
        return self.last_depth

    def unpause(self) -> None:
        self.paused = False

    def observe(self, depth: int, accepted: list[int]) -> None:
        pass

    def lost(self) -> None:
        pass

    def sync_lag(self, lag: int) -> None:
        pass

    def launched(self, now: float, waited: float, contiguous: bool) -> None:
        pass

    def stats(self) -> dict:
        return {"policy": "schedule", "depths": self.depths, "last_depth": self.last_depth, "draft_paused": self.paused}
