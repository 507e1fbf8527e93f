"""Side-by-side benchmarks of asgi-cancel and the alternatives users write instead.

`python -m benchmarks --help` lists them (results in `benchmarks/results/`, rendered into
`docs/benchmarks.md`); `python -m benchmarks.instructions` counts instructions per request.
"""
