"""A connection flood as a process of its own: ``python -m tests.faults.flooder KIND ADDRESS
COUNT MODE [renew]`` opens COUNT connections (KIND ``tcp``: ADDRESS ``host:port``; ``unix``: a
socket path), each sending per MODE (``raw``: nothing; ``preface``: the HTTP/2 preface and an
empty SETTINGS frame; ``http``: half an HTTP request line), prints ``ready N`` once it has tried
them all, then holds them until it is killed; with ``renew`` it also replaces those the daemon
closes (at most COUNT a second)."""

from __future__ import annotations

import selectors
import socket
import sys
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
MAX_FAILURES = 20  # connections in a row that fail to open: the flood has what it can get
SENDS = {"raw": b"", "preface": PREFACE, "http": b"GET /metr"}


def _open(kind: str, address: str, payload: bytes) -> socket.socket | None:
    if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: object = address
    else:
        host, port = address.rsplit(":", 1)
        sock, target = socket.socket(), (host, int(port))
    sock.settimeout(0.5)
    try:
        sock.connect(target)
        if payload:
            sock.sendall(payload)
    except OSError:
        sock.close()
        return None
    sock.setblocking(False)
    return sock


def main(kind: str, address: str, count: int, mode: str, renew: bool) -> None:
    payload = SENDS[mode]
    selector = selectors.DefaultSelector()
    failures = 0
    for _ in range(count):
        if (sock := _open(kind, address, payload)) is not None:
            selector.register(sock, selectors.EVENT_READ)
            failures = 0
        elif (failures := failures + 1) == MAX_FAILURES:  # the daemon takes no more
            break
    print(f"ready {len(selector.get_map())}", flush=True)
    while True:
        for key, _ in selector.select(0.05):
            sock = key.fileobj
            try:
                if sock.recv(65536):  # a SETTINGS frame or an error page: keep holding it
                    continue
            except BlockingIOError:
                continue
            except OSError:
                pass
            selector.unregister(sock)
            sock.close()
        missing = count - len(selector.get_map()) if renew else 0
        for _ in range(min(missing, max(1, count // 20))):
            if (sock := _open(kind, address, payload)) is not None:
                selector.register(sock, selectors.EVENT_READ)
        if missing:
            time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:] == ["renew"])
