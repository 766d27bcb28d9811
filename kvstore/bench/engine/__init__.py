"""``kvstore bench engine``: TTFT per request on real vLLM engines, configurations side by side.

``workloads.py`` (shapes and token-id prompts), ``configs.py`` (what each engine is started
with), ``worker.py`` and ``weights.py`` (run in the engine's venv), ``run.py`` (the engines
and daemons, round by round), ``tables.py`` (rows, output comparisons, plot), ``main.py``.
"""
