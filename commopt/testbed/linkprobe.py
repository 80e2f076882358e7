"""Push bytes through one TCP connection and time them (run by path inside a namespace).

    receiver:  python linkprobe.py recv ADDR PORT          -> prints {"bytes": .., "seconds": ..}
    sender:    python linkprobe.py send ADDR PORT NBYTES

Standalone on purpose (standard library only, no commopt import), so it starts fast and runs
under any interpreter inside ``ip netns exec``. The receiver times from the first byte to the
end of the stream: connection set-up is not part of a link's rate.
"""

import json
import socket
import sys
import time

CHUNK = 1 << 20


def receive(addr: str, port: int) -> None:
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((addr, port))
        srv.listen(1)
        srv.settimeout(30)
        conn, _ = srv.accept()
        with conn:
            buf = bytearray(CHUNK)
            got, first = 0, None
            while True:
                n = conn.recv_into(buf)
                if not n:
                    break
                if first is None:
                    first = time.perf_counter()
                got += n
            seconds = time.perf_counter() - (first or time.perf_counter())
            conn.sendall(b"k")  # tell the sender the receiver has everything
    print(json.dumps({"bytes": got, "seconds": seconds}), flush=True)


def send(addr: str, port: int, nbytes: int) -> None:
    deadline = time.monotonic() + 10
    while True:  # the receiver may not be listening yet
        try:
            conn = socket.create_connection((addr, port), timeout=30)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    with conn:
        data = b"\0" * CHUNK
        sent = 0
        while sent < nbytes:
            piece = data[: min(CHUNK, nbytes - sent)]
            conn.sendall(piece)
            sent += len(piece)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)


if __name__ == "__main__":
    mode, address, port_text = sys.argv[1:4]
    if mode == "recv":
        receive(address, int(port_text))
    else:
        send(address, int(port_text), int(sys.argv[4]))
