"""The bench reports' own arithmetic (no GPU): how a profiled replay's wall time is attributed to its kernels."""

from bench.profile_decode import exposed_by_kernel


def test_exposed_time_attribution_with_overlap_and_idle():
    # a 0-10; b 8-16 (starts 2 before a ends: PDL overlap); idle 16-20; c 20-23; b again 18-20 (5 before c's end),
    # wholly inside the span already covered: it adds nothing to the wall
    kernels = [{"kernel": "a", "us": 10.0, "gap_before_us": 0.0},
               {"kernel": "b", "us": 8.0, "gap_before_us": -2.0},
               {"kernel": "c", "us": 3.0, "gap_before_us": 4.0},
               {"kernel": "b", "us": 2.0, "gap_before_us": -5.0}]
    got = exposed_by_kernel(kernels)
    assert got["a"] == {"launches": 1, "us": 10.0, "exposed_us": 10.0}
    assert got["b"] == {"launches": 2, "us": 10.0, "exposed_us": 6.0}  # 10 -> 16; the second ends at 18 < 23
    assert got["c"] == {"launches": 1, "us": 3.0, "exposed_us": 7.0}  # idle 16-20 and 20-23
    assert sum(v["exposed_us"] for v in got.values()) == 23.0  # the replay's wall time
