"""The scheduling core: pure Python, no JAX.

Requests (`Sequence`), the KV page pool (`BlockManager`), the `Scheduler` that turns them
into one `StepPlan` per iteration, the prefill policies that decide a plan's prefill half
(`policies/`), the step-latency estimator, SLOs and per-request metrics. The executor
(`lp_jax.executor`) runs plans; the simulator (`lp_jax.sim`) drives the same core with a
cost model instead. Nothing here imports JAX (tests/test_imports.py checks it).
"""
