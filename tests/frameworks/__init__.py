"""The framework matrix: Django, Litestar, Quart, Falcon, FastAPI, Starlette on real servers."""
