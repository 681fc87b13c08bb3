"""Leader election for active/standby schedulers: one small interface (Elector) and its Redis
implementation. The store holds only the leader key (with a TTL) and an epoch counter.

- Acquire: one Lua script sets the leader key NX with the TTL and INCRs the epoch, so every
  leadership has an epoch no earlier one had (fencing: workers refuse lower epochs).
- Renew every TTL/3, only while the key still names this holder (compare-and-pexpire).
- Another holder seen: step down at once. The store unreachable: lead on only until the TTL
  would have expired since the last successful renew (measured from before that renew was
  sent), then step down; `leading` checks that deadline itself, so a process paused past it
  (SIGSTOP, a stuck host) never acts as leader when it wakes, whatever its loop does.
- Release on a clean stop (compare-and-delete): a standby takes over at its next poll.

Store addresses (`parse_store_url`, the one validator):
  redis://[:password@]HOST:PORT[/DB]          a Redis server (rediss:// for TLS)
  redis+sentinel://[:password@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]
                                              Redis Sentinel: the master of SERVICE
The `redis` package (extra `ha`) is imported only by `connect` (RedisElector.start, and
`check_store`, which `omnifabric serve` runs before it starts anything).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: Keys in the store; the hash tag keeps both in one Redis Cluster slot (the scripts use both).
LEADER_KEY = "omnifabric:{scheduler}:leader"
EPOCH_KEY = "omnifabric:{scheduler}:epoch"
#: Default time to live of the leader key, seconds.
DEFAULT_TTL_S = 2.0
#: A standby polls the key at least this often (a released key is taken within it).
STANDBY_POLL_S = 0.2
#: Share of the TTL kept back from the local deadline: Redis expires keys on its own clock.
CLOCK_MARGIN = 0.02

# KEYS[1] leader, KEYS[2] epoch; ARGV[1] holder, ARGV[2] ttl ms, ARGV[3] the highest epoch
# the candidate has seen. -> {epoch, value}; epoch 0 when another holder has the key (value:
# its value). The floor keeps epochs growing across a store that lost its counter (a
# restart without persistence), as long as one scheduler lived through it.
_ACQUIRE = """
local current = redis.call('GET', KEYS[1])
if current then return {0, current} end
local epoch = redis.call('INCR', KEYS[2])
if epoch <= tonumber(ARGV[3]) then
  epoch = tonumber(ARGV[3]) + 1
  redis.call('SET', KEYS[2], epoch)
end
local value = epoch .. ' ' .. ARGV[1]
redis.call('SET', KEYS[1], value, 'NX', 'PX', ARGV[2])
return {epoch, value}
"""
# KEYS[1] leader; ARGV[1] value, ARGV[2] ttl ms. -> {1, value} renewed, {0, current or ''}.
_RENEW = """
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, current}
end
return {0, current or ''}
"""
# KEYS[1] leader; ARGV[1] value. -> 1 deleted, 0 not ours.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class StoreUrlError(ValueError):
    """A malformed election store address; the message names what is wrong."""


@dataclass(frozen=True)
class StoreAddress:
    """Where the leader key lives: one Redis server, or the master Sentinels name."""

    scheme: str
    hosts: tuple[tuple[str, int], ...]
    db: int = 0
    password: str | None = None
    username: str | None = None
    service: str = ""
    """The Sentinel service (master) name; "" for a plain server."""

    @property
    def sentinel(self) -> bool:
        return bool(self.service)

    def describe(self) -> str:
        """The address for logs, without the password."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.hosts)
        tail = f"/{self.service}/{self.db}" if self.sentinel else f"/{self.db}"
        return f"{self.scheme}://{hosts}{tail}"


def parse_store_url(url: str) -> StoreAddress:
    """The store address of `url` (see the module docstring); StoreUrlError naming the fault."""
    parts = urllib.parse.urlsplit(url.strip())
    schemes = ("redis", "rediss", "redis+sentinel")
    if parts.scheme not in schemes:
        raise StoreUrlError(f"must start with {', '.join(s + '://' for s in schemes)}, got {url!r}")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    if not hostlist:
        raise StoreUrlError(f"names no host: {url!r} (e.g. redis://127.0.0.1:6379/0)")
    hosts = tuple(_host_port(item, url) for item in hostlist.split(","))
    path = [p for p in parts.path.split("/") if p]
    service = ""
    if parts.scheme == "redis+sentinel":
        if not path:
            raise StoreUrlError(
                f"a Sentinel address names the service after the hosts: "
                f"redis+sentinel://HOST:PORT[,HOST:PORT]/SERVICE[/DB], got {url!r}"
            )
        service, path = path[0], path[1:]
    elif len(hosts) > 1:
        raise StoreUrlError(f"names several hosts; use redis+sentinel:// for that: {url!r}")
    if len(path) > 1:
        raise StoreUrlError(f"has a path past the database number: {url!r}")
    db = 0
    if path:
        if not path[0].isdigit():
            raise StoreUrlError(f"database must be a number, got {path[0]!r} in {url!r}")
        db = int(path[0])
    return StoreAddress(
        scheme=parts.scheme,
        hosts=hosts,
        db=db,
        password=urllib.parse.unquote(password) if password else None,
        username=urllib.parse.unquote(username) if username else None,
        service=service,
    )


def _host_port(item: str, url: str) -> tuple[str, int]:
    host, sep, port = item.rpartition(":")
    if not sep:
        host, port = item, "6379"
    host = host.strip("[]")
    if not host:
        raise StoreUrlError(f"has an empty host in {url!r}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise StoreUrlError(f"port must be 1..65535, got {port!r} in {url!r}")
    return host, int(port)


@dataclass(frozen=True)
class Term:
    """One leadership as the store holds it: its epoch and holder."""

    epoch: int
    holder: str

    @staticmethod
    def parse(value: str | bytes) -> Term | None:
        """The term of a leader key's value ("EPOCH HOLDER"); None when empty or foreign."""
        text = value.decode() if isinstance(value, bytes) else value
        epoch, _, holder = text.partition(" ")
        return Term(int(epoch), holder) if epoch.isdigit() else None

    @property
    def value(self) -> str:
        return f"{self.epoch} {self.holder}"


#: Called when this process starts or stops leading, and when a standby sees a new leader:
#: (leading, the term now known or None).
Listener = Callable[[bool, "Term | None"], None]


class Elector(abc.ABC):
    """Campaigns for the leader role until stopped; tells listeners when it leads and when it
    stops leading. Event-loop only."""

    def __init__(self, holder: str, ttl_s: float) -> None:
        self.holder = holder
        """This candidate's name in the store (unique per process: address and a nonce)."""
        self.ttl_s = ttl_s
        self.term: Term | None = None
        """This process's term while it leads (or led last)."""
        self.seen: Term | None = None
        """The latest term read from the store (any holder)."""
        self.listeners: list[Listener] = []
        self._valid_until = 0.0
        self._leading = False
        self._deadline: asyncio.TimerHandle | None = None

    @property
    def leading(self) -> bool:
        """True while this process holds a term the store cannot have expired yet."""
        return self._leading and time.monotonic() < self._valid_until

    @property
    def epoch(self) -> int:
        """The epoch of this process's term (0 before it first led)."""
        return self.term.epoch if self.term else 0

    @property
    def highest_epoch(self) -> int:
        """The highest epoch this process has seen (its own terms, and others')."""
        return max(self.epoch, self.seen.epoch if self.seen else 0)

    def store_problem(self) -> str:
        """Why the election store cannot be used now ("" while it can), for refusals."""
        return ""

    def _won(self, term: Term, sent_at: float) -> None:
        self.term = self.seen = term
        self._extend(sent_at)
        self._leading = True
        log.info("leading with epoch %d", term.epoch)
        self._tell(True, term)

    def _extend(self, sent_at: float) -> None:
        """The key was (re)set by a command sent at `sent_at`: lead until its TTL from then."""
        self._valid_until = sent_at + self.ttl_s * (1 - CLOCK_MARGIN)
        if self._deadline is not None:
            self._deadline.cancel()
        delay = max(0.0, self._valid_until - time.monotonic())
        self._deadline = asyncio.get_running_loop().call_later(delay, self._expired)

    def _expired(self) -> None:
        self._deadline = None
        if self._leading and time.monotonic() >= self._valid_until:
            self._step_down("the leader key could not be renewed within its TTL")

    def _step_down(self, why: str, tell: bool = True) -> None:
        """Stop leading at once (`leading` is False from here) and, with `tell`, tell the
        listeners."""
        if not self._leading:
            return
        self._leading = False
        self._valid_until = 0.0
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        log.warning("stepping down (epoch %d): %s", self.epoch, why)
        if tell:
            self._tell(False, self.seen)

    def _tell(self, leading: bool, term: Term | None) -> None:
        for listener in list(self.listeners):
            try:
                listener(leading, term)
            except Exception:
                log.exception("leadership listener failed")

    @abc.abstractmethod
    async def start(self) -> None:
        """Connect and begin campaigning (returns at once; raises nothing for an
        unreachable store: it is retried)."""

    @abc.abstractmethod
    async def stop(self, release: bool = True) -> None:
        """Stop campaigning; step down, releasing the key when `release` and still held."""


def connect(address: StoreAddress, timeout_s: float, *, retry: bool = True) -> Any:
    """An asyncio Redis client of `address` (Sentinel: of the master it names) whose connects
    and commands each give up after `timeout_s`; `retry` False: a failed one is not tried
    again (the redis package's default retries thrice, backing off). ImportError without
    the redis package."""
    # Imported here: a scheduler without --ha never imports redis.
    try:
        from redis import asyncio as redis_asyncio
        from redis.asyncio.retry import Retry
        from redis.asyncio.sentinel import Sentinel
        from redis.backoff import NoBackoff
    except ImportError:
        raise ImportError("--ha needs the redis package: pip install 'omnifabric[ha]'") from None

    a = address
    once = {} if retry else {"retry": Retry(NoBackoff(), 0)}
    common: dict[str, Any] = dict(
        db=a.db,
        password=a.password,
        username=a.username,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        **once,
    )
    if a.sentinel:
        sentinels: dict[str, Any] = dict(
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **once
        )
        if a.password:
            sentinels["password"] = a.password
        sentinel = Sentinel(list(a.hosts), sentinel_kwargs=sentinels)
        return sentinel.master_for(a.service, **common)
    host, port = a.hosts[0]
    return redis_asyncio.Redis(host=host, port=port, ssl=a.scheme == "rediss", **common)


async def check_store(address: StoreAddress, timeout_s: float = 2.0) -> None:
    """PING the store as an elector would reach it (Sentinel: the master the sentinels name);
    OSError naming the address and what failed when it does not answer (ImportError without
    the redis package). For `omnifabric serve`, which starts no Redis itself."""
    client = connect(address, timeout_s, retry=False)
    try:
        await client.ping()
    except Exception as exc:
        detail = f"{type(exc).__name__}: {exc}"
        if type(exc).__name__ == "MasterNotFoundError":  # its text is the client's repr
            detail = f"no sentinel answered with the master of {address.service!r}"
        raise OSError(
            f"the election store {address.describe()} cannot be reached ({detail})"
        ) from None
    finally:
        await client.aclose()


class RedisElector(Elector):
    """The leader key in Redis (or the master named by Sentinels)."""

    def __init__(
        self,
        address: StoreAddress,
        holder: str,
        ttl_s: float = DEFAULT_TTL_S,
        *,
        leader_key: str = LEADER_KEY,
        epoch_key: str = EPOCH_KEY,
    ) -> None:
        super().__init__(holder, ttl_s)
        self.address = address
        self._keys = (leader_key, epoch_key)
        self._client: Any = None
        self._task: asyncio.Task[None] | None = None
        self._scripts: dict[str, Any] = {}
        self._store_error = ""

    async def start(self) -> None:
        # Every command gets at most a third of the TTL, tried once (the campaign loop tries
        # again at its next step): a hung or gone store never holds the loop past the point
        # where leadership must be given up, and its failure is known at once.
        self._client = connect(self.address, self.ttl_s / 3, retry=False)
        for name, body in (("acquire", _ACQUIRE), ("renew", _RENEW), ("release", _RELEASE)):
            self._scripts[name] = self._client.register_script(body)
        self._task = asyncio.create_task(self._campaign(), name="election")

    async def stop(self, release: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        held = self.leading
        unheard = self._leading  # the listeners still take this process for the leader
        # Granting stops at once, but the listeners (which end every stream of this
        # leadership: thousands of them, a busy loop) hear it only after the key is
        # released: the standby takes over that much sooner.
        self._step_down("stopping", tell=False)
        if release and held and self.term is not None and self._client is not None:
            try:
                async with asyncio.timeout(self.ttl_s / 3):
                    released = await self._scripts["release"](
                        keys=[self._keys[0]], args=[self.term.value]
                    )
                log.info("leader key %s", "released" if released else "was no longer ours")
            except Exception as exc:
                log.warning("could not release the leader key (it expires by itself): %r", exc)
        if unheard:
            self._tell(False, self.seen)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _campaign(self) -> None:
        while True:
            try:
                if self._leading:
                    await self._renew()
                else:
                    await self._try_acquire()
                if self._store_error:
                    log.info("election store %s reachable again", self.address.describe())
                    self._store_error = ""
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._unreachable(exc)
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # stop() cancelled a command in flight and the redis client swallowed the
                # cancellation (it returned, or failed otherwise): end as cancelled, or
                # stop() would wait for this loop forever.
                raise asyncio.CancelledError()
            # Renew at a third of the TTL; a standby polls more often, so that a released key
            # is taken within STANDBY_POLL_S.
            pause = self.ttl_s / 3 if self._leading else min(self.ttl_s / 3, STANDBY_POLL_S)
            await asyncio.sleep(pause)

    async def _try_acquire(self) -> None:
        sent = time.monotonic()
        epoch, value = await self._scripts["acquire"](
            keys=list(self._keys),
            args=[self.holder, int(self.ttl_s * 1000), self.highest_epoch],
        )
        term = Term.parse(value)
        if int(epoch) > 0 and term is not None:
            self._won(term, sent)
        elif term != self.seen:
            self.seen = term
            if term is not None:
                log.info("standby: epoch %d is led by %s", term.epoch, term.holder)
            self._tell(False, term)

    async def _renew(self) -> None:
        assert self.term is not None
        sent = time.monotonic()
        renewed, value = await self._scripts["renew"](
            keys=[self._keys[0]], args=[self.term.value, int(self.ttl_s * 1000)]
        )
        if int(renewed):
            self._extend(sent)
            return
        self.seen = Term.parse(value) if value else None
        other = f"epoch {self.seen.epoch} held by {self.seen.holder}" if self.seen else "no one"
        self._step_down(f"the leader key now names {other}")

    def store_problem(self) -> str:
        if not self._store_error:
            return ""
        return f"the election store {self.address.describe()} cannot be reached"

    def _unreachable(self, exc: Exception) -> None:
        detail = f"{type(exc).__name__}: {exc}"
        if detail != self._store_error:
            left = max(0.0, self._valid_until - time.monotonic()) if self._leading else 0.0
            log.warning(
                "election store %s unreachable (%s)%s",
                self.address.describe(),
                detail,
                f"; leading for at most {left:.1f} s more" if self._leading else "",
            )
            self._store_error = detail
        # The deadline timer steps down when the TTL runs out; nothing else to do here.
