"""Sizes the prefill and decode pools from their measured load against the latency targets.

    heartbeats + requests stream --LoadSignals--> PoolLoad per role --PoolPlanner--> Decision (+1 / -1)

`PoolPlanner` (policy.py) decides and holds no I/O; `LoadSignals` (signals.py) reads Redis;
`plan_forever` (loop.py) joins them for the launcher (`--planner`, which starts and drains
workers) and the gateway (which exports the recommendation as metrics for an autoscaler).
"""
