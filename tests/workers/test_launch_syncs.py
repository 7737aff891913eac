"""Launching a step never waits for the device. Under the overlap schedule the worker launches a step while the one
before it still runs; anything in the launch that makes the host wait for the GPU (reading a device value, a
blocking host→device copy) stalls the pipeline until the step in flight is done, and the device then idles while the
host plans. On a CPU nothing waits, so this runs the launches under a dispatch mode that records the operations which
synchronize on a GPU: EXTEND steps (prompts arriving while speculative rounds run) and DECODE steps through the
graph path (static inputs, callables run as they are here), with and without speculation."""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deployments.engine.request import SamplingParams
from tests.engine.test_arrivals import drive
from tests.helpers import mixed_prompts
from tests.speculative.test_speculative import engine, spec_models  # noqa: F401  (fixture)
from workers.config import SpeculativeConfig

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
    """Every step launch of ``eng``'s worker runs under one SyncLint; returns it and the launches by mode."""
    worker = eng.executor.worker
    launch, lint, modes = worker._launch, SyncLint(), {}

    def linted(step):
        modes[step.mode.value] = modes.get(step.mode.value, 0) + 1
        with lint:
            return launch(step)

    worker._launch = linted
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
