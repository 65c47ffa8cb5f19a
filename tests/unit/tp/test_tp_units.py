"""Single-process tests of the broadcaster's pieces: frames, paths and directory checks, config, public names."""

from __future__ import annotations

import os
import pickle
import stat

import pytest
import torch

from tensorwire.errors import BootstrapError, BroadcastError, ConfigError, FrameMismatch, Reason
from tensorwire.tp import BroadcastConfig, CpuTpBroadcaster
from tensorwire.tp import _frame as F
from tensorwire.tp import _paths as P


def _roundtrip(value, align=1):
    structure, keys, tensors = F.flatten(value, 0)
    prefix, offsets, payload = F.encode_prefix(F.KIND_DATA, 5, structure, keys, tensors, align)
    buf = bytearray(prefix) + bytearray(payload)
    for t, off in zip(tensors, offsets, strict=True):
        v = F.byte_view(t)
        buf[len(prefix) + off : len(prefix) + off + len(v)] = v
    mv = memoryview(bytes(buf))
    kind, seq, n, table_bytes, pb, st = F.decode_header(mv[: F.HEADER.size], 1)
    assert (kind, seq, pb) == (F.KIND_DATA, 5, payload)
    entries = F.decode_table(mv[F.HEADER.size : F.HEADER.size + table_bytes], n, pb, 1)
    layout = F.Layout(kind, seq, st, entries, table_bytes, pb)
    out = F.allocate(layout)
    base = F.HEADER.size + table_bytes
    for e, t in zip(entries, out, strict=True):
        F.byte_view(t)[:] = mv[base + e.offset : base + e.offset + e.nbytes]
    return F.unflatten(st, entries, out)


@pytest.mark.parametrize("dtype", sorted(F.CODE_OF, key=str), ids=str)
def test_every_dtype_roundtrips(dtype):
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(dtype)
    out = _roundtrip(src)
    assert out.dtype == dtype and out.shape == src.shape
    assert out.reshape(-1).view(torch.uint8).equal(src.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("align", [1, 64])
def test_structures_roundtrip(align):
    value = {"a": torch.zeros(0, 3), "ß": torch.tensor(7), "c": torch.arange(5, dtype=torch.int16)[::2]}
    out = _roundtrip(value, align)
    assert list(out) == ["a", "ß", "c"]
    assert out["a"].shape == (0, 3) and int(out["ß"]) == 7 and out["c"].tolist() == [0, 2, 4]
    assert isinstance(_roundtrip((torch.ones(2),), align), tuple)
    assert _roundtrip([], align) == []


def test_bad_inputs_are_refused_before_any_io():
    with pytest.raises(BroadcastError) as ei:
        F.flatten({1: torch.zeros(1)}, 0)
    assert "keys must be str" in str(ei.value)
    with pytest.raises(BroadcastError):
        F.flatten([torch.zeros(1), "x"], 0)
    with pytest.raises(BroadcastError):
        F.flatten(3, 0)


def test_corrupt_frames_raise_frame_mismatch():
    structure, keys, tensors = F.flatten(torch.arange(4), 0)
    prefix, _, payload = F.encode_prefix(F.KIND_DATA, 1, structure, keys, tensors, 1)
    bad = bytearray(prefix)
    bad[0:4] = b"XXXX"
    with pytest.raises(FrameMismatch):
        F.decode_header(bytes(bad), 1)
    kind, seq, n, table_bytes, pb, st = F.decode_header(prefix, 1)
    table = bytearray(prefix[F.HEADER.size :])
    table[0] = 250  # unknown dtype code
    with pytest.raises(FrameMismatch):
        F.decode_table(bytes(table), n, pb, 1)
    with pytest.raises(FrameMismatch):  # claims more bytes than the payload holds
        F.decode_table(prefix[F.HEADER.size :], n, pb - 1, 1)
    with pytest.raises(FrameMismatch):  # truncated
        F.decode_table(prefix[F.HEADER.size : -3], n, pb, 1)


def test_session_sanitizing_and_digest():
    assert P.sanitize_session("a/b c:d") == "a_b_c_d"
    assert P.session_digest("a/b") != P.session_digest("a_b")
    with pytest.raises(ConfigError):
        P.sanitize_session("")


def test_tmpdir_is_honoured(monkeypatch, tmp_path):
    monkeypatch.delenv(P.ENV_DIR, raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert P.default_base_dir() == os.path.join(str(tmp_path), f"tensorwire-{os.geteuid()}")
    monkeypatch.setenv(P.ENV_DIR, str(tmp_path / "explicit"))
    assert P.default_base_dir() == str(tmp_path / "explicit")


@pytest.mark.parametrize("problem", ["group-writable", "missing", "file"])
def test_unusable_xdg_runtime_dir_is_ignored(monkeypatch, tmp_path, problem):
    monkeypatch.delenv(P.ENV_DIR, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    xdg = tmp_path / "xdg"
    if problem == "group-writable":
        xdg.mkdir()
        os.chmod(xdg, 0o770)
    elif problem == "file":
        xdg.write_text("")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert P.default_base_dir() == os.path.join(str(tmp_path / "tmp"), f"tensorwire-{os.geteuid()}")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative/dir")
    assert P.default_base_dir() == os.path.join(str(tmp_path / "tmp"), f"tensorwire-{os.geteuid()}")


def test_explicit_dir_that_fails_the_checks_is_an_error_not_skipped(monkeypatch, tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    monkeypatch.setenv(P.ENV_DIR, str(d))
    with pytest.raises(BootstrapError) as ei:
        P.default_base_dir()
    assert ei.value.reason is Reason.INSECURE_PATH


def test_private_dir_is_created_0700(tmp_path):
    d = tmp_path / "priv"
    P.ensure_private_dir(str(d))
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_world_writable_dir_is_refused(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(BootstrapError) as ei:
        P.ensure_private_dir(str(d))
    assert ei.value.reason is Reason.INSECURE_PATH and "world-writable" in str(ei.value)


def test_foreign_owned_dir_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "foreign"
    d.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(d, 65534, 65534)  # really foreign
    else:
        monkeypatch.setattr(P, "effective_uid", lambda: os.geteuid() + 1)  # we pretend to be someone else
    with pytest.raises(BootstrapError) as ei:
        CpuTpBroadcaster(0, 2, "s", base_dir=str(d), init_timeout_s=0.1)
    assert ei.value.reason is Reason.INSECURE_PATH and "owned by uid" in str(ei.value)


def test_symlinked_dir_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(BootstrapError) as ei:
        P.ensure_private_dir(str(link))
    assert "symlink" in str(ei.value)


def test_abstract_endpoint_has_no_file():
    ep = P.make_endpoint("sess", None, True)
    assert ep.is_abstract and ep.path is None and isinstance(ep.address, bytes) and ep.address[0] == 0


def test_config_validation_and_env():
    with pytest.raises(ConfigError):
        BroadcastConfig(init_timeout_s=0)
    with pytest.raises(ConfigError):
        BroadcastConfig(slot_bytes=1000)
    with pytest.raises(ConfigError):
        BroadcastConfig(n_slots=1)
    cfg = BroadcastConfig.from_env(
        {
            "TENSORWIRE_BROADCAST_TIMEOUT_S": "2.5",
            "TENSORWIRE_BROADCAST_ABSTRACT": "1",
            "TENSORWIRE_BROADCAST_N_SLOTS": "16",
        }
    )
    assert cfg.timeout_s == 2.5 and cfg.abstract is True and cfg.n_slots == 16
    with pytest.raises(ConfigError):
        BroadcastConfig.from_env({"TENSORWIRE_BROADCAST_N_SLOTS": "many"})


def _timeouts(b: CpuTpBroadcaster) -> tuple[float, float | None]:
    return b.config.init_timeout_s, b.config.timeout_s


def test_keyword_defaults_do_not_override_the_config():
    # Issue 13: CpuTpBroadcaster(config=BroadcastConfig(init_timeout_s=3)) used to wait 120 s anyway.
    cfg = BroadcastConfig(init_timeout_s=3, timeout_s=2.5)
    with CpuTpBroadcaster(0, 1, "solo", config=cfg) as b:
        assert _timeouts(b) == (3, 2.5)
    # Passed keywords win; timeout_s=None is a value ("no limit"), not "unset".
    with CpuTpBroadcaster(0, 1, "solo", init_timeout_s=7, timeout_s=None, config=cfg) as b:
        assert _timeouts(b) == (7, None)
    assert cfg.init_timeout_s == 3  # the caller's config is not modified


def test_keyword_defaults_do_not_override_the_environment(monkeypatch):
    monkeypatch.setenv("TENSORWIRE_BROADCAST_INIT_TIMEOUT_S", "4")
    monkeypatch.setenv("TENSORWIRE_BROADCAST_TIMEOUT_S", "1.5")
    with CpuTpBroadcaster(0, 1, "solo") as b:
        assert _timeouts(b) == (4, 1.5)
    with CpuTpBroadcaster(0, 1, "solo", timeout_s=9) as b:
        assert _timeouts(b) == (4, 9)
    # An explicit config is taken as given: the environment is read only when there is none.
    with CpuTpBroadcaster(0, 1, "solo", config=BroadcastConfig()) as b:
        assert _timeouts(b) == (120, None)


def test_constructor_argument_checks():
    with pytest.raises(ConfigError):
        CpuTpBroadcaster(2, 2, "s")
    with pytest.raises(ConfigError):
        CpuTpBroadcaster(0, 0, "s")
    with pytest.raises(ConfigError):
        CpuTpBroadcaster(0, 2, "s", backend="nccl")


def test_close_is_idempotent_and_closed_calls_raise():
    b = CpuTpBroadcaster(0, 1, "solo")
    b.close()
    b.close()
    from tensorwire.errors import ClosedError

    with pytest.raises(ClosedError):
        b.broadcast(torch.zeros(1))


def test_errors_pickle_with_reason():
    exc = BootstrapError("rank 1: bad", reason=Reason.BAD_RANK)
    back = pickle.loads(pickle.dumps(exc))
    assert back.reason is Reason.BAD_RANK and str(back) == "rank 1: bad"


def test_concurrent_call_is_refused():
    b = CpuTpBroadcaster(0, 1, "solo")
    b._call_lock.acquire()  # as if another thread were inside broadcast()
    try:
        with pytest.raises(BroadcastError) as ei:
            b.broadcast(torch.zeros(1))
        assert "concurrent or re-entrant" in str(ei.value)
    finally:
        b._call_lock.release()
        b.close()


def test_stall_warnings_are_rate_limited(caplog):
    import logging
    import time

    from tensorwire.errors import BroadcastTimeout
    from tensorwire.tp._link import Waiter

    w = Waiter(3, "broadcast (waiting for message 7 from rank 0)", timeout_s=None, stall_warn_s=0.05)
    with caplog.at_level(logging.WARNING, logger="tensorwire.tp._link"):
        w.check()
        time.sleep(0.06)
        w.check()
        w.check()  # within the interval: no second warning
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "rank 3" in msgs[0] and "message 7" in msgs[0]
    t = Waiter(1, "x", timeout_s=0.01, stall_warn_s=30)
    time.sleep(0.02)
    with pytest.raises(BroadcastTimeout):
        t.check()


def test_lazy_conjugate_views_are_sent_by_value():
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    assert z.is_conj()
    out = _roundtrip(z)
    assert out.equal(torch.tensor([1 - 2j, 3 + 4j], dtype=torch.complex64))


def test_typed_codec_round_trips_and_checks_on_both_ends(monkeypatch):
    import dataclasses

    from tensorwire.tp import _typed as T

    @dataclasses.dataclass
    class Req:
        rid: str
        toks: list[int]

    codec = T.Codec(Req)
    data = codec.encode(Req("a", [1, 2]), 0)
    assert data[: T.FINGERPRINT_BYTES] == codec.fingerprint
    assert codec.decode(memoryview(data), 1, 7) == Req("a", [1, 2])
    with pytest.raises(BroadcastError, match="got a value of type dict") as ei:
        codec.encode({"rid": "a", "toks": []}, 0)  # not a Req: refused on rank 0
    assert ei.value.reason is Reason.INVALID_CONFIG
    with pytest.raises(FrameMismatch, match="does not decode as"):  # right fingerprint, wrong body
        codec.decode(memoryview(codec.fingerprint + T.Codec(list[int]).encode([1], 0)[8:]), 1, 7)
    with pytest.raises(FrameMismatch, match="another schema"):
        codec.decode(memoryview(T.Codec(list[int]).encode([1], 0)), 1, 7)
    with pytest.raises(FrameMismatch, match="does not decode as"):  # truncated
        codec.decode(memoryview(data[:-3]), 1, 7)
    monkeypatch.setitem(__import__("sys").modules, "msgspec", None)  # as if it were not installed
    with pytest.raises(BroadcastError, match=r"needs msgspec") as ei:
        T.Codec(Req)
    assert ei.value.reason is Reason.INVALID_CONFIG


def test_typed_world_of_one_checks_the_value_but_sends_nothing():
    import dataclasses

    @dataclasses.dataclass
    class One:
        n: int

    with CpuTpBroadcaster(0, 1, "typed-solo") as b:
        assert b.broadcast_object(One(3), schema=One) == One(3)
        with pytest.raises(BroadcastError, match="got a value of type int"):
            b.broadcast_object(4, schema=One)
        for bad in (object(), [One]):  # not a type; not even hashable
            with pytest.raises(BroadcastError, match="not a type msgspec can decode"):
                b.broadcast_object(One(1), schema=bad)
