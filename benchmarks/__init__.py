"""Side-by-side benchmarks of asgi-cancel and the alternatives users write instead.

`python -m benchmarks overhead|latency|waste|memory|serving|all [--quick]` measures (results in
`benchmarks/results/*.json`); `python -m benchmarks render` turns them into the tables and the
plot of `docs/benchmarks.md`; `python -m benchmarks.instructions` counts instructions per
request inside uvicorn or hypercorn (`--server`).
"""
