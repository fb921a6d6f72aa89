"""The decision trace of a serving run: `TraceWriter` (writer.py) writes it from the engine
(`EngineConfig.trace_path`, `lp-serve --trace`) and the simulator (`Simulator.run(...,
trace=)`); `python -m lp_jax.trace plot TRACE --out timeline.png` draws it (timeline.py).
Pure Python apart from the plot, which imports matplotlib when called."""

from lp_jax.trace.writer import TraceWriter, load

__all__ = ["TraceWriter", "load"]
