"""An OpenAI-compatible server that shows what asgi-cancel is for: `python -m example_app demo`.

See README.md beside this file.
"""
