"""`lp`: one command for every tool lp_jax has, in vLLM's shape (`lp serve --model DIR`).

`lp COMMAND ARGS...` hands ARGS to that tool's own parser, so `lp COMMAND --help` is the
tool's help and every tool still runs alone: `lp-serve`, `lp-bench`, `lp-demo` and the
`python -m` modules are aliases of the same entry points. Each command is a function
that imports its tool when called, so `lp --help` loads none of them (and no JAX).
"""

from __future__ import annotations

import sys


def _serve(argv):
    from lp_jax.serve import main

    return main(argv, prog="lp serve")


def _bench(argv):
    from lp_jax.bench.__main__ import main

    return main(argv)


def _aot(argv):
    from lp_jax.aot.__main__ import main

    return main(argv, prog="lp aot")


def _roofline(argv):
    from lp_jax.roofline.__main__ import main

    return main(argv)


def _trace(argv):
    from lp_jax.trace.__main__ import main

    return main(argv)


def _demo(argv):
    from lp_jax.demo import main

    return main(argv, prog="lp demo")


def _profile_latency(argv):
    from lp_jax.engine.profile_latency import main

    return main(argv)


def _bench_attention(argv):
    from lp_jax.bench.attention_kernels import main

    return main(argv)


def _bench_structured(argv):
    from lp_jax.bench.structured import main

    return main(argv)


def _bench_harmony(argv):
    from lp_jax.bench.harmony_grammar import main

    return main(argv)


def _engine_args(argv):
    from lp_jax.engine_args import main

    return main(argv)


def _train_demo(argv):
    from checkpoints.train_demo import main

    return main(argv)


def _make_tiny(argv):
    from checkpoints.make_tiny import main

    return main(argv)


def _make_tiny_quant(argv):
    from checkpoints.make_tiny_quant import main

    return main(argv)


# name -> (entry point, what it does); the order of `lp --help`.
COMMANDS = {
    "serve": (_serve, "the OpenAI-compatible server (alias: lp-serve)"),
    "bench": (_bench, "load generator: TTFT, ITL, goodput against a server (alias: lp-bench)"),
    "aot": (_aot, "compile the engine's programs for a TPU slice or a GPU, no chip needed "
                  "(alias: python -m lp_jax.aot)"),
    "roofline": (_roofline, "roofline tables and plots (python -m lp_jax.roofline)"),
    "trace": (_trace, "plot or summarise a decision trace (python -m lp_jax.trace)"),
    "demo": (_demo, "the fable model served by every policy (alias: lp-demo)"),
    "profile-latency": (_profile_latency, "fit the step-latency model "
                                          "(python -m lp_jax.engine.profile_latency)"),
    "bench-attention": (_bench_attention, "decode-attention GB/s "
                                          "(python -m lp_jax.bench.attention_kernels)"),
    "bench-structured": (_bench_structured, "structured outputs' host cost "
                                            "(python -m lp_jax.bench.structured)"),
    "bench-harmony": (_bench_harmony, "GPT-OSS harmony grammar's host cost "
                                      "(python -m lp_jax.bench.harmony_grammar)"),
    "engine-args": (_engine_args, "print or write docs/engine_args.md"),
    "train-demo": (_train_demo, "train the demo model into the cache "
                                "(python -m checkpoints.train_demo)"),
    "make-tiny": (_make_tiny, "write a tiny random-weight checkpoint "
                              "(python -m checkpoints.make_tiny)"),
    "make-tiny-quant": (_make_tiny_quant, "write a tiny quantized checkpoint "
                                          "(python -m checkpoints.make_tiny_quant)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items())
    return ("usage: lp [--version] COMMAND [ARGS...]\n\n"
            "lp_jax: layered-prefill serving for Mixture-of-Experts LLMs in JAX.\n\n"
            f"commands:\n{rows}\n\n`lp COMMAND --help` for a command's arguments; "
            "docs/install.md, docs/engine_args.md.\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from lp_jax.version import lp_jax_version

        print(f"lp_jax {lp_jax_version()}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"lp: unknown command {argv[0]!r}\n\n{usage()}", end="", file=sys.stderr)
        return 2
    rc = COMMANDS[argv[0]][0](argv[1:])
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
