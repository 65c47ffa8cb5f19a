"""What the router changes in an OpenAI-style request body, as pure functions (no I/O).

- ``has_media``: a chat request whose messages carry a non-text content part (image, audio, video, embeddings)
  goes to an encoder instance first; everything else goes straight to an LLM instance.
- ``encoder_body``: the request an encoder instance gets: the same messages and multimodal settings (so vLLM
  computes the same ``mm_hash`` there), one output token, not streamed, nothing that only shapes the answer.
- ``llm_body``: the client's request with the encoder instance's ``ec_transfer_params``.
- ``strip_client_params``: a client never supplies transfer params, on any path: the router removes
  ``ec_transfer_params`` and ``kv_transfer_params`` wherever vLLM reads them (top level, ``vllm_xargs``,
  ``sampling_params.extra_args``) from every JSON body (they name an endpoint the LLM instance would dial and a
  grant to read with), so only an encoder instance's answer reaches the LLM instance.
- ``canonical_path``: the request target's path if it is already canonical, else None (the router refuses it):
  no percent-encoding, dot segments, empty segments, trailing slash or absolute form, so that no spelling of a
  path reaches an instance as a different route than the one the router saw.
"""

from __future__ import annotations

import re
from typing import Any

CHAT_PATHS = ("/v1/chat/completions",)
PARAMS_FIELD = "ec_transfer_params"
CLIENT_FORBIDDEN = ("ec_transfer_params", "kv_transfer_params")
# RFC 3986 pchar without '%': every byte of the path is literal, so an instance decodes nothing the router did not.
_SEGMENT = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@]+")
_TEXT_PARTS = frozenset(("text", "input_text", "output_text", "refusal", "thinking"))
# Fields that only shape the answer (or would conflict with a one-token, non-streamed one).
_ENCODER_DROP = (
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "min_tokens",
    "n",
    "best_of",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "logit_bias",
    "kv_transfer_params",
    PARAMS_FIELD,
)


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


def strip_client_params(body: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The client's JSON object without transfer params anywhere vLLM reads them, and the dotted names removed."""
    removed = [k for k in CLIENT_FORBIDDEN if k in body]
    out = {k: v for k, v in body.items() if k not in CLIENT_FORBIDDEN} if removed else body
    xargs = out.get("vllm_xargs")
    if isinstance(xargs, dict) and any(k in xargs for k in CLIENT_FORBIDDEN):
        removed += [f"vllm_xargs.{k}" for k in CLIENT_FORBIDDEN if k in xargs]
        out = {**out, "vllm_xargs": {k: v for k, v in xargs.items() if k not in CLIENT_FORBIDDEN}}
    sampling = out.get("sampling_params")
    extra = sampling.get("extra_args") if isinstance(sampling, dict) else None
    if isinstance(sampling, dict) and isinstance(extra, dict) and any(k in extra for k in CLIENT_FORBIDDEN):
        removed += [f"sampling_params.extra_args.{k}" for k in CLIENT_FORBIDDEN if k in extra]
        out = {
            **out,
            "sampling_params": {
                **sampling,
                "extra_args": {k: v for k, v in extra.items() if k not in CLIENT_FORBIDDEN},
            },
        }
    return out, removed


def canonical_path(target: str) -> str | None:
    """The path of a request target (``/a/b?query``) when it is canonical, else None; the query is not looked at."""
    path = target.split("?", 1)[0]
    if path == "/":
        return path
    if not path.startswith("/"):
        return None
    segments = path[1:].split("/")
    for seg in segments:
        if seg in (".", "..") or not _SEGMENT.fullmatch(seg):
            return None  # a dot segment, an empty one ('//' or a trailing '/'), '%' or a byte outside pchar
    return path


def llm_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    if not params:
        return body
    return {**body, PARAMS_FIELD: params}


def wants_stream(body: dict[str, Any]) -> bool:
    return body.get("stream") is True
