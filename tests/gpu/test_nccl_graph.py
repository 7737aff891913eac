"""The tensor-parallel collectives on 2 GPUs, eager and in CUDA graphs: the NCCL communicator and the one-shot custom
all-reduce, with every GPU visible and with each rank isolated as under Ray (``check_nccl_graph``)."""

from __future__ import annotations

import pytest

from tests.gpu.runner import needs_gpus, result_path, run_check

pytestmark = needs_gpus(2)


@pytest.mark.parametrize("isolated", [False, True], ids=["all_visible", "isolated"])
def test_collectives(tmp_path, isolated):
    name = "collectives_x2_isolated.json" if isolated else "collectives_x2.json"
    out = run_check("check_nccl_graph", *(["--isolated"] if isolated else []), "--json", result_path(name, tmp_path))
    assert "collectives check: PASS" in out, out[-4000:]
