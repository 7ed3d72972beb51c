"""A real Redis Sentinel deployment for tests: a primary, one replica and three ``redis-sentinel``
processes on free loopback ports, each with a config file of its own in a temporary folder.

Failure detection is made fast (1 s down-after) so a SIGKILLed primary is replaced within seconds;
everything else is Redis's defaults. ``close()`` (or leaving the context) stops every process."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tailcut.processes import Child, RedisServer, free_port, private_redis, start_child, stop_child
from tailcut.settings import DEFAULT_SENTINEL_MASTER, RedisEndpoint

QUORUM = 2
# A new replica's first sync streams the data set at once (no RDB file, no delay).
SERVER_OPTIONS = ("--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0")
DOWN_AFTER_MS = 1000
# Also how soon the Sentinels may fail the same master name over again (twice this).
FAILOVER_TIMEOUT_MS = 3000
# How long a wait for the primary may take. With a replica linked, after a failover, that includes the
# former primary (demoted, or killed and started again) turning replica: the Sentinels convert a server
# that still says "master" once it has been up 8 s and they saw its role (INFO, every 10 s for a
# replica), then it syncs — 10-30 s on a busy machine.
PRIMARY_WAIT_S = 60.0


@dataclass
class SentinelGroup:
    servers: dict[int, RedisServer]  # by port: the primary and the replica at the start
    sentinel_ports: list[int]
    _stack: contextlib.ExitStack
    sentinels: list[Child] = field(default_factory=list)
    master: str = DEFAULT_SENTINEL_MASTER

    @property
    def endpoint(self) -> RedisEndpoint:
        return RedisEndpoint(
            "redis://127.0.0.1/0", sentinels=tuple(("127.0.0.1", port) for port in self.sentinel_ports)
        )

    @property
    def env(self) -> dict[str, str]:
        """What a tailcut process needs in its environment to reach Redis through these Sentinels."""
        return {
            "TAILCUT_REDIS_URL": "redis://127.0.0.1/0",
            "TAILCUT_REDIS_SENTINELS": ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports),
            "TAILCUT_REDIS_SENTINEL_MASTER": self.master,
        }

    def sentinel_client(self, index: int = 0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.sentinel_ports[index], socket_timeout=2, decode_responses=True)

    def primary_port(self) -> int | None:
        """The primary's port as the first answering Sentinel reports it (None: none known, or down)."""
        for index in range(len(self.sentinel_ports)):
            with contextlib.suppress(redis.RedisError):
                state = self.sentinel_client(index).sentinel_master(self.master)
                if state["is_master"] and not (state["is_sdown"] or state["is_odown"]):
                    return int(state["port"])
                return None
        return None

    def wait_for_primary(
        self, *, other_than: int | None = None, replicated: bool = True, timeout_s: float = PRIMARY_WAIT_S
    ) -> int:
        """Wait until the Sentinels report a primary (another than ``other_than``) that answers as one,
        with a replica linked to it if ``replicated``; returns its port."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            port = self.primary_port()
            if port is not None and port != other_than and self._is_primary(port, replicated=replicated):
                return port
            time.sleep(0.1)
        raise AssertionError(f"no primary {'other than ' + str(other_than) if other_than else ''} after {timeout_s} s")

    async def primary(
        self, *, other_than: int | None = None, replicated: bool = True, timeout_s: float = PRIMARY_WAIT_S
    ) -> int:
        """``wait_for_primary`` in a thread: the event loop (an API, workers, arq) goes on meanwhile."""
        return await asyncio.to_thread(
            self.wait_for_primary, other_than=other_than, replicated=replicated, timeout_s=timeout_s
        )

    def _is_primary(self, port: int, *, replicated: bool) -> bool:
        with contextlib.suppress(redis.RedisError):
            info = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2).info("replication")
            return info.get("role") == "master" and (not replicated or int(info.get("connected_slaves", 0)) >= 1)
        return False

    def failover(self) -> None:
        """``SENTINEL FAILOVER``: a replica is promoted at once, without waiting for a failure."""
        self.sentinel_client().execute_command("SENTINEL", "FAILOVER", self.master)

    def kill(self, port: int) -> None:
        """SIGKILL the Redis server on ``port`` (no goodbye to its replica or its clients)."""
        self.servers[port].kill()

    def restart(self, port: int, *, replica_of: int) -> None:
        """Start a killed server again on its port, empty, as a replica of the primary on ``replica_of``
        — as a supervisor that asks the Sentinels for the primary first would. (Left to say "master",
        it would wait for the Sentinels to convert it: 8 s up, then their next INFO, and nothing at
        all while a Sentinel on a starved machine is in TILT mode — over 60 s in one CI run.)"""
        assert self.servers[port].process.poll() is not None, f"the server on {port} is running"
        replica = ("--replicaof", "127.0.0.1", str(replica_of))
        self.servers[port] = self._stack.enter_context(private_redis(port, *SERVER_OPTIONS, *replica))


@contextlib.contextmanager
def sentinel_group(*, replica_extra: tuple[str, ...] = ()) -> Iterator[SentinelGroup]:
    """A primary, a replica and three Sentinels; yields once the Sentinels know them all."""
    binary = shutil.which("redis-sentinel")
    if binary is None:
        raise RuntimeError("redis-sentinel is not installed (Debian: apt-get install redis-sentinel)")
    common = SERVER_OPTIONS
    with contextlib.ExitStack() as stack:
        primary = stack.enter_context(private_redis(None, *common))
        primary_port = int(primary.url.rsplit(":", 1)[1].split("/")[0])
        replica = stack.enter_context(
            private_redis(None, *common, "--replicaof", "127.0.0.1", str(primary_port), *replica_extra)
        )
        replica_port = int(replica.url.rsplit(":", 1)[1].split("/")[0])
        group = SentinelGroup({primary_port: primary, replica_port: replica}, [free_port() for _ in range(3)], stack)
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tailcut-sentinel-")))
        for port in group.sentinel_ports:
            config = folder / f"sentinel-{port}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
                f"sentinel monitor {group.master} 127.0.0.1 {primary_port} {QUORUM}\n"
                f"sentinel down-after-milliseconds {group.master} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {group.master} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {group.master} 1\n"
            )
            child = start_child("sentinel", [binary, str(config)], stdout=subprocess.DEVNULL)
            group.sentinels.append(child)
            stack.callback(stop_child, child, timeout_s=10)
        deadline = time.monotonic() + 30
        while not _all_known(group):
            if time.monotonic() > deadline:
                raise AssertionError("the Sentinels did not find each other and the replica within 30 s")
            time.sleep(0.1)
        yield group


def _all_known(group: SentinelGroup) -> bool:
    """Every Sentinel sees the primary, the replica and the two other Sentinels."""
    for index in range(len(group.sentinel_ports)):
        try:
            state = group.sentinel_client(index).sentinel_master(group.master)
        except redis.RedisError:
            return False
        if int(state.get("num-slaves", 0)) < 1 or int(state.get("num-other-sentinels", 0)) < 2:
            return False
    return group.wait_for_primary(timeout_s=5) is not None
