"""The JAX executor: runs a scheduler's `StepPlan` on the devices.

`ModelRunner` (model_runner.py) owns the weights, the KV pool and the compiled step
programs (step.py, one per row bucket) and turns plans into device inputs; sampler.py is
the on-device sampling, kernel_check.py the start-up kernel self-test, plan_channel.py and
distributed.py the multi-process leader/follower set-up, and compile_guard.py counts
backend compiles.
"""
