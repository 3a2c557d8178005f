"""The OpenAI-compatible HTTP server over the engine loop: ``python -m ddtree_cupy.serve`` (docs/SERVING.md).

``main.py`` (command line, threads, mpirun), ``app.py`` (endpoints), ``protocol.py`` (request bodies and
errors), ``chat.py`` (Kimi chat prompts with tools), ``text.py`` (incremental detokenizing, stop strings),
``parse.py`` (reasoning and tool calls), ``metrics.py`` (Prometheus). Needs the ``serve`` extra.
"""
