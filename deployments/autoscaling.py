"""The engine deployment's autoscaling policy (``autoscaling_config.policy`` of the LLMController deployment).

Serve's default policy scales on the requests its handles send to a deployment's replicas, but requests reach the
engine cores directly (the ingress's batched submits and its output channel), so the controller replicas see none. Each
controller replica instead reports its engine's load (requests running and waiting) through Serve's custom
autoscaling metrics (``LLMController.record_autoscaling_stats``), and this policy sizes the deployment on their sum:
``target_ongoing_requests`` is then the load one engine replica should carry. Serve applies min/max replicas, the
up/downscale delays and factors around it. Serve pickles this module's function by value: keep it free of imports.
"""

ENGINE_LOAD_METRIC = "engine_requests"


def engine_load_policy(ctx):
    """Desired replicas = the engines' summed load (averaged over the look-back window) / the target per replica."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    per_replica = (ctx.aggregated_metrics or {}).get(ENGINE_LOAD_METRIC) or {}
    if not per_replica:  # no report yet (replicas starting): keep what there is
        return ctx.target_num_replicas, {}
    return sum(per_replica.values()) / ctx.config.get_target_ongoing_requests(), {}
