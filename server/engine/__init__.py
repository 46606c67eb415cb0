"""The engine: sessions, scheduling, the model step and sampling. It knows nothing of HTTP (server/api)."""
