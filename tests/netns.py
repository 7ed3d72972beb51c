"""Hosts for tests: Linux network namespaces, each joined to the root namespace by a veth pair of its own.

A ``Host`` is a namespace with ``lo`` up and one veth link: ``host_ip`` on the root side, ``ns_ip`` inside,
on a private /24 that no interface or route of the machine uses. From inside, only the namespace's own
loopback and ``host_ip`` can be reached (there is no default route). ``hosts()`` makes them and, however
the test ends, kills what runs in them and deletes every namespace and link it made.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

from api.metrics import pid_alive

SUBNETS = ipaddress.IPv4Network("10.231.0.0/16")  # each host gets one /24 of it
# A host's namespace and root-side link are named after the test process and the host's label.
NAMESPACE_NAME = re.compile(r"tc-(\d+)-([a-z])")
LINK_NAME = re.compile(r"tc(\d+)([a-z])")


class NamespacesRefused(Exception):
    """``ip netns add`` was refused (not root, no CAP_SYS_ADMIN): the tests that need hosts skip."""


@dataclass(frozen=True)
class Host:
    name: str  # the namespace
    link: str  # the veth end in the root namespace; its peer, inside, is ``link`` + "n"
    host_ip: str  # the root side's address: what processes inside reach
    ns_ip: str

    def exec_argv(self, *argv: str) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec`` execs it: the pid is the command's own)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def pids(self) -> set[int]:
        """Every process inside the namespace."""
        found = ip("netns", "pids", self.name, check=False)
        return {int(pid) for pid in found.stdout.split()} if found.returncode == 0 else set()

    def cut_network(self) -> None:
        """Delete the veth pair: the namespace has no network but its loopback any more."""
        ip("link", "del", self.link, check=False)

    def kill_all(self) -> None:
        """SIGKILL every process inside the namespace."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def delete(self) -> None:
        """Network gone, processes killed, namespace deleted; safe to repeat."""
        self.cut_network()
        self.kill_all()
        ip("netns", "del", self.name, check=False)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def namespaces() -> set[str]:
    return {line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()}


def links() -> set[str]:
    return {link["ifname"] for link in json.loads(ip("-j", "link", "show").stdout)}


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network an address or a route of the root namespace covers (the default route aside)."""
    used: list[ipaddress.IPv4Network] = []
    for link in json.loads(ip("-j", "-4", "addr", "show").stdout):
        for address in link.get("addr_info", []):
            used.append(ipaddress.IPv4Network(f"{address['local']}/{address['prefixlen']}", strict=False))
    for route in json.loads(ip("-j", "-4", "route", "show", "table", "all").stdout):
        destination = route.get("dst", "default")
        if destination != "default":
            with contextlib.suppress(ValueError):
                used.append(ipaddress.IPv4Network(destination, strict=False))
    return used


def free_subnets(count: int, start: int) -> list[ipaddress.IPv4Network]:
    """``count`` /24s of ``SUBNETS`` that no address or route overlaps, looking from the ``start``-th on."""
    used = _networks_in_use()
    candidates: list[ipaddress.IPv4Network] = list(SUBNETS.subnets(new_prefix=24))
    found: list[ipaddress.IPv4Network] = []
    for offset in range(len(candidates)):
        subnet = candidates[(start + offset) % len(candidates)]
        if not any(subnet.overlaps(network) for network in used):
            found.append(subnet)
            if len(found) == count:
                return found
    raise RuntimeError(f"no {count} free /24s in {SUBNETS}")


def _make(host: Host, prefixlen: int) -> None:
    peer = host.link + "n"
    ip("link", "add", host.link, "type", "veth", "peer", "name", peer)
    ip("link", "set", peer, "netns", host.name)
    ip("addr", "add", f"{host.host_ip}/{prefixlen}", "dev", host.link)
    ip("link", "set", host.link, "up")
    ip("-n", host.name, "addr", "add", f"{host.ns_ip}/{prefixlen}", "dev", peer)
    ip("-n", host.name, "link", "set", peer, "up")
    ip("-n", host.name, "link", "set", "lo", "up")  # vLLM's front end reaches its engine core over it


def sweep_stale() -> None:
    """Delete what a run that was killed outright (SIGKILL: no ``finally``) left: the namespaces and links
    named after a process that is gone, with whatever still runs inside them."""
    for name in namespaces():
        found = NAMESPACE_NAME.fullmatch(name)
        if found and not pid_alive(int(found[1])):
            Host(name=name, link=f"tc{found[1]}{found[2]}", host_ip="", ns_ip="").delete()
    for link in links():
        found = LINK_NAME.fullmatch(link)
        if found and not pid_alive(int(found[1])):
            ip("link", "del", link, check=False)


@contextlib.contextmanager
def hosts(*labels: str) -> Iterator[list[Host]]:
    """One ``Host`` per label (a short one: a letter), named after this process so runs never collide.
    Raises ``NamespacesRefused`` when the first ``ip netns add`` is refused."""
    pid = os.getpid()
    made: list[Host] = []
    try:
        sweep_stale()
        subnets = free_subnets(len(labels), start=pid % 200)
        for label, subnet in zip(labels, subnets, strict=True):
            host_ip, ns_ip = (str(address) for address in list(subnet.hosts())[:2])
            # Interface names are at most 15 characters: "tc" + a pid of up to 7 digits + label + "n".
            host = Host(name=f"tc-{pid}-{label}", link=f"tc{pid}{label}", host_ip=host_ip, ns_ip=ns_ip)
            added = ip("netns", "add", host.name, check=False)
            if added.returncode != 0:
                if not made:
                    raise NamespacesRefused(f"`ip netns add` was refused: {added.stderr.strip()}")
                raise RuntimeError(f"ip netns add {host.name} failed: {added.stderr.strip()}")
            made.append(host)
            _make(host, subnet.prefixlen)
        yield made
    finally:
        for host in made:
            host.delete()
