"""Sparse MLA's long-rows graphs (``workers.graphs.SelectionVariant``) on the CPU graph path: every decode graph is
captured twice, and a step replays the long-rows one only where its contexts guarantee that every real row of every
sparse forward (plain decode, draft steps, verify, the draft's catch-up) selects its whole top-k, which is what the
FlashInfer MLA kernel of ``attention.sparse_flashinfer`` needs. The long-rows mode here runs the reference kernels
and checks each such forward's selections; tokens equal the eager engine's."""

from __future__ import annotations

from collections import Counter

import pytest

from attention.sparse_torch_native import SparseTorchNativeBackend
from deployments.engine.engine import Engine
from deployments.engine.request import SamplingParams
from deployments.make_tiny import make_tiny
from speculative.adaptive import PAUSED, DepthSchedule
from workers.config import EngineConfig, SpeculativeConfig
from workers.graphs import LONG_ROWS, ROW_MARGIN, SelectionVariant

TOPK = 8
GREEDY = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)


class WatchedSelection(SparseTorchNativeBackend):
    """The reference backend with the long-rows mode, taken (as by ``sparse_flashinfer``) by forwards of more than one
    row: such a forward fails unless each real row (not a graph's padding row, whose page-table row is the pad slot)
    selected ``topk`` slots."""

    supports_full_selection = True

    def __init__(self, pad_slot: int):
        super().__init__()
        self.full_selection, self.pad_slot, self.forwards, self.long_rows_forwards = False, pad_slot, Counter(), 0

    def forward_sparse(self, q_latent, q_rope, index_q, index_w, layer, fb):
        long = self.full_selection and q_latent.shape[0] > 1
        if long:
            m, cache = fb.attn_metadata, fb.kv_cache
            slots = self.indexer_topk(index_q, index_w, cache.index_k[layer.layer_id], fb.page_table.table,
                                      m.row_req, m.row_len, fb.page_table.page_size, layer.topk, fp8=cache.index_fp8,
                                      tree_bits=m.tree_bits, tree_len=m.tree_len, rows_per_req=m.rows_per_req)
            real = m.row_req != self.pad_slot
            short = (slots[real] < 0).any(1)
            assert not short.any(), f"a long-rows {fb.mode.name} forward has rows short of their top-k"
            self.long_rows_forwards += 1
        self.forwards[(long, fb.mode.name)] += 1
        return super().forward_sparse(q_latent, q_rope, index_q, index_w, layer, fb)


@pytest.fixture(scope="module")
def ds_target(tmp_path_factory):
    return make_tiny("deepseek_v32", tmp_path_factory.mktemp("ds_sel") / "target", layers=2, hidden=64, vocab=512,
                     heads=4, max_position=1024, seed=3, deepseek={"index_topk": TOPK, "num_nextn_predict_layers": 1})


def _engine(target, spec, graphs: bool, **kw) -> tuple[Engine, list]:
    eng = Engine(EngineConfig(model=str(target), device="cpu", max_model_len=512, page_size=16, kv_cache_tokens=2048,
                              cuda_graph_max_bs=4, speculative_config=spec, **kw))
    if spec is not None and spec.adaptive:  # depths that change between steps: plain steps, catch-ups, rounds
        eng.depth_policy = DepthSchedule([0, 0, 3, 0, 2, 1, PAUSED, 3])
    worker, watched = eng.executor.worker, []
    if graphs:
        for runner in worker._runners():
            runner.attn_backend = WatchedSelection(pad_slot=worker.cfg.max_num_seqs)  # (the graphs' padding slot)
            watched.append(runner.attn_backend)
        worker.graphs.selection = worker.selection_variant()
        worker.capture_graphs()
        assert worker.graphs.static.pad_slot == worker.cfg.max_num_seqs
    return eng, watched


def _prompts() -> list[list[int]]:
    # contexts that start under the top-k (their decode rows short of it), cross it and then the long-rows bound
    # while decoding (the shortest: 3 + 60 tokens), and one that starts over the bound: a bound too low replays the
    # long-rows graphs over short rows (``test_the_check_fails_where_the_margin_is_too_small``)
    lengths = [3, 6, 20, 120]
    return [[(7 * i + 3 * n) % 500 + 4 for i in range(n)] for n in lengths]


@pytest.mark.parametrize("spec", [None, SpeculativeConfig(method="mtp", num_steps=3),
                                  SpeculativeConfig(method="mtp", num_steps=3, topk=2, num_draft_tokens=5),
                                  SpeculativeConfig(method="mtp", num_steps=3, adaptive=True)],
                         ids=["plain", "mtp-chain", "mtp-tree", "mtp-adaptive"])
def test_long_rows_graphs_replay_only_where_every_row_selects_its_whole_topk(ds_target, spec):
    ref, _ = _engine(ds_target, spec, graphs=False)
    want = [o.token_ids for o in ref.generate(_prompts(), GREEDY)]
    eng, watched = _engine(ds_target, spec, graphs=True)
    graphs = eng.executor.worker.graphs
    # a twin for each graph whose forwards have more than one row: all but the plain step's at bucket 1
    keys = [k for k in graphs.graphs if k[-1] != LONG_ROWS]
    twins = {k for k in keys if k + (LONG_ROWS,) in graphs.graphs}
    assert len(graphs.graphs) == len(keys) + len(twins)
    assert twins == {k for k in keys if k[1] > 1 or spec is not None and k[0] != "decode"}, sorted(set(keys) - twins)
    got = [o.token_ids for o in eng.generate(_prompts(), GREEDY)]
    assert got == want
    forwards = sum((b.forwards for b in watched), Counter())
    # the batch's shortest context crosses the bound while decoding: both variants ran
    for mode in ["DECODE"] + ([] if spec is None else ["TARGET_VERIFY"]):
        assert forwards[(True, mode)] > 0 and forwards[(False, mode)] > 0, (mode, forwards)
    assert not any(long for long, m in forwards if m == "EXTEND"), forwards  # (prefills run eagerly, short mode)


def test_long_rows_need_the_whole_batch_over_the_bound():
    sel = SelectionVariant([], topk=2048)
    assert sel.long_rows([2048 + ROW_MARGIN, 10_000])
    assert not sel.long_rows([2048 + ROW_MARGIN - 1, 10_000])
    assert not sel.long_rows([])


def test_the_check_fails_where_the_margin_is_too_small(ds_target, monkeypatch, caplog):
    """The check above can fail on its own prompts: with the bound under the top-k (here top-k - 4: the long-rows
    graphs from a shortest context of 4), long-rows steps come while rows are short (the worker's step fails, and
    the engine logs why)."""
    import workers.graphs

    spec = SpeculativeConfig(method="mtp", num_steps=3)
    monkeypatch.setattr(workers.graphs, "ROW_MARGIN", -4)
    eng, _ = _engine(ds_target, spec, graphs=True)
    sel = eng.executor.worker.graphs.selection
    assert sel.long_rows([TOPK - 4]) and not sel.long_rows([TOPK - 5])
    eng.generate(_prompts(), GREEDY)
    assert "short of their top-k" in caplog.text



def test_a_rounds_phases_and_their_twins_are_captured_each_in_order(ds_target):
    """A round in three graphs hands tensors from phase to phase: captured graphs read what the phase before left at
    its capture, so the twins come after all of their bucket's graphs, in the same order (each twin reads the twin
    before it). On the CPU the callables run at each replay, so the tokens can only show the path runs."""
    spec = SpeculativeConfig(method="mtp", num_steps=3, adaptive=False)
    ref, _ = _engine(ds_target, spec, graphs=False, fuse_speculative_round=False)
    eng, _ = _engine(ds_target, spec, graphs=True, fuse_speculative_round=False)
    order = list(eng.executor.worker.graphs.graphs)
    for bucket in (1, 2, 4):
        at = [i for i, k in enumerate(order) if k[1] == bucket and k[2] == "greedy"]
        names = [order[i][0] + (" twin" if order[i][-1] == LONG_ROWS else "") for i in at]
        assert names == ["draft", "verify", "draft_extend", "draft twin", "verify twin", "draft_extend twin"], names
        assert at == list(range(at[0], at[0] + 6))  # (one after the other)
    want = [o.token_ids for o in ref.generate(_prompts(), GREEDY)]
    assert [o.token_ids for o in eng.generate(_prompts(), GREEDY)] == want
