"""Programmatic dependent launch (``workers.kernels.launch``): where the kernels ask for it."""

from __future__ import annotations


def test_pdl_only_inside_graph_scopes_and_never_on_cpu():
    """Programmatic dependent launch is scoped (CUDA-graph warm-ups and captures, per thread, nesting restores the
    outer state) and never asked for on a device without it."""
    import threading

    import torch

    from workers.kernels import launch

    x = torch.zeros(1)
    seen = {}
    with launch.pdl_launches():
        with launch.pdl_launches():
            pass
        seen["inside"] = launch._pdl_scope.on
        worker = threading.Thread(target=lambda: seen.update(other=getattr(launch._pdl_scope, "on", False)))
        worker.start()
        worker.join()
        assert launch.pdl_launch(x) == {}  # no CUDA here
    assert seen == {"inside": True, "other": False} and not launch._pdl_scope.on
    assert not launch.pdl_supported("cpu")
