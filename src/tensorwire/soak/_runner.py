"""The soak / load runner: services on loopback, client processes, a fault scheduler, and the accounting.

    clients --> relay "front" --> EncoderProxy --> relay "w0" / "w1" --> worker children

Outputs are checked against digests computed here. At the end clients drain, faults clear, the workers' GC
window passes, then stats, fds and threads are read. ``run()`` returns the report as a dict.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import random
import statistics
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from tensorwire.soak import _client_proc
from tensorwire.soak._config import SoakConfig
from tensorwire.soak._corpus import Corpus, build_corpus
from tensorwire.soak._relay import FaultRelay
from tensorwire.soak._sample import sample, thread_names
from tensorwire.soak._windows import WORKER_KINDS, FaultWindows, Outcome
from tensorwire.soak._worker_proc import WorkerProcess

log = logging.getLogger(__name__)

# Thread-name prefixes of executors that grow on demand up to a fixed max_workers and then stay: growth of
# these between the baseline and the end is a pool filling up, not a leak (the report lists them apart).
POOL_PREFIXES = ("relay-", "proxy", "tensorwire-encoder", "ThreadPoolExecutor")
# How long the end of a run waits for the workers' descriptors to come back to their baselines (_settled): a
# late answer's wait (mm.client LATE_ANSWER_S, 5 s) and a loaded host's lag.
SETTLE_S = 8.0


class _Client:
    def __init__(self, runner: SoakRunner, slot: int, mode: str, threads: int) -> None:
        ctx = mp.get_context("spawn")
        self.slot, self.mode, self.threads = slot, mode, threads
        self.conn, child = ctx.Pipe(duplex=False)
        spec = {
            "endpoint": runner.front.address,
            "mode": mode,
            "threads": threads,
            "seed": runner.cfg.seed * 100 + slot,
            "images": list(runner.corpus.images),
            "digests": runner.corpus.digests,
            "budget_ms": runner.cfg.budget_ms,
            "hang_grace_s": runner.cfg.hang_grace_s,
            "release_timeout_ms": runner.cfg.release_timeout_ms,
            "breaker_open_s": runner.cfg.breaker_open_s,
            "warmup": runner.cfg.warmup,
            "ramp_s": runner.ramp_s,
            "netns": runner.cfg.topology.client_netns if runner.cfg.topology else "",
        }
        from tensorwire._lifeline import parent_lifeline

        env = {**runner.env, **parent_lifeline().child_env()}  # here: child_env asks which thread spawns
        self.proc = ctx.Process(
            target=_client_proc._child,
            name=f"soak-client-{slot}",
            daemon=True,
            args=(child, runner.counters, slot, spec, runner.stop_flag, env),
        )
        self.proc.start()
        self.pid = self.proc.pid or 0  # kept: the Process object is closed once the client is found dead
        child.close()
        self.received = 0
        self.ready: tuple[Any, ...] | None = None
        self.final: dict[str, Any] | None = None
        self.dead = False
        self.killed_by_fault = False


class SoakRunner:
    def __init__(self, cfg: SoakConfig, *, say: Callable[[str], None] = lambda m: None) -> None:
        self.cfg = cfg
        self.say = say
        self.rng = random.Random(cfg.seed)
        self.env = {
            "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
            "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
            "UCX_WARN_UNUSED_ENV_VARS": "n",
            "TENSORWIRE_SOAK_CHILD_LOG_LEVEL": os.environ.get("TENSORWIRE_SOAK_CHILD_LOG_LEVEL", "ERROR"),
        }
        os.environ.update({k: v for k, v in self.env.items() if k not in os.environ})
        self.corpus: Corpus
        self.workers: list[WorkerProcess | None] = []
        self.worker_gen: list[int] = []
        self.worker_baseline: dict[int, dict[str, Any]] = {}  # index -> stats of the current incarnation
        self.worker_started: list[float] = []
        self.relays: list[FaultRelay] = []
        self.front: FaultRelay
        self.proxy: Any = None
        max_clients = cfg.processes + 4096  # restarts take fresh slots
        self.counters = mp.get_context("spawn").RawArray("q", max_clients * _client_proc.FIELDS)
        self.stop_flag = mp.get_context("spawn").RawValue("b", 0)
        self.clients: list[_Client] = []
        self._next_slot = 0
        self._lock = threading.Lock()
        self.results: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.untyped: list[str] = []
        self.wrong: list[dict[str, Any]] = []
        self.planes: Counter[str] = Counter()
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.hung_reports = 0
        self.faults: Counter[str] = Counter()
        self.aborted_by_kill = 0
        self.timeline: list[dict[str, Any]] = []
        self.windows = FaultWindows()
        self.outcomes: list[Outcome] = []
        self.phase = "start-up"
        self._stop_faults = threading.Event()
        # Baselines are taken after a ramp at full load, not at start: thread pools, lazily opened channels and
        # UCX endpoints (one per UCX worker and owner) grow to their bound first; growth after it is a leak.
        self.ramp_s = max(5.0, min(30.0, 0.15 * cfg.duration_s))
        self.restart_times: list[float] = []
        self.t_start = 0.0
        self.self_baseline: dict[str, Any] | None = None
        self.self_baseline_names: list[str] = []

    # ---- set-up

    def _worker_config(self, index: int) -> Any:
        from tensorwire.mm import TransportConfig
        from tensorwire.rdma import RdmaConfig

        tiny = "pool" in self.cfg.faults and index == 1
        rdma = RdmaConfig(
            slot_gc_timeout_ms=self.cfg.slot_gc_timeout_ms,
            max_slot_bytes=(1 << 20) if tiny else RdmaConfig().max_slot_bytes,
            pool_cap_bytes=self.cfg.tiny_pool_cap_bytes if tiny else RdmaConfig().pool_cap_bytes,
        )
        return TransportConfig(mode="auto", worker_id=f"soak-w{index}-g{self.worker_gen[index]}", rdma=rdma)

    def _start_worker(self, index: int) -> WorkerProcess:
        topo = self.cfg.topology
        w = WorkerProcess(
            self._worker_config(index),
            self.env,
            start_timeout_s=self.cfg.startup_timeout_s,
            netns=topo.worker_netns[index] if topo else "",
            host=topo.worker_hosts[index] if topo else "127.0.0.1",
        )
        if not w.rdma_ready:
            log.warning("worker %d: RDMA exporter not ready; it serves inline", index)
        return w

    def _start_client(self, mode: str, threads: int) -> _Client:
        with self._lock:
            slot = self._next_slot
            self._next_slot += 1
        c = _Client(self, slot, mode, threads)
        with self._lock:
            self.clients.append(c)
        return c

    def setup(self) -> None:
        from tensorwire.service._proxy import EncoderProxy, ProxyConfig

        t0 = time.monotonic()
        self.say("building the expected outputs locally (built-in ViT) ...")
        self.corpus = build_corpus(self.cfg.seed)
        self.say(f"starting {self.cfg.workers} workers ...")
        self.worker_gen = [0] * self.cfg.workers
        self.worker_started = [time.monotonic()] * self.cfg.workers
        started = [self._start_worker(i) for i in range(self.cfg.workers)]
        self.workers = [*started]
        self.relays = [FaultRelay(f"w{i}", w.address, seed=self.cfg.seed + i) for i, w in enumerate(started)]
        from prometheus_client import CollectorRegistry

        # Across hosts the workers see the relays' non-loopback addresses, and WorkerInfo answers only loopback or
        # mTLS callers: the proxy then takes the route TTL from the soak's GC window instead of asking.
        self.proxy = EncoderProxy(
            ProxyConfig(
                workers=tuple(r.address for r in self.relays),
                release_timeout_ms=self.cfg.release_timeout_ms,
                slot_gc_timeout_ms=self.cfg.slot_gc_timeout_ms,
                check_workers=self.cfg.topology is None,
                worker_wait_s=30.0,
            ),
            registry=CollectorRegistry(),
        )
        proxy_port = self.proxy.start("127.0.0.1:0")
        self.front = FaultRelay(
            "front",
            f"127.0.0.1:{proxy_port}",
            seed=self.cfg.seed + 99,
            host=self.cfg.topology.front_host if self.cfg.topology else "127.0.0.1",
        )
        n = self.cfg.processes
        per = [self.cfg.concurrency // n + (1 if i < self.cfg.concurrency % n else 0) for i in range(n)]
        self.say(f"starting {n} client processes ({self.cfg.concurrency} fetch threads) ...")
        for i, threads in enumerate(per):
            self._start_client(self.cfg.planes[i % len(self.cfg.planes)], threads)
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        for c in list(self.clients):
            left = deadline - time.monotonic()
            if not c.conn.poll(max(0.0, left)):
                raise RuntimeError("a soak client did not finish its warm-up")
            msg = c.conn.recv()
            c.ready = msg
            _, warm = msg
            bad = [r for r in warm if r["outcome"] != "ok"]
            if bad:
                raise RuntimeError(
                    f"warm-up before any fault failed: {bad[:3]} (a 'wrong' here means this torch "
                    "build is not bit-reproducible across processes, not a transport error)"
                )
        self.setup_s = time.monotonic() - t0

    # ---- the run

    def _pump(self, until: Callable[[], bool]) -> None:
        """Receives client messages until ``until()``; notices dead clients and replaces killed ones."""
        while not until():
            with self._lock:
                live = [c for c in self.clients if not c.dead and c.final is None]
            if not live:
                time.sleep(0.05)
                continue
            ready = mpc.wait([c.conn for c in live], timeout=0.1)
            for c in live:
                if c.conn not in ready:
                    continue
                try:
                    msg = c.conn.recv()
                except (EOFError, OSError, Exception):  # a child killed mid-send
                    self._client_died(c)
                    continue
                self._on_message(c, msg)

    def _on_message(self, c: _Client, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "ready":  # a replacement client finished its warm-up (under faults: those count too)
            c.ready = msg
            for r in msg[1]:
                self._on_result(r)
        elif kind == "result":
            c.received += 1
            self._on_result(msg[1])
        elif kind == "hung":
            self.hung_reports += 1
        elif kind == "final":
            c.final = msg[1]

    def _on_result(self, r: dict[str, Any]) -> None:
        self.results[r["outcome"]] += 1
        ok = r["outcome"] == "ok"
        why = "" if ok else f"{r['kind']}:{r['reason']}" if r["outcome"] == "error" else r["outcome"]
        self.outcomes.append(Outcome(r["t0"], r["t1"], ok, why, "" if ok else str(r.get("msg", ""))[:300]))
        if r["outcome"] in ("ok", "wrong"):
            self.planes[r["plane"]] += 1
            self.latency[r["plane"]].append(r["latency_ms"])
            if r.get("fallback"):
                self.fallbacks[r["fallback"]] += 1
            if r["outcome"] == "wrong":
                self.wrong.append(r)
        elif r["outcome"] == "error":
            self.errors[f"{r['kind']}:{r['reason']}"] += 1
        else:
            self.untyped.append(f"{r['kind']}: {r['msg']}")

    def _client_died(self, c: _Client) -> None:
        c.dead = True
        c.proc.join(5)
        c.conn.close()  # else every killed client would show up as an fd leak of this process
        exitcode = c.proc.exitcode  # read before close(): a closed Process object raises on every attribute
        if not c.proc.is_alive():
            c.proc.close()  # its sentinel fd
        started = self.counters[c.slot * _client_proc.FIELDS + _client_proc.STARTED]
        lost = max(0, started - self.cfg.warmup - c.received)  # in flight when it died, or finished but not sent
        if c.killed_by_fault:
            self.aborted_by_kill += lost
            if self.phase == "soak":
                self._start_client(c.mode, c.threads)  # its replacement warms up and joins in
        else:
            self.results["client_crashed"] += 1
            self.untyped.append(
                f"client {c.slot} exited with {exitcode} (not killed by a fault); {lost} request(s) lost"
            )

    def _faults_loop(self) -> None:
        cfg = self.cfg
        kinds = [k for k in cfg.faults if k in ("reader_kill", "worker_restart", "unavailable")]
        if "release_drop" in cfg.faults or "release_delay" in cfg.faults or "corrupt" in cfg.faults:
            for r in [*self.relays, self.front]:
                r.release_drop_p = cfg.release_drop_p if "release_drop" in cfg.faults else 0.0
                r.release_delay_p = cfg.release_delay_p if "release_delay" in cfg.faults else 0.0
            for r in self.relays:
                r.corrupt_p = cfg.corrupt_p if "corrupt" in cfg.faults else 0.0
        last_restart = time.monotonic()
        while kinds and not self._stop_faults.wait(self.rng.uniform(*cfg.fault_interval_s)):
            kind = self.rng.choice(kinds)
            try:
                if kind == "reader_kill":
                    with self._lock:  # slot 0 is the sentinel: never killed, it lives through every fault
                        live = [
                            c
                            for c in self.clients
                            if not c.dead
                            and c.ready is not None
                            and c.mode == "auto"
                            and not c.killed_by_fault
                            and c.slot != 0
                        ]
                    if live:
                        c = self.rng.choice(live)
                        c.killed_by_fault = True
                        self.counters[c.slot * _client_proc.FIELDS + _client_proc.KILL] = 1
                        self.faults["reader_kill"] += 1
                elif kind == "unavailable":
                    relay = self.rng.choice([self.front, *self.relays])
                    seconds = self.rng.uniform(0.5, 3.0)
                    now = time.monotonic()
                    if relay is not self.front and self._worker_faulted(now):
                        self.faults["skipped_second_worker_fault"] += 1
                        continue
                    relay.unavailable_for(seconds)
                    self.windows.add(
                        "client_cut" if relay is self.front else "worker_cut", relay.name, now, now + seconds
                    )
                    self.faults[f"unavailable_{relay.name}"] += 1
                elif kind == "worker_restart" and time.monotonic() - last_restart >= cfg.worker_restart_min_gap_s:
                    if self._worker_faulted(time.monotonic()):
                        self.faults["skipped_second_worker_fault"] += 1
                        continue
                    # Worker 0 is the sentinel (never restarted): its fds/threads/pool are checked over the whole run.
                    i = self.rng.randrange(1, len(self.workers)) if len(self.workers) > 1 else 0
                    window = self.windows.open("worker_restart", f"w{i}", time.monotonic())
                    old = self.workers[i]
                    self.workers[i] = None
                    if old is not None:
                        old.kill()
                    self.faults["worker_restart"] += 1
                    time.sleep(self.rng.uniform(0.2, 1.0))
                    self.worker_gen[i] += 1
                    self.worker_baseline.pop(i, None)
                    try:
                        new = self._start_worker(i)
                        self.worker_started[i] = time.monotonic()
                        self.restart_times.append(self.worker_started[i])
                        self.relays[i].retarget(new.address)
                        self.workers[i] = new
                    finally:
                        self.windows.close(window, time.monotonic())
                    last_restart = time.monotonic()
            except Exception:  # a fault that could not be injected is logged, the soak goes on
                log.exception("injecting %s failed", kind)
                self.faults[f"{kind}_inject_failed"] += 1

    def _worker_faulted(self, now: float) -> bool:
        """One worker faulted at a time: the availability claim is that a healthy worker serves meanwhile."""
        return bool(self.windows.open_at(now, WORKER_KINDS)) if self.cfg.one_worker_fault else False

    def _progress(self, t_start: float) -> None:
        elapsed = time.monotonic() - t_start
        done = sum(self.results.values())
        fb = sum(self.fallbacks.values())
        err = sum(self.errors.values())
        self.say(
            f"[{elapsed:6.1f}s] requests {done}  ok {self.results['ok']}  fallbacks {fb}  errors {err}  "
            f"wrong {self.results['wrong']}  hung {self.hung_reports}  killed-in-flight {self.aborted_by_kill}"
            f"  faults {sum(self.faults.values())}"
        )

    def _sample_timeline(self, t_start: float) -> None:
        point: dict[str, Any] = {
            "t_s": round(time.monotonic() - t_start, 2),
            "self": _brief(sample()),
            "requests": sum(self.results.values()),
            "workers": {},
        }
        for i, w in enumerate(self.workers):
            if w is None or not w.alive():
                continue
            try:
                st = w.stats(timeout_s=5.0)
            except Exception:  # the worker may be mid-restart
                continue
            if (
                i not in self.worker_baseline
                and time.monotonic() - max(self.worker_started[i], self.t_start) >= self.ramp_s
            ):
                self.worker_baseline[i] = st
            point["workers"][str(i)] = {
                "live_leases": st["exporter"].get("live_leases"),
                "busy_bytes": st["exporter"].get("busy_bytes"),
                "pool_bytes": st["exporter"].get("pool_bytes"),
                "gen": self.worker_gen[i],
                **_brief(st["process"]),
            }
        with self._lock:
            clients = [c for c in self.clients if not c.dead and c.final is None]
        # c.pid, not c.proc.pid: the pump thread closes a dead client's Process object (_client_died) while this
        # runs, and a closed one raises on every attribute
        point["clients"] = {str(c.slot): _brief(sample(c.pid)) for c in clients if c.pid}
        self.timeline.append(point)

    def run(self) -> dict[str, Any]:
        try:
            self.setup()
            return self._run()
        finally:
            self.teardown()

    def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        self.phase = "soak"
        t_start = self.t_start = time.monotonic()
        end_at = t_start + cfg.duration_s
        faults = threading.Thread(target=self._faults_loop, name="soak-faults", daemon=True)
        faults.start()
        pump = threading.Thread(target=self._pump, args=(lambda: self.phase == "done",), name="soak-pump", daemon=True)
        pump.start()
        next_progress = t_start + cfg.progress_s
        next_sample = t_start
        self.say(f"soak running for {cfg.duration_s:.0f} s, faults: {', '.join(cfg.faults) or 'none'}")
        while time.monotonic() < end_at:
            now = time.monotonic()
            if self.self_baseline is None and now - t_start >= self.ramp_s:
                self.self_baseline, self.self_baseline_names = sample(), thread_names()
            if now >= next_sample:
                self._sample_timeline(t_start)
                next_sample = now + cfg.sample_s
            if now >= next_progress:
                self._progress(t_start)
                next_progress = now + cfg.progress_s
            time.sleep(0.1)
        self.phase = "stopping"
        self._stop_faults.set()
        faults.join(120)
        for r in [*self.relays, self.front]:
            r.clear_faults()
        self._progress(t_start)
        self.say("stopping clients (they drain their release queues) ...")
        self.stop_flag.value = 1
        deadline = time.monotonic() + cfg.budget_ms / 1000.0 + cfg.hang_grace_s + 30.0
        while time.monotonic() < deadline:
            with self._lock:
                waiting = [c for c in self.clients if not c.dead and c.final is None]
            if not waiting:
                break
            time.sleep(0.1)
        self.phase = "done"
        pump.join(5)
        soak_s = time.monotonic() - t_start
        with self._lock:
            stuck = [c for c in self.clients if not c.dead and c.final is None]
        for c in stuck:  # a client that never reported: every request it had in flight is hung
            base = c.slot * _client_proc.FIELDS
            in_flight = self.counters[base + _client_proc.STARTED] - self.counters[base + _client_proc.FINISHED]
            self.hung_reports += max(1, in_flight)
        self.say(f"waiting out the GC window ({cfg.slot_gc_timeout_ms} ms) and reading the workers ...")
        return self._account(soak_s, stuck)

    # ---- accounting

    def _settled(self, workers: dict[str, Any]) -> dict[str, Any]:
        """The workers' stats once every worker has at most its baseline's descriptors, or after ``SETTLE_S``.

        A connection whose client has gone is closed by its worker when that worker next reads it, and a caller
        that gave up on a call keeps its connection for a late answer (``LATE_ANSWER_S``): on a loaded host a
        single look half a second after the clients stopped can count a socket that is about to close. A leak
        stays over the baseline for the whole window."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            over = [
                key
                for key, st in workers.items()
                if (base := self.worker_baseline.get(int(key))) is not None
                and server_fds_delta(_delta(base["process"], st["process"], [], [])) > 0
            ]
            if not over or time.monotonic() >= deadline:
                return workers
            time.sleep(0.25)
            for key in over:
                w = self.workers[int(key)]
                if w is not None:
                    workers[key] = w.stats()

    def _account(self, soak_s: float, stuck: list[_Client]) -> dict[str, Any]:
        cfg = self.cfg
        gc_deadline = time.monotonic() + 2 * cfg.slot_gc_timeout_ms / 1000.0 + 2.0
        workers: dict[str, Any] = {}
        while True:
            for i, w in enumerate(self.workers):
                if w is not None:
                    workers[str(i)] = w.stats()
            live = sum(int(s["exporter"].get("live_leases", 0)) for s in workers.values())
            if live == 0 or time.monotonic() > gc_deadline:
                break
            time.sleep(0.25)
        leases_out = sum(int(s["exporter"].get("live_leases", 0)) for s in workers.values())
        busy_slots = sum(int(s["exporter"].get("busy_slots", 0)) for s in workers.values())
        busy_bytes = sum(int(s["exporter"].get("busy_bytes", 0)) for s in workers.values())
        time.sleep(0.5)
        workers = self._settled(workers)
        self_end = sample()
        self_end_names = thread_names()
        procs: dict[str, Any] = {}
        unchecked: list[str] = []
        if self.self_baseline is not None:
            procs["soak+proxy+relays"] = _delta(self.self_baseline, self_end, self.self_baseline_names, self_end_names)
        else:
            unchecked.append("soak+proxy+relays")
        for key, st in workers.items():
            gen = self.worker_gen[int(key)]
            base = self.worker_baseline.get(int(key))
            if base is None:
                unchecked.append(f"worker{key}")
            else:
                procs[f"worker{key}" + (f"(restart {gen})" if gen else "")] = _delta(
                    base["process"],
                    st["process"],
                    base["thread_names"],
                    st["thread_names"],
                    native_per_pool_thread=int(st["exporter"].get("torch_threads", 1)) - 1,
                )
        for c in self.clients:
            if c.final is not None and c.final["baseline"] is None:
                unchecked.append(f"client{c.slot}")
            elif c.final is not None:
                d = _delta(
                    c.final["baseline"], c.final["end"], c.final["baseline_thread_names"], c.final["end_thread_names"]
                )
                d["worker_restarts_after_baseline"] = sum(1 for t in self.restart_times if t > c.final["baseline_t"])
                procs[f"client{c.slot}"] = d
        hung = self.hung_reports + sum(int(c.final["hung_at_stop"]) for c in self.clients if c.final is not None)
        # Judged: this process, the sentinel worker (0, never restarted) and the sentinel client (slot 0, never
        # killed); they live through every fault. Replacement processes are young: their UCX endpoints to each
        # owner are still being opened lazily, so their growth is reported, not judged.
        judged = {k: v for k, v in procs.items() if k in ("soak+proxy+relays", "worker0", "client0")}
        for k, v in procs.items():
            v["judged"] = k in judged
        fds_ok = bool(judged) and all(_fds_back(name, p) for name, p in judged.items())
        threads_ok = bool(judged) and all(p["threads_leaked"] <= 0 for p in judged.values())
        requests = sum(self.results.values()) + self.aborted_by_kill
        relay_counts: Counter[str] = Counter()
        for r in [*self.relays, self.front]:
            relay_counts.update({f"{r.name}.{k}": v for k, v in r.counts.items()})
        report: dict[str, Any] = {
            "config": {
                **{k: v for k, v in dataclasses.asdict(cfg).items() if k != "extra"},
                "client_processes": cfg.processes,
            },
            # The host's 1/5/15-minute load averages at the end: on a shared machine they say how much CPU the
            # soak really had (its latencies and its worker restart times follow them).
            "load_average": [round(x, 1) for x in os.getloadavg()],
            "duration_s": round(soak_s, 1),
            "setup_s": round(self.setup_s, 1),
            "requests": requests,
            "successes": self.results["ok"],
            "delivered_by_plane": dict(self.planes),
            "fallbacks_by_reason": dict(self.fallbacks),
            "errors_by_reason": dict(self.errors),
            "untyped_errors": len(self.untyped),
            "untyped_examples": self.untyped[:10],
            "aborted_by_reader_kill": self.aborted_by_kill,
            "wrong_outputs": len(self.wrong),
            "wrong_examples": self.wrong[:5],
            "hung_requests": hung,
            "leases_outstanding_after_gc": leases_out,
            "busy_slots_after_gc": busy_slots,
            "pool_busy_bytes_after_gc": busy_bytes,
            "pool_bytes": {
                i: {
                    "start": self.worker_baseline.get(int(i), {}).get("exporter", {}).get("pool_bytes"),
                    "end": s["exporter"].get("pool_bytes"),
                }
                for i, s in workers.items()
            },
            "gc_reclaimed": {i: s["exporter"].get("gc_reclaims", 0) for i, s in workers.items()},
            "worker_exporter_end": {
                i: {k: v for k, v in s["exporter"].items() if not isinstance(v, dict)} for i, s in workers.items()
            },
            "processes": procs,
            "processes_unchecked": unchecked,
            "ramp_s": self.ramp_s,
            "fds_back": fds_ok,
            "threads_back": threads_ok,
            "client_release_queue_dropped": sum(
                float(c.final.get("release_queue_dropped", 0)) for c in self.clients if c.final is not None
            ),
            "faults_injected": dict(self.faults),
            "relay_events": dict(relay_counts),
            "availability": self.windows.summarize(self.outcomes, end=time.monotonic(), origin=self.t_start),
            "latency_ms": {plane: _percentiles(v) for plane, v in self.latency.items()},
            "throughput_rps": {plane: round(len(v) / soak_s, 2) for plane, v in self.latency.items()},
            "timeline_growth": _timeline_growth(self.timeline, self.ramp_s),
            "timeline": self.timeline,
        }
        report["passed"] = (
            report["wrong_outputs"] == 0
            and hung == 0
            and leases_out == 0
            and busy_slots == 0
            and report["untyped_errors"] == 0
            and fds_ok
            and threads_ok
            and not stuck
        )
        return report

    def teardown(self) -> None:
        self.phase = "done"
        self._stop_faults.set()
        self.stop_flag.value = 1
        for c in self.clients:
            if c.dead:
                continue
            c.proc.join(0.1 if c.final is not None else 5)
            if c.proc.is_alive():
                c.proc.kill()
                c.proc.join(5)
            if not c.conn.closed:
                c.conn.close()
        try:
            self.front.close()
        except AttributeError:
            pass
        if self.proxy is not None:
            self.proxy.stop(1.0)
        for r in self.relays:
            r.close()
        for w in self.workers:
            if w is not None:
                w.stop()


def server_fds_delta(p: dict[str, Any]) -> int:
    """A server process's fd growth less what is not a leak: its connections whose peer still has them open (TCP
    established: a live client may open another pooled connection after the baseline, which is that client's to
    bound, as the sentinel client's check does) and ``tensorwire._loopback``'s sock_diag sockets while they stay
    within that pool's bound (two owner lookups at once after the baseline leave a second pooled socket). A
    connection its peer closed and the server kept (close_wait), sock_diag sockets past the pool's bound, and every
    other kind count."""
    from tensorwire._loopback import POOL_MAX

    growth = p.get("socket_growth_by_state", {})
    live = max(0, int(growth.get("tcp:established", 0)))
    pooled = max(0, int(growth.get("netlink:sock_diag", 0)))
    if int(p.get("sock_diag_sockets", 0)) > POOL_MAX:
        pooled = 0
    return int(p["fds_delta"]) - live - pooled


def server_fds_back(p: dict[str, Any]) -> bool:
    """No fd of a server grew but live connections and the owner-lookup pool (``server_fds_delta``)."""
    return server_fds_delta(p) <= 0


def _fds_back(name: str, p: dict[str, Any]) -> bool:
    """No fd grew, except connections a live peer holds open on a server (``server_fds_delta``), and on the
    sentinel client sockets: at most one UCX endpoint per UCX worker (qp_count) for each worker restart after its
    baseline (a restarted owner's endpoints are opened lazily, after the baseline; docs/reliability.md,
    Findings 1)."""
    if not name.startswith("client"):
        return server_fds_back(p)
    from tensorwire.rdma import RdmaConfig

    grown = {k: v for k, v in p.get("fd_growth_by_kind", {}).items() if v > 0}
    allowed = RdmaConfig().qp_count * int(p.get("worker_restarts_after_baseline", 0))
    return set(grown) <= {"socket"} and grown.get("socket", 0) <= allowed


def _delta(
    base: dict[str, Any],
    end: dict[str, Any],
    base_names: list[str],
    end_names: list[str],
    native_per_pool_thread: int = 0,
) -> dict[str, Any]:
    """fds/threads/rss at the baseline and the end; threads_leaked ignores on-demand pool threads (bounded).

    ``native_per_pool_thread``: native threads each new pool thread brings (a worker's executor thread that runs
    torch gets its own OpenMP team of torch_threads - 1 threads: libgomp keeps one team per calling thread).
    """
    grown = Counter(end_names) - Counter(base_names)
    pool_growth = sum(n for name, n in grown.items() if name.startswith(POOL_PREFIXES))
    pool_growth *= 1 + max(0, native_per_pool_thread)
    other = {name: n for name, n in grown.items() if not name.startswith(POOL_PREFIXES)}
    threads_delta = int(end["threads"]) - int(base["threads"])
    kinds = set(base.get("fd_kinds", {})) | set(end.get("fd_kinds", {}))
    fd_growth = {k: end.get("fd_kinds", {}).get(k, 0) - base.get("fd_kinds", {}).get(k, 0) for k in sorted(kinds)}
    sb, se = base.get("sockets", {}), end.get("sockets", {})
    socket_growth = {k: se.get(k, 0) - sb.get(k, 0) for k in sorted(set(sb) | set(se)) if se.get(k, 0) != sb.get(k, 0)}
    db, de = base.get("socket_details", {}), end.get("socket_details", {})
    listed = 16  # enough to say whose they are
    new_sockets = sorted(de[inode] for inode in de if inode not in db)
    nb, ne = base.get("native_threads", {}), end.get("native_threads", {})
    native_growth = {k: ne.get(k, 0) - nb.get(k, 0) for k in sorted(set(nb) | set(ne)) if ne.get(k, 0) != nb.get(k, 0)}
    return {
        "fds": [base["fds"], end["fds"]],
        "fds_delta": int(end["fds"]) - int(base["fds"]),
        "native_thread_growth": native_growth,
        "fd_growth_by_kind": {k: v for k, v in fd_growth.items() if v},
        "socket_growth_by_state": socket_growth,
        "new_sockets": new_sockets[:listed],  # open at the end and not at the baseline, named
        "sock_diag_sockets": se.get("netlink:sock_diag", 0),
        "threads": [base["threads"], end["threads"]],
        "threads_delta": threads_delta,
        "pool_threads_grown": pool_growth,
        "threads_leaked": max(0, threads_delta - pool_growth),
        "new_thread_names": other,
        "rss_mb": [round(base["rss_bytes"] / 2**20, 1), round(end["rss_bytes"] / 2**20, 1)],
    }


def _brief(s: dict[str, Any]) -> dict[str, Any]:
    return {"fds": s["fds"], "threads": s["threads"], "rss_bytes": s["rss_bytes"]}


def _timeline_growth(timeline: list[dict[str, Any]], ramp_s: float) -> dict[str, Any]:
    """Per long-lived process: RSS, threads and fds at the first sample after the ramp and at the last sample,
    and the peak of live leases; the load run's "no growth over the run" check reads this."""
    after = [p for p in timeline if p["t_s"] >= ramp_s]
    if len(after) < 2:
        return {}
    first, last = after[0], after[-1]

    def row(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        return {
            "rss_mb": [round(a["rss_bytes"] / 2**20, 1), round(b["rss_bytes"] / 2**20, 1)],
            "threads": [a["threads"], b["threads"]],
            "fds": [a["fds"], b["fds"]],
        }

    out: dict[str, Any] = {
        "window_s": [first["t_s"], last["t_s"]],
        "soak+proxy+relays": row(first["self"], last["self"]),
    }
    for kind in ("workers", "clients"):
        for key, b in last[kind].items():
            a = first[kind].get(key)
            if a is not None and a.get("gen", 0) == b.get("gen", 0):  # the same process at both ends
                out[f"{kind[:-1]}{key}"] = row(a, b)
    peaks = [w.get("live_leases") or 0 for p in after for w in p["workers"].values()]
    out["live_leases_peak"] = max(peaks, default=0)
    out["live_leases_last"] = sum((w.get("live_leases") or 0) for w in last["workers"].values())
    return out


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    v = sorted(values)

    def q(p: float) -> float:
        return round(v[min(len(v) - 1, int(p * len(v)))], 2)

    return {
        "n": len(v),
        "mean": round(statistics.fmean(v), 2),
        "p50": q(0.50),
        "p90": q(0.90),
        "p99": q(0.99),
        "p999": q(0.999),
        "max": round(v[-1], 2),
    }


def run_soak(cfg: SoakConfig, say: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Runs one soak (or load run: ``faults=()``) and returns the report."""
    return SoakRunner(cfg, say=say).run()


__all__ = ["SoakRunner", "run_soak", "POOL_PREFIXES"]
