"""lp-bench: replay a workload against any OpenAI-compatible server and measure it.

Works with lp-serve, vLLM and SGLang alike (it only needs streamed /v1/completions or
/v1/chat/completions). See `lp-bench --help`, workload.py for the length models, arrival
processes and trace format, client.py for how chunks are timed, and report.py for the
metric definitions (TTFT, ITL, E2E, SLO attainment, goodput).
"""
