"""The bench reports' own arithmetic (no GPU): how a profiled replay's wall time is attributed to its kernels."""

from bench.profile_decode import exposed_by_kernel, verify_layers


def test_exposed_time_attribution_with_overlap_and_idle():
    # a 0-10; b 8-16 (starts 2 before a ends: PDL overlap); idle 16-20; c 20-23; b again 18-20 (5 before c's end),
    # wholly inside the span already covered: it adds nothing to the wall
    kernels = [{"kernel": "a", "us": 10.0, "gap_before_us": 0.0},
               {"kernel": "b", "us": 8.0, "gap_before_us": -2.0},
               {"kernel": "c", "us": 3.0, "gap_before_us": 4.0},
               {"kernel": "b", "us": 2.0, "gap_before_us": -5.0}]
    got = exposed_by_kernel(kernels)
    assert got["a"] == {"launches": 1, "us": 10.0, "exposed_us": 10.0}
    assert got["b"] == {"launches": 2, "us": 10.0, "exposed_us": 6.0}  # 10 -> 16; the second (18-20) nothing
    assert got["c"] == {"launches": 1, "us": 3.0, "exposed_us": 7.0}  # idle 16-20 and 20-23
    assert sum(v["exposed_us"] for v in got.values()) == 23.0  # the replay's wall time


def test_verify_layers_roles_and_span():
    def layer():  # input norm, q/k/v, RoPE, attention, merge, o, gate/up, down
        return [("_add_rms_norm", 2.0), ("_weight_left_dot", 20.0), ("_rope_qk", 2.0), ("_split_kv_attention", 5.0),
                ("_merge_splits", 3.0), ("_weight_left_dot", 13.0), ("_weight_left_dot", 80.0),
                ("_weight_left_dot", 43.0)]
    # a draft step first (its own RoPE, outside the span), then two verify layers and the lm_head
    seq = ([("_gemv", 40.0), ("_rope_qk", 2.0), ("_gemv", 9.0)] + layer() + layer()
           + [("_weight_left_dot", 340.0)])
    kernels = [{"kernel": n, "us": us, "gap_before_us": 0.0} for n, us in seq]  # back to back: exposed = duration
    got = verify_layers(kernels, 2)
    assert got == {"per_layer_us": 168.0, "_add_rms_norm": 2.0, "q/k/v": 20.0, "_rope_qk": 2.0,
                   "_split_kv_attention": 5.0, "_merge_splits": 3.0, "o": 13.0, "gate/up": 80.0, "down": 43.0}
