"""`tilekit serve`: an OpenAI-compatible HTTP server over the continuous-batching engine (tilekit.engine.llm).

    protocol.py   the API's request fields, checked, as engine options; response and error shapes
    app.py        the Starlette application: chat and text completions (streamed or not), models, health, metrics
    metrics.py    Prometheus metrics

Needs the `serve` extra (pip install "tilekit[serve]": Starlette, uvicorn, prometheus-client).
"""
