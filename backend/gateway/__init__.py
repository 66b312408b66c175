"""An OpenAI-compatible API in front of tritonserver (`m3serve openai`): a FastAPI service that talks to the
`m3` model over gRPC streaming. app.py (routes, lifecycle), chat.py and completions.py (one request
contract each), protocol.py (shared fields, errors), triton.py (the gRPC side), metrics.py."""
