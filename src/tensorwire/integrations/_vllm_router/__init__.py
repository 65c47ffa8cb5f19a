"""The vLLM EPD router's parts (public entry: ``tensorwire.integrations.vllm_router``). No vLLM import."""
