"""What the router changes in an OpenAI-style request body, as pure functions (no I/O).

- ``has_media``: a chat request whose messages carry a non-text content part (image, audio, video, embeddings)
  goes to an encoder instance first; everything else goes straight to an LLM instance.
- ``encoder_body``: the request an encoder instance gets: the same messages and multimodal settings (so vLLM
  computes the same ``mm_hash`` there), one output token, not streamed, nothing that only shapes the answer.
- ``llm_body``: the client's request with the encoder instance's ``ec_transfer_params``. A client never supplies
  them: the router removes any it sent (they name an endpoint the LLM instance would dial and a grant to read
  with), so only an encoder instance's answer reaches the LLM instance.
"""

from __future__ import annotations

from typing import Any

CHAT_PATHS = ("/v1/chat/completions",)
PARAMS_FIELD = "ec_transfer_params"
_TEXT_PARTS = frozenset(("text", "input_text", "output_text", "refusal", "thinking"))
# Fields that only shape the answer (or would conflict with a one-token, non-streamed one).
_ENCODER_DROP = ("stream", "stream_options", "logprobs", "top_logprobs", "prompt_logprobs", "min_tokens", "n",
                 "best_of", "response_format", "structured_outputs", "guided_json", "guided_regex",
                 "guided_choice", "guided_grammar", "logit_bias", "kv_transfer_params", PARAMS_FIELD)


def has_media(body: dict[str, Any]) -> bool:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") not in _TEXT_PARTS:
                    return True
    return False


def encoder_body(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in _ENCODER_DROP}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    if out.get("tools"):
        out["tool_choice"] = "none"
    return out


def client_body(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The client's request without any ``ec_transfer_params`` it sent, and whether it sent some."""
    if PARAMS_FIELD not in body:
        return body, False
    return {k: v for k, v in body.items() if k != PARAMS_FIELD}, True


def llm_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    if not params:
        return body
    return {**body, PARAMS_FIELD: params}


def wants_stream(body: dict[str, Any]) -> bool:
    return body.get("stream") is True
