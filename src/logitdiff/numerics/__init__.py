"""Stage *numerics*: the math, pure arrays in and out — exact full-vocabulary metrics
(`metrics`, the compiled kernel `kernel` + `_kernel.cpp`), proven intervals (`bounds`),
summaries and bootstrap intervals (`summarize`, `stats`), output segments (`segments`).
Imports only the base modules (`errors`, `defaults`, `contracts`).
"""
