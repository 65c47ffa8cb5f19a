"""The hostile process of test_other_user.py, run as a second local user (``setpriv``): it imports only the
standard library and grpc (the test's tree may not be readable to that user), takes its requests as hex bytes
built by the test, and prints what it got as one JSON line.

Commands: ``call TARGET JSON`` (JSON: [[method, request_hex], ...]; prints [[method, code, response_bytes], ...]),
``squat PORT`` (binds 127.0.0.1:PORT, prints "bound", counts every byte any connection sends until stdin closes,
then prints the count), ``flip LINK GOOD EVIL`` (points LINK at GOOD and EVIL in turn, by rename, until stdin
closes), ``mkdir PATH``.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading


def call(target: str, spec: str) -> None:
    import grpc

    out = []
    with grpc.insecure_channel(target) as channel:
        for method, hexreq in json.loads(spec):
            fn = channel.stream_unary(method, request_serializer=None, response_deserializer=None)
            try:
                resp = fn(iter([bytes.fromhex(hexreq)]), timeout=20)
                out.append([method, "OK", len(resp)])
            except grpc.RpcError as exc:
                out.append([method, exc.code().name, 0])
    print(json.dumps(out), flush=True)


def squat(port: int) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(16)
    print("bound", flush=True)
    conns: list[socket.socket] = []
    total = 0
    while True:
        ready, _, _ = select.select([srv, sys.stdin, *conns], [], [], 1.0)
        if sys.stdin in ready and not sys.stdin.readline():
            break
        if srv in ready:
            conns.append(srv.accept()[0])
        for c in [c for c in conns if c in ready]:
            data = c.recv(65536)
            total += len(data)
            if not data:
                conns.remove(c)
                c.close()
    print(total, flush=True)


def flip(link: str, good: str, evil: str) -> None:
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    tmp = link + ".new"
    print("flipping", flush=True)
    while not stop.is_set():
        for to in (good, evil):
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            os.symlink(to, tmp)
            os.rename(tmp, link)


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "call":
        call(args[0], args[1])
    elif cmd == "squat":
        squat(int(args[0]))
    elif cmd == "flip":
        flip(*args)
    elif cmd == "mkdir":
        os.mkdir(args[0], 0o777)
        os.chmod(args[0], 0o777)
        print("made", flush=True)
