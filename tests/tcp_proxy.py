"""A TCP proxy a test controls: in front of a server, it forwards every connection until cut(),
which drops the open connections and refuses new ones (as a network partition or a lost endpoint
would), until restore()."""

from __future__ import annotations

import socket
import threading


class Proxy:
    def __init__(self, target_host: str, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.listener = socket.create_server((host, 0))
        self.host, self.port = host, self.listener.getsockname()[1]
        self.cut_off = threading.Event()
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def cut(self) -> None:
        self.cut_off.set()
        with self._lock:
            for sock in self._open:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
            self._open.clear()

    def restore(self) -> None:
        self.cut_off.clear()

    def close(self) -> None:
        self.cut()
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut_off.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.close()
                except OSError:
                    pass
            with self._lock:
                self._open.discard(source)
                self._open.discard(sink)
