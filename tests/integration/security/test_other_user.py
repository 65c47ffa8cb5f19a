"""Shared hosts: another local user gets nothing from a worker or a store, a port squatter gets no request, and
runtime directories are opened through a checked handle. Each test runs its hostile side as a second local user
(``other_user``: created by the test, root needed) in a separate process.

Claims (docs/security.md, "Who may call what" and "Same host"):

- a plaintext loopback worker and held-outputs store answer another uid's Encode, WorkerInfo, LocalChannel,
  Lookup and Release with PERMISSION_DENIED and nothing else (health still says SERVING, nothing more), while the
  worker's own user fetches as before;
- a client whose worker stopped and whose port another user bound fails with reason ``untrusted_listener``, and
  the squatter receives 0 bytes;
- an explicit ``runtime_dir`` that is a symlink is refused, and 3,000 rendezvous reads while another user flips
  that symlink between our directory and theirs return 0 forged endpoints;
- a default runtime directory pre-created by another user moves to a private fallback: the connector starts.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2
from PIL import Image
from prometheus_client import CollectorRegistry

from conftest import as_other
from tensorwire._local import unix as _unix
from tensorwire.encoder import BuiltinEncoder, PreprocessConfig
from tensorwire.errors import ConfigError, PeerUnavailable, Reason, TensorwireError
from tensorwire.integrations._vllm_ec import runtime as rt
from tensorwire.integrations._vllm_ec.config import ECConfig
from tensorwire.mm import MultimodalInput, RemoteOutputTransport, TransportConfig, metrics_for
from tensorwire.mm._proto import encoder_pb2 as pb
from tensorwire.mm._proto import held_pb2 as hpb
from tensorwire.mm.held._rpc import LOCAL_CHANNEL_METHOD as STORE_LOCAL_CHANNEL
from tensorwire.mm.held._rpc import LOOKUP_METHOD, RELEASE_METHOD, serve_store
from tensorwire.mm.held._store import HeldStore
from tensorwire.mm.wire import ENCODE_METHOD, LOCAL_CHANNEL_METHOD
from tensorwire.service._info import INFO_METHOD
from tensorwire.service._worker import EncoderWorker

pytestmark = pytest.mark.timeout(120)

SMALL = PreprocessConfig(max_pixels=224 * 224)
HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def worker() -> Iterator[EncoderWorker]:
    w = EncoderWorker(
        BuiltinEncoder(preprocess=SMALL), TransportConfig(mode="grpc"), metrics=metrics_for(CollectorRegistry())
    )
    w.start("127.0.0.1:0")
    try:
        yield w
    finally:
        w.stop(0.5)


@pytest.fixture
def shared_tmp(other_user: tuple[int, int]) -> Iterator[Path]:
    """A directory in /tmp the other user may enter (pytest's tmp_path is root's 0700)."""
    d = Path(tempfile.mkdtemp(prefix="tw-shared-", dir="/tmp"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def calls_as(user: tuple[int, int], target: str, calls: list[tuple[str, bytes]]) -> dict[str, tuple[str, int]]:
    proc = as_other(user, "call", target, json.dumps([[m, r.hex()] for m, r in calls]))
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    return {m: (code, n) for m, code, n in json.loads(out.strip().splitlines()[-1])}


def test_another_user_gets_nothing_from_a_worker(other_user: tuple[int, int], worker: EncoderWorker) -> None:
    encode = pb.EncodeRequest(inputs=[pb.MultimodalInput(data=_png())], support_rdma=True).SerializeToString()
    got = calls_as(
        other_user,
        worker.address,
        [
            (ENCODE_METHOD, encode),
            (INFO_METHOD, b""),
            (LOCAL_CHANNEL_METHOD, pb.LocalChannelRequest(host_token=_unix.host_token()).SerializeToString()),
            (HEALTH_CHECK, health_pb2.HealthCheckRequest().SerializeToString()),
        ],
    )
    assert got[ENCODE_METHOD] == ("PERMISSION_DENIED", 0)
    assert got[INFO_METHOD] == ("PERMISSION_DENIED", 0)
    assert got[LOCAL_CHANNEL_METHOD] == ("PERMISSION_DENIED", 0)
    assert got[HEALTH_CHECK][0] == "OK"  # SERVING: probes need it, and it says nothing else
    assert worker._host is not None and worker._host.stats().untrusted_callers == 3
    # The worker's own user is served as before.
    client = RemoteOutputTransport(
        worker.address, TransportConfig(mode="grpc"), metrics=metrics_for(CollectorRegistry())
    )
    try:
        out = client.fetch([MultimodalInput(_png())])
        assert len(out.embeddings) == 1
    finally:
        client.close()


def test_another_user_gets_nothing_from_a_held_outputs_store(other_user: tuple[int, int], tmp_path: Path) -> None:
    store = HeldStore(None, ttl_s=30)
    local_dir = tmp_path / "run"
    server = serve_store("127.0.0.1:0", store=store, local_dir=str(local_dir))
    try:
        grant = hpb.GrantRef(key="k", secret=b"s" * 16) if hasattr(hpb, "GrantRef") else None
        lookup = hpb.LookupRequest(grants=[grant] if grant is not None else []).SerializeToString()
        got = calls_as(
            other_user,
            server.address,
            [
                (LOOKUP_METHOD, lookup),
                (RELEASE_METHOD, hpb.ReleaseRequest().SerializeToString()),
                (STORE_LOCAL_CHANNEL, pb.LocalChannelRequest(host_token=_unix.host_token()).SerializeToString()),
            ],
        )
        assert got == {
            LOOKUP_METHOD: ("PERMISSION_DENIED", 0),
            RELEASE_METHOD: ("PERMISSION_DENIED", 0),
            STORE_LOCAL_CHANNEL: ("PERMISSION_DENIED", 0),
        }
    finally:
        server.stop(0.5)
        store.close()


def test_a_port_squatter_after_the_worker_stops_gets_no_request(other_user: tuple[int, int]) -> None:
    w = EncoderWorker(
        BuiltinEncoder(preprocess=SMALL), TransportConfig(mode="grpc"), metrics=metrics_for(CollectorRegistry())
    )
    port = w.start("127.0.0.1:0")
    client = RemoteOutputTransport(w.address, TransportConfig(mode="grpc"), metrics=metrics_for(CollectorRegistry()))
    squatter = None
    try:
        assert len(client.fetch([MultimodalInput(_png())]).embeddings) == 1
        w.stop(0.5)
        squatter = as_other(other_user, "squat", str(port))
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == "bound"
        secret_image = _png() + b"USER-SECRET-JPEG" * 100
        with pytest.raises(TensorwireError) as e:
            client.fetch([MultimodalInput(secret_image)], timeout_ms=5000)
        out, err = squatter.communicate("", timeout=30)
        assert squatter.returncode == 0, err
        assert int(out.strip().splitlines()[-1]) == 0  # not one byte: no connection preface, no request
        assert isinstance(e.value, PeerUnavailable) and e.value.reason.value == "untrusted_listener", e.value
        assert f"uid {other_user[0]}" in str(e.value)
    finally:
        client.close()
        w.stop(0)
        if squatter is not None and squatter.poll() is None:
            squatter.kill()
            squatter.wait()


def test_a_symlinked_runtime_dir_is_refused_and_flipping_it_forges_no_endpoint(
    other_user: tuple[int, int], shared_tmp: Path, tmp_path: Path
) -> None:
    name = "flip-dp0"
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    (ours / f"{name}.producer.json").write_text(json.dumps({"endpoint": "127.0.0.1:1111"}))
    assert rt.producer_endpoint(ECConfig(runtime_dir=str(ours)), name) == "127.0.0.1:1111"
    # The other user's directory and the symlink it controls, in a directory of its own (protected_symlinks
    # does not apply there).
    attic = shared_tmp / "attic"
    attic.mkdir()
    theirs = attic / "theirs"
    theirs.mkdir(mode=0o700)
    (theirs / f"{name}.producer.json").write_text(json.dumps({"endpoint": "6.6.6.6:6666"}))
    link = attic / "run"
    link.symlink_to(ours)
    for p in (attic, theirs, theirs / f"{name}.producer.json", link):
        os.lchown(p, *other_user)
    cfg = ECConfig(runtime_dir=str(link))
    with pytest.raises(ConfigError) as e:  # a symlink to our own private directory: refused, not followed
        rt.runtime_dir(cfg)
    assert e.value.reason is Reason.INSECURE_PATH
    flipper = as_other(other_user, "flip", str(link), str(ours), str(theirs))
    try:
        assert flipper.stdout is not None and flipper.stdout.readline().strip() == "flipping"
        answers = [rt.producer_endpoint(cfg, name) for _ in range(3000)]
    finally:
        flipper.communicate("", timeout=30)
    assert answers.count("6.6.6.6:6666") == 0
    assert set(answers) == {None}  # never read through the symlink at all


def test_a_pre_created_default_runtime_dir_falls_back_and_the_connector_starts(
    other_user: tuple[int, int], shared_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmpdir = shared_tmp / "tmp"
    tmpdir.mkdir()
    os.chmod(tmpdir, 0o1777)  # a /tmp of its own: sticky, world-writable
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    squatted = tmpdir / f"tensorwire-{os.geteuid()}"
    maker = as_other(other_user, "mkdir", str(squatted))
    out, err = maker.communicate(timeout=60)
    assert maker.returncode == 0 and out.strip() == "made", err
    assert squatted.stat().st_uid == other_user[0]
    cfg = ECConfig.from_extra({"rdma_provider": "none", "port": 0}, environ={})
    producer = rt.ProducerRuntime(cfg, "squat-dp0", "cpu")
    try:
        where = rt.runtime_dir(cfg)
        assert where.parent != squatted and where.parent.name.startswith(f"tensorwire-{os.geteuid()}-")
        assert (where.parent.stat().st_uid, where.parent.stat().st_mode & 0o777) == (os.geteuid(), 0o700)
        assert rt.producer_endpoint(cfg, "squat-dp0") == producer.endpoint  # the scheduler finds it there
        assert not any(squatted.iterdir())  # nothing of ours went into the other user's directory
    finally:
        producer.close()
    subprocess.run(["rm", "-rf", str(squatted)], check=False)
