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


def test_compile_watch_counts_and_logs_each_compile_and_keeps_earlier_hooks(caplog):
    """After start-up every Triton compile is a stall inside a step: the watch times each (between Triton's hook
    before the compile and the one after it), logs its kernel's specialisation, and still calls the hooks that were
    set before it (one that takes a compile over skips the timing)."""
    import types

    from workers.kernels.launch import CompileWatch
    from workers.kernels.launch import specialisation as launch_specialisation

    calls = []
    watch = CompileWatch()
    watch._chained = (lambda **kw: calls.append(("before", kw["key"])) or kw["key"] == "taken",
                      lambda **kw: calls.append(("after", kw["key"])))
    # Triton's hook arguments (3.6): the signature by name, constexprs by argument path (an int equal to 1 is one),
    # divisibility by 16 as an attribute by path
    fn = types.SimpleNamespace(name="_kernel")
    compile_args = {"signature": {"X": "*fp32", "n": "i32", "m": "constexpr", "rows": "i32", "BLOCK": "constexpr"},
                    "constants": {(2,): 1, (4,): 64}, "configs": [{(0,): [["tt.divisibility", 16]],
                                                                   (3,): [["tt.divisibility", 16]]}]}
    with caplog.at_level("WARNING", logger="workers.kernels.launch"):
        assert watch.before(key=("k", 1), repr="_kernel[...]") is None
        watch.after(key=("k", 1), repr="_kernel[...]", fn=fn, compile=compile_args)
        assert watch.before(key="taken", repr="_other") is True
    assert calls == [("before", ("k", 1)), ("after", ("k", 1)), ("before", "taken")]
    stats = watch.stats()
    assert stats["compiles"] == 1 and 0 <= stats["longest_s"] <= stats["s"], stats
    (line,) = [r.getMessage() for r in caplog.records]
    assert "_kernel(X:*fp32%16, n:i32, m=1, rows:i32%16, BLOCK=64)" in line and "inside a step" in line, line
    assert launch_specialisation({"repr": "as Triton wrote it"}) == "as Triton wrote it"  # (another shape of args)
