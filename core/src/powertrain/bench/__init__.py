"""Benchmarks that a user runs against a server (`powertrain bench ...`).

`workloads` makes the requests, `sse` reads the streamed answers, `serve` sends them
at a chosen load and measures, `report` and `plot` present the numbers. Nothing here
imports the engine: the client must stay light and measure any OpenAI-compatible URL.
"""
