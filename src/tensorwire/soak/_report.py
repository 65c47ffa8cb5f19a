"""The soak report as text (the dict itself is the --json output)."""

from __future__ import annotations

from typing import Any


def _kv(d: dict[str, Any]) -> str:
    def count_first(kv: tuple[str, Any]) -> int:
        return -kv[1] if isinstance(kv[1], int) else 0

    return ", ".join(f"{k} {v}" for k, v in sorted(d.items(), key=count_first)) or "none"


def _mark(ok: bool) -> str:
    return "ok" if ok else "FAIL"


def format_report(r: dict[str, Any]) -> str:
    cfg = r["config"]
    lines = [
        f"soak: {r['duration_s']} s, concurrency {cfg['concurrency']} over {cfg['client_processes']} client processes, "
        f"{cfg['workers']} workers behind the proxy, seed {cfg['seed']}, faults: {', '.join(cfg['faults']) or 'none'}",
        f"  requests              {r['requests']}",
        f"  successes             {r['successes']}  (delivered by plane: {_kv(r['delivered_by_plane'])})",
        f"  fallbacks by reason   {_kv(r['fallbacks_by_reason'])}",
        f"  clean errors          {_kv(r['errors_by_reason'])}",
        f"  killed in flight      {r['aborted_by_reader_kill']}  (requests of reader processes SIGKILLed mid-read)",
        f"  untyped errors        {r['untyped_errors']}  [{_mark(r['untyped_errors'] == 0)}]",
        f"  wrong outputs         {r['wrong_outputs']}  [{_mark(r['wrong_outputs'] == 0)}]",
        f"  hung requests         {r['hung_requests']}  [{_mark(r['hung_requests'] == 0)}]",
        f"  leases outstanding    {r['leases_outstanding_after_gc']} after the GC window; busy slots "
        f"{r['busy_slots_after_gc']}, busy bytes {r['pool_busy_bytes_after_gc']}  "
        f"[{_mark(r['leases_outstanding_after_gc'] == 0 and r['busy_slots_after_gc'] == 0)}]",
        "  pool bytes            "
        + ", ".join(f"worker{i} {v['start']} -> {v['end']}" for i, v in r["pool_bytes"].items()),
        f"  GC reclaimed leases   {_kv({f'worker{i}': v for i, v in r['gc_reclaimed'].items()})}",
        f"  fds back              [{_mark(r['fds_back'])}]  threads back [{_mark(r['threads_back'])}]",
    ]
    for name, p in r["processes"].items():
        lines.append(
            f"  {'*' if p.get('judged') else ' '} {name:<18} fds {p['fds'][0]} -> {p['fds'][1]}  "
            f"threads {p['threads'][0]} -> {p['threads'][1]}"
            f" (pool threads grown {p['pool_threads_grown']}, leaked {p['threads_leaked']})  "
            f"rss {p['rss_mb'][0]} -> {p['rss_mb'][1]} MB"
            + (f"  fd growth {p['fd_growth_by_kind']}" if p.get("fd_growth_by_kind") else "")
            + (f"  sockets {p['socket_growth_by_state']}" if p.get("socket_growth_by_state") else "")
            + (f"  new: {'; '.join(p['new_sockets'])}" if p.get("new_sockets") and p.get("fds_delta", 0) > 0 else "")
        )
    lines.append("    (* judged: this process and the sentinels worker0 / client0, which live through every fault)")
    av = r.get("availability")
    if av:
        out = av["outside_client_cuts"]
        rate = "n/a" if out["success_rate"] is None else f"{100 * out['success_rate']:.3f}%"
        lines.append(
            f"  availability          {rate} of {out['requests']} requests outside client-side cuts succeeded "
            f"(target {100 * out['target']:.1f}%: {'met' if out['met'] else 'NOT met'})"
        )
        for kind, row in av["by_fault"].items():
            rate = "n/a" if row["success_rate"] is None else f"{100 * row['success_rate']:.3f}%"
            lines.append(
                f"    in {kind:<15} {row['requests']:>7} requests, {rate} ok"
                + (f"; failed: {_kv(row['failed_by_reason'])}" if row["failed"] else "")
            )
    lines.append(f"  faults injected       {_kv(r['faults_injected'])}")
    lines.append(f"  relay events          {_kv(r['relay_events'])}")
    for plane, lat in r["latency_ms"].items():
        if lat.get("n"):
            lines.append(
                f"  latency {plane:<7}       n {lat['n']}  p50 {lat['p50']} ms  p90 {lat['p90']} ms  "
                f"p99 {lat['p99']} ms  max {lat['max']} ms  ({r['throughput_rps'][plane]} req/s)"
            )
    if r["untyped_examples"]:
        lines.append("  untyped examples: " + "; ".join(r["untyped_examples"][:3]))
    if r["wrong_examples"]:
        lines.append(f"  wrong examples: {r['wrong_examples'][:3]}")
    lines.append("PASSED" if r["passed"] else "FAILED")
    return "\n".join(lines)


__all__ = ["format_report"]
