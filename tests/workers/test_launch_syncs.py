"""Launching a step never waits for the device. Under the overlap schedule the worker launches a step while the one
before it still runs; anything in the launch that makes the host wait for the GPU (reading a device value, a
blocking host→device copy) stalls the pipeline until the step in flight is done, and the device then idles while the
host plans. On a CPU nothing waits, so this runs the launches under a dispatch mode that records the operations which
synchronize on a GPU: EXTEND steps (prompts arriving while speculative rounds run) and DECODE steps through the
graph path (static inputs, callables run as they are here), with and without speculation. And a speculative engine's
plain step launches, outside its graph replays, what a step without speculation launches (on a GPU anything more is
host work or a copy every step; on a CPU, below the noise of a timing)."""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deployments.engine.request import SamplingParams
from tests.engine.test_arrivals import drive
from tests.helpers import mixed_prompts
from tests.speculative.test_speculative import engine, spec_models  # noqa: F401  (fixture)
from workers.config import SpeculativeConfig
from workers.messages import ForwardMode

aten = torch.ops.aten
# their result is a host value (or a shape) computed from device data: the host waits for the device
# (under inference mode, which the worker's launches run in, ``int(t)`` / ``t.item()`` reach the mode as
# ``aten.item``, not decomposed into ``_local_scalar_dense``)
READS_DEVICE = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal, aten.nonzero, aten.masked_select,
                aten._unique2, aten.unique_consecutive, aten.unique_dim, aten.bincount}


class SyncLint(TorchDispatchMode):
    """Records the operations that make the host wait for a GPU: host reads of device values, boolean-mask
    indexing (a nonzero inside), repeat_interleave without ``output_size``, and a Python number written through
    an index tensor (``t[idx] = 1``: the number becomes a host tensor that is copied over with a blocking copy)."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []
        self._host_scalars: list[torch.Tensor] = []  # Python numbers lifted to 0-dim host tensors
        self._tolist = None

    def __enter__(self):
        # ``Tensor.tolist`` reads a CPU tensor's memory without dispatching any operation (on a GPU: a blocking copy)
        self._tolist, real = torch.Tensor.tolist, torch.Tensor.tolist

        def tolist(t, *args, **kwargs):
            self._record("Tensor.tolist")
            return real(t, *args, **kwargs)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def _record(self, what: str) -> None:
        caller = next((f for f in reversed(traceback.extract_stack()[:-2]) if "/torch/" not in f.filename), None)
        self.found.append(what if caller is None else f"{what} ({caller.filename}:{caller.lineno})")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = func.overloadpacket
        if op in READS_DEVICE:
            self._record(str(func))
        elif (func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor)
              and kwargs.get("output_size") is None):  # (repeats in a tensor: the output's length is data)
            self._record(f"{func} without output_size")
        elif op in (aten.index, aten.index_put_, aten.index_put):
            indices = [i for i in args[1] if i is not None]
            if any(i.dtype in (torch.bool, torch.uint8) for i in indices):
                self._record(f"{func} with a boolean mask")
            if op is not aten.index and any(args[2] is s for s in self._host_scalars):
                self._record(f"{func} of a Python number")
        if op is aten.lift_fresh and isinstance(out, torch.Tensor) and out.dim() == 0:
            self._host_scalars.append(out)
        return out


def _lint_launches(eng) -> tuple[SyncLint, dict]:
    """Every call of ``eng``'s worker's step runs under one SyncLint (the page grants' copy, the launch, and the
    reading of the older steps' results); returns it and the launches by mode."""
    worker = eng.executor.worker
    worker_step, lint, modes = worker.step, SyncLint(), {}

    def linted(step, keep=0):
        if step is not None:
            modes[step.mode.value] = modes.get(step.mode.value, 0) + 1
        with lint:
            return worker_step(step, keep)

    worker.step = linted
    return lint, modes


SPEC = [None, ("eagle3", 3, 1, None), ("draft", 2, 2, 4), ("eagle", 3, 1, None)]


@pytest.mark.parametrize("method", SPEC, ids=[m[0] if m else "none" for m in SPEC])
def test_launches_never_wait_for_the_device(spec_models, method):  # noqa: F811
    spec = None
    if method is not None:
        name, steps, topk, ndt = method
        spec = SpeculativeConfig(method=name, model=str(spec_models[name]), num_steps=steps, topk=topk,
                                 num_draft_tokens=ndt)
    # separate EXTEND and DECODE steps, both overlapped (as where decode replays graphs), short chunks
    eng = engine(spec_models["target"], spec, cuda_graph_max_bs=8, page_size=4, max_prefill_tokens=24,
                 mixed_decode_rows=0)
    eng.executor.worker.capture_graphs()
    lint, modes = _lint_launches(eng)
    # every third request with penalties, logit_bias and min_tokens (their set-up and the +logits graph variant)
    params = [SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True,
                             **({} if i % 3 else dict(frequency_penalty=0.5, repetition_penalty=1.2,
                                                      logit_bias={5: 2.0}, min_tokens=2, stop_token_ids=[7])))
              for i in range(10)]
    _, counts = drive(eng, params, mixed_prompts(10, seed=3))
    assert modes.get("extend", 0) >= 6 and modes.get("decode", 0) >= 10, modes
    assert counts["read_at_once"] < counts["extend"] + counts["decode"]  # the steps did overlap
    assert eng.executor.worker.graphs.num_replays >= 10  # the DECODE steps went through the graph path
    assert lint.found == [], lint.found



def test_prefill_graph_launches_never_wait_for_the_device(spec_models):  # noqa: F811
    """Prefills through the prefill graphs' path (static inputs filled from the step's host arrays, one padding
    request, the callables run as they are here), overlapped with decode steps: (the test above sends every
    prefill step eagerly: each holds a request with penalties or more tokens than its one bucket)."""
    eng = engine(spec_models["target"], cuda_graph_max_bs=8, page_size=4, max_prefill_tokens=32,
                 mixed_decode_rows=0)
    eng.executor.worker.capture_graphs()
    lint, modes = _lint_launches(eng)
    params = [SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.8, top_p=1.0 if i % 3 else 0.9, seed=i,
                             ignore_eos=True) for i in range(10)]
    _, counts = drive(eng, params, mixed_prompts(10, seed=3))
    assert counts["read_at_once"] < counts["extend"] + counts["decode"]  # the steps did overlap
    assert eng.executor.worker.extend_graphs.num_replays >= 3, modes
    assert lint.found == [], lint.found

@pytest.mark.parametrize("name", ["eagle3", "draft"])
def test_plain_steps_and_catch_ups_never_wait_for_the_device(spec_models, name):  # noqa: F811
    """Adaptive speculation's depths forced: plain steps (lengths moved on the host), the draft's eager catch-ups
    before rounds and on full stashes of 2 (EAGLE-3, adaptive: replayed from the catch-up's graphs), rounds of
    every depth."""
    from speculative.adaptive import DepthSchedule

    spec = SpeculativeConfig(method=name, model=str(spec_models[name]), num_steps=3, catch_up_window=2,
                             adaptive=name == "eagle3")
    eng = engine(spec_models["target"], spec, cuda_graph_max_bs=8, page_size=4, max_prefill_tokens=24)
    eng.executor.worker.capture_graphs()
    eng.depth_policy = DepthSchedule([0, 0, 0, 2, 0, 3, 0, 0, 1])
    lint, modes = _lint_launches(eng)
    _, counts = drive(eng, [SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.8, seed=i,
                                           ignore_eos=True) for i in range(10)], mixed_prompts(10, seed=3))
    assert counts["read_at_once"] < counts["extend"] + counts["decode"]  # the steps did overlap
    assert eng.executor.worker.catch_ups[0] > 0 and set(eng.steps_by_depth) == {0, 1, 2, 3}
    assert eng.executor.worker.graphs.catch_up_graphs == (name == "eagle3")
    assert lint.found == [], lint.found


def test_the_lint_sees_what_waits():
    """Each kind of synchronizing operation is recorded; index writes of device values, index_fill_ and a
    repeat_interleave with its output size are not."""
    a, idx = torch.zeros(8, dtype=torch.int64), torch.tensor([1, 2])
    with SyncLint() as lint:
        a[idx] = 1
        a.index_fill_(0, idx, 1)
        a[idx] = torch.tensor([3, 4])
        a[a > 2] = 0
        torch.repeat_interleave(idx, idx)
        torch.repeat_interleave(idx, idx, output_size=3)
        int(a.sum())
    assert [f.split(" (")[0] for f in lint.found] == [
        "aten.index_put_.default of a Python number", "aten.index_put_.default with a boolean mask",
        "aten.index_put_.default of a Python number", "aten.repeat_interleave.Tensor without output_size",
        "aten._local_scalar_dense.default"]
    with torch.inference_mode():  # (as the worker launches)
        b = torch.zeros(4, dtype=torch.int64)
        with SyncLint() as lint:
            int(b[0])
            b.sum().item()
            b.tolist()
    assert [f.split(" (")[0] for f in lint.found] == ["aten.item.default"] * 2 + ["Tensor.tolist"]
    assert torch.Tensor.tolist is not None and b.tolist() == [0] * 4


class OutsideReplays(TorchDispatchMode):
    """Counts the operations a worker's DECODE steps run outside their graph replays (on a GPU each is an eager
    kernel or copy the host launches every step; inside a replay, on a CPU, the captured callables run), keyed by
    (operation, the worker file and function that ran it), and the replays by graph name."""

    def __init__(self, graphs):
        super().__init__()
        self.ops: Counter = Counter()
        self.replays: Counter = Counter()
        self._inside = False
        replay = graphs.replay

        def counted(key):
            self.replays[key[0]] += 1
            self._inside = True
            try:
                return replay(key)
            finally:
                self._inside = False

        graphs.replay = counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside:
            frame = next(f for f in reversed(traceback.extract_stack()[:-1]) if "/torch/" not in f.filename
                         and not f.filename.endswith("test_launch_syncs.py"))
            self.ops[(str(func), f"{frame.filename.rsplit('/', 1)[-1]}:{frame.name}")] += 1
        return func(*args, **(kwargs or {}))


def _decode_steps_outside_replays(eng, params, prompts) -> tuple[OutsideReplays, int]:
    worker = eng.executor.worker
    worker.capture_graphs()
    count, worker_step, steps = OutsideReplays(worker.graphs), worker.step, [0]

    def step(s, keep=0):
        if s is None or s.mode != ForwardMode.DECODE:
            return worker_step(s, keep)
        steps[0] += 1
        with count:
            return worker_step(s, keep)

    worker.step = step
    for prompt, p in zip(prompts, params):  # (one batch within the largest bucket: every DECODE step replays)
        eng.add_request(prompt, p)
    while eng.has_work():
        eng.step()
    return count, steps[0]


def _beside_no_speculation(spec_models, depth):  # noqa: F811
    """(the step without speculation's launches and steps, an adaptive EAGLE-3 engine forced to ``depth`` every
    step, a call running it on the same requests and returning its launches and steps)."""
    from speculative.adaptive import DepthSchedule

    params = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True) for _ in range(8)]
    prompts = mixed_prompts(8, seed=3)
    kw = dict(cuda_graph_max_bs=8, page_size=4, max_prefill_tokens=24)
    base = _decode_steps_outside_replays(engine(spec_models["target"], **kw), params, prompts)
    spec = SpeculativeConfig(method="eagle3", model=str(spec_models["eagle3"]), num_steps=3, catch_up_window=4,
                             adaptive=True)
    eng = engine(spec_models["target"], spec, **kw)
    eng.depth_policy = DepthSchedule([depth])
    return base, eng, lambda: _decode_steps_outside_replays(eng, params, prompts)


def test_plain_steps_launch_what_no_speculation_launches(spec_models):  # noqa: F811
    """A speculative engine's plain step (adaptive depth 0) on the graph path launches what a step without
    speculation launches: the same kinds of operations outside its replays (the static inputs' copy, the page
    grants, the outputs' rows; grants fall on other steps, its requests reserving pages for a round's drafts) and
    one replay, plus on a full stash the catch-up's lags copy and its graph's replay. Anything else there is host
    work on a GPU that the step without speculation does not pay (an eager kernel, a copy, a second replay), which
    the CPU's timings of the host path cannot tell from noise."""
    (base, base_steps), eng, run = _beside_no_speculation(spec_models, 0)
    plain, plain_steps = run()
    catch_ups = eng.executor.worker.catch_ups[0]
    assert set(eng.steps_by_depth) == {0} and catch_ups >= 2, (eng.steps_by_depth, catch_ups)
    assert base.replays == {"decode": base_steps}
    # (a plain step's catch-ups replayed, not eager: all but each request's newest position on a full stash)
    assert plain.replays == {"decode": plain_steps, "catch_up_behind": catch_ups}
    lags = {(op, "graphs.py:_fill_catch_up_lags") for op in ("aten.copy_.default", "aten.slice.Tensor")}
    assert set(plain.ops) <= set(base.ops) | lags, set(plain.ops) - set(base.ops) - lags
    assert plain.ops[("aten.copy_.default", "graphs.py:_fill_catch_up_lags")] == catch_ups
    for count, steps in ((base, base_steps), (plain, plain_steps)):  # one static inputs' copy a step
        assert count.ops[("aten.copy_.default", "graphs.py:fill")] == steps


def test_paused_steps_launch_what_no_speculation_launches(spec_models):  # noqa: F811
    """With adaptive speculation's draft paused, a plain step on the graph path launches what a step without
    speculation launches: the same kinds of operations outside its replays and one replay of the step without
    speculation's graph; no stash inside it, no catch-up, no lags copy. The pause's first step alone adds one
    operation: every slot's advance set to one (the steps after it append one token each)."""
    from speculative.adaptive import PAUSED
    from workers.graphs import PAUSED_DEPTH

    (base, base_steps), eng, run = _beside_no_speculation(spec_models, PAUSED)
    worker = eng.executor.worker
    stashes, stash = [], worker.proposer.stash
    worker.proposer.stash = lambda *a: stashes.append(1) or stash(*a)
    keys, replay = [], worker.graphs.replay
    worker.graphs.replay = lambda key: keys.append(key) or replay(key)
    paused, paused_steps = run()
    assert eng.paused_steps == paused_steps and not eng.steps_by_depth
    assert paused.replays == {"decode": paused_steps} and all(k[-1] == PAUSED_DEPTH for k in keys)
    assert not stashes and worker.catch_ups == [0, 0]
    assert paused.ops.pop(("aten.fill_.Scalar", "worker.py:_paused_step")) == 1
    assert set(paused.ops) <= set(base.ops), set(paused.ops) - set(base.ops)
    assert paused.ops[("aten.copy_.default", "graphs.py:fill")] == paused_steps
