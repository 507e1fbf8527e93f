"""Framework matrix: Django, Litestar, Quart, Falcon and FastAPI under real servers.

Each framework's app module is served twice per test module: with `CancelOnDisconnectMiddleware`
installed the way its users do it, and without it (the control). The apps run inside the server
subprocess, which has tests/ on its PYTHONPATH: targets are `frameworks.<framework>_app:app`
and `frameworks.<framework>_app:control`.
"""
