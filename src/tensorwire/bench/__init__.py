"""Benchmarks: ``python -m tensorwire.bench {rdma,transfer,broadcast,...}``.

Each benchmark prints ratios side by side in one run (the machines are noisy) and writes JSON under
``benchmarks/results/`` with the machine noted. Benchmarks measure; they never assert.
"""
