"""Benchmarks: ``python -m tensorwire.bench {rdma,transfer,broadcast,...}``.

Each benchmark prints ratios side by side in one run and writes JSON under ``benchmarks/results/`` with the
machine noted; benchmarks measure, never assert. Private helpers: ``_common``, ``_payloads``, ``_plain_grpc``,
``_plot``, and ``_tp/``, ``_vllm/``, ``_router/``. Nothing outside this package imports it.
"""
