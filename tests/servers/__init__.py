"""Real-server tests: each ASGI server runs on 127.0.0.1 and raw sockets really disconnect."""
