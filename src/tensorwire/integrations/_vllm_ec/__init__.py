"""The engine-independent half of the vLLM encoder-cache connector (``tensorwire.integrations.vllm``).

Nothing here imports vLLM (requests and features are duck-typed), so it is tested without vLLM.
Modules: ``config``, ``params`` (the ``ec_transfer_params`` schema), ``metrics``, ``fetch`` (lookup -> every
rank stages -> release), ``consumer`` / ``producer`` (each role's logic), ``runtime`` (per-process servers).
"""
