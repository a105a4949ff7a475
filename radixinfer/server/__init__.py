"""``radixinfer serve``: an OpenAI-compatible streaming HTTP server over `radixinfer.AsyncLLM`.

    protocol    request bodies, and the request -> SamplingParams mapping
    chat        chat templates
    app         routes, statuses, authentication, streaming
    metrics     Prometheus metrics
    body_limit  the request-body size limit (413)
    launch      the flags of ``radixinfer serve``, uvicorn
    api_servers ``--api-server-count N``: N API server processes over one engine process

FastAPI, uvicorn and prometheus-client come with the ``serve`` extra (``pip install -e
".[serve]"``); importing this package does not need them, `radixinfer.server.app` does.
"""
