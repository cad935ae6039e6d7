"""A TCP proxy a test controls: in front of a server, it forwards every connection until cut(),
which drops the open connections and refuses new ones (as a network partition or a lost endpoint
would), until restore(). hold() keeps every connection open and accepts new ones but forwards
nothing either way (as a store stopped with SIGSTOP: the kernel still accepts), until restore().
when(marker, action) calls cut or hold as soon as a client sends `marker` (a request's path),
before that request goes on. slow_down(n) answers the next n requests itself with S3's "503 Slow
Down", as a busy bucket does."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable


class Proxy:
    def __init__(self, target_host: str, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.listener = socket.create_server((host, 0))
        self.host, self.port = host, self.listener.getsockname()[1]
        self.cut_off = threading.Event()
        self.held = threading.Event()
        self._trigger: tuple[bytes, Callable[[], None]] | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._to_slow_down = 0
        self.slowed_down = 0  # requests answered with 503 so far
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def cut(self) -> None:
        self.cut_off.set()
        self._drop()

    def _drop(self) -> None:
        with self._lock:
            for sock in self._open:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
            self._open.clear()

    def hold(self) -> None:
        self.held.set()

    def restore(self) -> None:
        if self.held.is_set():  # what was held is lost: the clients open new connections
            self._drop()
        self.cut_off.clear()
        self.held.clear()

    def when(self, marker: bytes, action: Callable[[], None]) -> None:
        self._trigger = (marker, action)

    def slow_down(self, requests: int) -> None:
        """Answer the next `requests` requests with 503 SlowDown (each on a connection of its
        own: the open ones are dropped, so that the client's next request opens a new one)."""
        with self._lock:
            self._to_slow_down = requests
        self.cut()
        self.restore()

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
            if self.held.is_set():  # accepted, read, never answered
                with self._lock:
                    self._open.add(client)
                threading.Thread(target=self._pipe, args=(client, None), daemon=True).start()
                continue
            with self._lock:
                slow = self._to_slow_down > 0
                self._to_slow_down -= slow
            if slow:
                threading.Thread(target=self._answer_slow_down, args=(client,), daemon=True).start()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, upstream))
            for a, b, from_client in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pipe, args=(a, b, from_client), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket | None,
              from_client: bool = True) -> None:
        try:
            while data := source.recv(65536):
                trigger = self._trigger
                if from_client and trigger is not None and trigger[0] in data:
                    self._trigger = None
                    trigger[1]()
                if sink is not None and not self.held.is_set() and not self.cut_off.is_set():
                    sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    if sock is not None:
                        sock.close()
                except OSError:
                    pass
            with self._lock:
                self._open.discard(source)
                if sink is not None:
                    self._open.discard(sink)

    def _answer_slow_down(self, client: socket.socket) -> None:
        """Read one request's head (a PUT waits for "100 Continue" before its body, and gets
        the 503 instead), answer 503 SlowDown as S3 words it, close."""
        body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                b"<Message>Please reduce your request rate.</Message></Error>")
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                data = client.recv(65536)
                if not data:
                    return
                head += data
            client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                           b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
            with self._lock:
                self.slowed_down += 1
        except OSError:
            pass
        finally:
            client.close()
