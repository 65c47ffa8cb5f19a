"""The ``tensorwire fetch --json`` document's schema and its description for ``--help`` (no imports: ``fetch``
builds its help from it without loading what measures a fetch)."""

# ``tensorwire fetch --json``: one object, also on failure. The version goes up when a key changes meaning or
# goes away; new keys may appear without it.
FETCH_SCHEMA = "tensorwire.fetch"
FETCH_SCHEMA_VERSION = 1
FETCH_JSON_HELP = f"""\
--json output: one JSON object on stdout, schema "{FETCH_SCHEMA}" version {FETCH_SCHEMA_VERSION}.
  always:     schema (str), schema_version (int), ok (bool), endpoint (str)
  ok=true:    plane ("rdma" | "inline"), fallback_reason (str | null: why RDMA fell back to inline),
              worker_id (str), items (list, one per image: image, shape, dtype, device,
              position_ids_shape), encoder_ms, transfer_ms (total minus the encoder's forward),
              total_ms (float), stage_ms (object: stage -> ms), payload_bytes (int),
              wall_ms (object: total, start_up, fetch, release_and_close: the command's wall
              time from its start, split; fetch is the call whose stages are stage_ms)
  ok=false:   error: {{type (exception class, e.g. "PeerUnavailable"), reason (a stable
              tensorwire reason, e.g. "peer_unavailable"), message (str), exit_code (int),
              hint (str, when there is one: e.g. a TLS mismatch and the flags that fix it)}}
"""

__all__ = ["FETCH_JSON_HELP", "FETCH_SCHEMA", "FETCH_SCHEMA_VERSION"]
