"""The gateway: one OpenAI/Ollama endpoint in front of several `tokenloom serve` workers.

config.py (RouterConfig), prefix.py (the routing key of a request), policies.py (which worker),
workers.py (worker state and health checks), metrics.py (the router's own Prometheus metrics),
proxy.py (forwarding, retries, streaming pass-through), replies.py (its own error answers),
app.py (the FastAPI app), server.py (running it under uvicorn), cluster.py (local worker processes),
cli.py (`tokenloom router` / `tokenloom cluster`).
"""
