"""SLO-driven autoscaling of the prefill and decode pools: a pure planner (``autoscale.planner``)."""
