"""Benchmarks: ``python -m tensorwire.bench {rdma,transfer,broadcast,...}``.

Each benchmark prints ratios side by side in one run (the machines are noisy) and writes JSON under
``benchmarks/results/`` with the machine noted. Benchmarks measure; they never assert. The private modules are
shared helpers (``_common``, ``_ranks``) and what the CLI's demos measure and print (``_e2e`` for
``tensorwire fetch`` and ``tensorwire demo``, ``_rdma_demo`` for ``tensorwire rdma-demo``).
"""
