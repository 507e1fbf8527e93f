"""Side-by-side benchmarks of asgi-cancel and the alternatives users write instead.

Run `python -m benchmarks overhead|latency|waste|memory|all [--quick]`, then
`python -m benchmarks render` to turn `benchmarks/results/*.json` into the tables and plots
that `docs/benchmarks.md` quotes.
"""
