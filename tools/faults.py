"""Fault injection for tests and operators: a TCP proxy that delays, cuts or blackholes
the traffic between two services, and signals to kill, stop and continue processes.

In a test (same event loop):

    proxy = FaultProxy("127.0.0.1:50051")
    address = await proxy.start()          # 127.0.0.1:PORT; point a client at it
    proxy.set_delay(0.1); proxy.cut(); proxy.blackhole(); await proxy.restore()

From a shell, commands on stdin (one a line: `delay SECONDS`, `cut`, `blackhole`,
`restore`, `status`, `quit`), each answered with one `ok ...` or `error ...` line:

    python -m omnifabric.tools.faults proxy --listen 127.0.0.1:6000 --target 127.0.0.1:50051
    python -m omnifabric.tools.faults kill|stop|cont PID
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from dataclasses import dataclass

#: Bytes read from a socket at a time.
CHUNK = 64 * 1024
#: Chunks held per direction (delayed or blackholed) before reading stops: backpressure.
MAX_HELD_CHUNKS = 256


def split_address(address: str) -> tuple[str, int]:
    """ "host:port" as (host, port); ValueError when it is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not a host:port address: {address!r}")
    return host.strip("[]"), int(port)


@dataclass(eq=False)
class _Link:
    """One proxied connection: the client's socket and ours to the target."""

    client: asyncio.StreamWriter
    target: asyncio.StreamWriter | None = None

    def abort(self) -> None:
        """Drop both sockets at once (RST, no FIN): what a cut network looks like. The
        pumps then see end of input or a reset and finish."""
        for writer in (self.client, self.target):
            if writer is not None:
                writer.transport.abort()


class FaultProxy:
    """A TCP proxy from `listen` to `target` whose traffic can be delayed, cut or held.

    - set_delay(s): every chunk arrives s seconds later, each way (order kept).
    - cut(): existing connections are reset, new ones refused (the port stops listening).
    - blackhole(): connections stay open but nothing is forwarded, new ones are accepted
      and held: a hung network. Held data is delivered on restore(), as TCP would after
      a partition heals.
    - restore(): back to normal (listening again on the same port after a cut).
    """

    def __init__(self, target: str, listen: str = "127.0.0.1:0") -> None:
        self.target = split_address(target)
        self._listen = split_address(listen)
        self.delay_s = 0.0
        self.state = "open"
        """open, cut or blackhole."""
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self.connections = 0
        """Connections accepted so far."""

    @property
    def address(self) -> str:
        """host:port clients should dial (valid after start())."""
        return f"{self._listen[0]}:{self._listen[1]}"

    async def start(self) -> str:
        """Listen; returns the address (the port is fixed from here on, also across cuts)."""
        self._server = await asyncio.start_server(self._accept, *self._listen)
        self._listen = (self._listen[0], self._server.sockets[0].getsockname()[1])
        return self.address

    def set_delay(self, seconds: float) -> None:
        """Added latency per direction for data read from now on, seconds."""
        if not 0 <= seconds <= 3600:
            raise ValueError(f"delay must be in 0..3600 s, got {seconds}")
        self.delay_s = float(seconds)

    def cut(self) -> None:
        """Reset every connection and stop listening (new connections are refused)."""
        self.state = "cut"
        self._flowing.set()  # held pumps wake up and find their sockets gone
        if self._server is not None:
            self._server.close()
            self._server = None
        for link in list(self._links):
            link.abort()
        self._links.clear()

    def blackhole(self) -> None:
        """Keep connections open but forward nothing; accept new ones and hold them."""
        self.state = "blackhole"
        self._flowing.clear()

    async def restore(self) -> None:
        """Forward again; listen again on the same port when cut."""
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, *self._listen)
        self.state = "open"
        self._flowing.set()

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        self.cut()
        self.state = "closed"

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- data path --------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.state == "cut":  # accepted in the instant before the listener closed
            writer.transport.abort()
            return
        self.connections += 1
        link = _Link(writer)
        self._links.add(link)
        try:
            await self._flowing.wait()  # a blackholed connect waits here, like a lost SYN-ACK
            if self.state != "open":
                return
            try:
                target_reader, link.target = await asyncio.open_connection(*self.target)
            except OSError:
                return  # target down: the client sees its connection close
            await asyncio.gather(
                self._pump(link, reader, link.target), self._pump(link, target_reader, writer)
            )
        finally:
            self._links.discard(link)
            link.abort()

    async def _pump(
        self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Copy one direction: read, hold for the delay, wait while blackholed, write.
        A failure on either side drops the whole link."""
        loop = asyncio.get_running_loop()
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(MAX_HELD_CHUNKS)
        sender = asyncio.create_task(self._send(held, writer))
        try:
            while data := await reader.read(CHUNK):
                if sender.done():
                    break
                await held.put((loop.time() + self.delay_s, data))
            else:
                await held.put((loop.time() + self.delay_s, b""))  # end of input, in order
                await sender
        except (ConnectionError, OSError):
            pass
        finally:
            if not sender.done() or sender.cancelled() or sender.exception() is not None:
                link.abort()
            sender.cancel()

    async def _send(
        self, held: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await held.get()
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            await self._flowing.wait()
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()


# ---- processes ------------------------------------------------------------------------


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send `sig` (default SIGKILL) to a process; ProcessLookupError when it is gone."""
    os.kill(pid, sig)


def stop(pid: int) -> None:
    """Freeze a process (SIGSTOP): alive, its sockets open, answering nothing."""
    os.kill(pid, signal.SIGSTOP)


def resume(pid: int) -> None:
    """Let a stopped process run again (SIGCONT)."""
    os.kill(pid, signal.SIGCONT)


# ---- command line -----------------------------------------------------------------------


async def _control(proxy: FaultProxy) -> None:
    """Apply stdin commands until `quit` or end of input."""
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:
            return
        words = line.split()
        if not words:
            continue
        command = words[0].lower()
        try:
            if command == "delay" and len(words) == 2:
                proxy.set_delay(float(words[1]))
            elif command == "cut":
                proxy.cut()
            elif command == "blackhole":
                proxy.blackhole()
            elif command == "restore":
                await proxy.restore()
            elif command == "quit":
                return
            elif command != "status":
                raise ValueError("commands: delay SECONDS, cut, blackhole, restore, status, quit")
        except ValueError as exc:
            print(f"error {exc}", flush=True)
            continue
        print(
            f"ok state={proxy.state} delay={proxy.delay_s:g} connections={proxy.connections}",
            flush=True,
        )


async def _serve_proxy(listen: str, target: str) -> None:
    proxy = FaultProxy(target, listen)
    address = await proxy.start()
    print(f"faults proxy ready: {address} -> {target}", flush=True)
    try:
        await _control(proxy)
    finally:
        await proxy.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m omnifabric.tools.faults proxy|kill|stop|cont ...`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m omnifabric.tools.faults", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    proxy = sub.add_parser("proxy", help="a TCP proxy driven by commands on stdin")
    proxy.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0 = any)")
    proxy.add_argument("--target", required=True, help="HOST:PORT to forward to")
    for name, text in (("kill", "SIGKILL"), ("stop", "SIGSTOP"), ("cont", "SIGCONT")):
        sub.add_parser(name, help=f"send {text} to a process").add_argument("pid", type=int)
    args = parser.parse_args(argv)
    if args.command == "proxy":
        try:
            split_address(args.listen), split_address(args.target)
        except ValueError as exc:
            parser.error(str(exc))
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve_proxy(args.listen, args.target))
        return 0
    action = {"kill": kill, "stop": stop, "cont": resume}[args.command]
    try:
        action(args.pid)
    except ProcessLookupError:
        print(f"no process {args.pid}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
