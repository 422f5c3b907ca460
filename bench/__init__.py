"""Benchmarks and the plots made from their results. Each script answers one question about
speed or acceptance (bench/README.md maps them) and runs from the repository root as
`python -m bench.<script>`; the helpers they share live in `bench.common`."""
