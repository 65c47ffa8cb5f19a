"""Benchmarks: ``python -m tensorwire.bench {rdma,transfer,broadcast,...}``.

Each benchmark prints ratios side by side in one run (the machines are noisy) and writes JSON under
``benchmarks/results/`` with the machine noted. Benchmarks measure; they never assert. The private modules are
shared helpers (``_common``, ``_payloads``, ``_plain_grpc``, ``_plot``) and the private folders group the rest by
what they drive: ``_tp/`` (broadcast backends, rank processes), ``_vllm/`` (vLLM loaders and the EC paths),
``_router/`` (stand-in instances and the proxy compared against). Nothing outside this package imports it:
what the CLI's commands measure and print lives beside them (``tensorwire.cli._measure``,
``tensorwire.cli._rdma_demo``).
"""
