"""Training: the per-worker loop, where it runs (Ray / in-process), heartbeat, metrics, preemption."""
