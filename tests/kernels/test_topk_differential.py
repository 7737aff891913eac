"""The sparse top-k's paths (the radix passes in one program a row or split over programs, the sampled threshold
with its atomic candidates, and with its position-ordered candidates selected in registers) against the stable-sort
reference on seeded random rows, run through Triton's interpreter in a subprocess: lengths 0, 1, under,
at and over top-k, at and just past the sampled path's candidate capacity and far past it; NaN (never selected, as
-inf), ±inf, -0.0 beside 0.0 (equal: the lower position wins), all-equal rows, heavy ties, negative-only rows,
rows mostly -inf (their sample too), denormals and the largest floats; top-k over the row; splits 1 to 7 (not
powers of two; more than a row's blocks). Small blocks and samples keep each case to a few kernel programs."""

from __future__ import annotations

import random

from tests.kernels.interpreter import assert_interpreting, run_in_interpreter

CASES = 70  # (~1 minute in the interpreter; ``--device cuda --cases 3000`` on a GPU)
KINDS = ("randn", "ties", "negative", "equal", "mostly_inf", "nan_inf", "signed_zero", "extreme")


def _row(rng: random.Random, n: int, kind: str) -> list[float]:
    inf, nan = float("inf"), float("nan")
    if kind == "randn":
        return [rng.gauss(0.0, 1.0) for _ in range(n)]
    if kind == "ties":  # a few values: the k-th score is shared by many positions, on both sides of a threshold
        return [float(rng.randint(-2, 2)) for _ in range(n)]
    if kind == "negative":
        return [-abs(rng.gauss(0.0, 1.0)) - 1e-3 for _ in range(n)]
    if kind == "equal":
        v = rng.choice([0.0, -0.0, -3.5, 7.0])
        return [v] * n
    if kind == "mostly_inf":
        return [rng.gauss(0.0, 1.0) if rng.random() < 0.1 else -inf for _ in range(n)]
    if kind == "nan_inf":
        return [rng.choice([nan, -inf, inf, 1.0, rng.gauss(0.0, 1.0)]) for _ in range(n)]
    if kind == "signed_zero":
        return [rng.choice([0.0, -0.0, -1.0, 1e-45, -1e-45]) for _ in range(n)]
    return [rng.choice([3e38, -3e38, 1e-45, -1e-45, 0.0, -0.0, inf]) for _ in range(n)]


def _case(rng: random.Random, torch):
    topk = rng.choice([1, 2, 3, 5, 8])
    sample = rng.choice([16, 32])
    cand_max = max(4 * topk, sample)  # topk_slots' candidate capacity: longer rows are sampled
    rows = rng.randint(1, 4)
    lens = [rng.choice([0, 1, max(topk - 1, 0), topk, topk + 1, cand_max, cand_max + 1,
                        cand_max + rng.randint(2, 9), rng.randint(cand_max, 5 * cand_max)]) for _ in range(rows)]
    page = rng.choice([1, 4, 7])
    cap = -(-(max(lens) + rng.randint(0, 5) or 1) // page) * page
    scores = torch.full((rows, cap), float("nan"))  # past a row's length: never read
    kinds = [rng.choice(KINDS) for _ in lens]
    for i, (n, kind) in enumerate(zip(lens, kinds)):
        if n:
            scores[i, :n] = torch.tensor(_row(rng, n, kind))
    table = torch.randperm(rows * (cap // page) + 3, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    table = table[:rows * (cap // page)].view(rows, cap // page).to(torch.int32)
    row_req = torch.tensor([rng.randrange(rows) for _ in lens], dtype=torch.int32)
    opts = {"topk": topk, "page": page, "sample": sample, "block": rng.choice([16, 32]),
            "splits": rng.choice([1, 2, 3, 5, 7]), "lens": lens, "kinds": kinds}
    return scores, torch.tensor(lens, dtype=torch.int32), table, row_req, opts


def check(cases: int = CASES, seed: int = 0, device: str = "cpu") -> None:
    """``device`` cuda: the same cases on the GPU's compiled kernels (many more of them: ``--cases``)."""
    import torch

    from workers.kernels.sparse_mla import positions_to_slots, topk_positions_reference, topk_slots

    if device == "cpu":
        assert_interpreting()
    rng = random.Random(seed)
    for n in range(cases):
        scores, row_len, table, row_req, o = (x.to(device) if isinstance(x, torch.Tensor) else x
                                              for x in _case(rng, torch))
        want = positions_to_slots(topk_positions_reference(scores, row_len, o["topk"]), table, row_req, o["page"])
        # every case through the ordered candidates (the default for long rows) and one other path in turn (the
        # interpreter's time); on the GPU every path every case
        # (its threshold drawn by a kernel of its own or by each split, from a sort of the sample or by counts, in
        # turn)
        others = [("sampled", o["splits"], {"sort_sample": n % 2 == 1}), ("radix", 1, {}), ("radix", o["splits"], {})]
        ordered = {"fused_threshold": n % 2 == 0, "sort_sample": n // 2 % 2 == 0}
        paths = [("ordered", o["splits"], ordered)] + (others if device != "cpu" else [others[n % 3]])
        if device != "cpu":
            paths.append(("ordered", o["splits"], {k: not v for k, v in ordered.items()}))
        for method, splits, kw in paths:
            got = topk_slots(scores, table, row_req, row_len, o["page"], o["topk"], block=o["block"],
                             num_splits=splits, method=method, sample=o["sample"], **kw)
            bad = (got != want).any(1).nonzero().flatten().tolist()
            assert not bad, (f"case {n} method={method} splits={splits} {kw} {o}: rows {bad} differ\n"
                             f"got {got[bad].tolist()}\nwant {want[bad].tolist()}\nscores {scores[bad].tolist()}")
    print("topk differential ok")


def test_topk_paths_equal_the_reference_on_random_rows():
    run_in_interpreter(__name__, "topk differential ok", timeout=600)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cases", type=int, default=CASES)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    check(a.cases, a.seed, a.device)
