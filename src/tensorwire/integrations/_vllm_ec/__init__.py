"""The engine-independent half of the vLLM encoder-cache connector (``tensorwire.integrations.vllm``).

Nothing here imports vLLM: requests and features are duck-typed (``request_id``, ``mm_features[i].identifier``,
``.mm_position``, ``.data``, ``ec_transfer_params``), so the state machines, the fetch coordination and the
wire format are tested without vLLM installed (``make test``); ``tests/vllm`` runs them inside real engines.

Modules: ``config`` (ECConfig), ``params`` (the ``ec_transfer_params`` schema), ``metrics``, ``fetch`` (the
LLM side's lookup -> every rank stages -> release), ``consumer`` / ``producer`` (each role's scheduler and
worker logic), ``runtime`` (per-process servers, sockets and rendezvous files).
"""
