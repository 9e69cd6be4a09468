"""``etcd://`` URLs: the cluster's endpoints, the credentials, the job and the lease length."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from ..errors import RendezvousError

DEFAULT_PORT = 2379
DEFAULT_LEASE = 3  # seconds; etcd leases are whole seconds


@dataclass(frozen=True)
class Endpoints:
    """Where the cluster is and who we are to it."""

    hosts: tuple[tuple[str, int], ...]
    user: str | None = None
    password: str | None = None

    def url(self, i: int) -> str:
        host, port = self.hosts[i % len(self.hosts)]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def __str__(self) -> str:
        return ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.hosts)


def parse_url(url: str) -> tuple[Endpoints, str, int]:
    """``etcd://[user:password@]host:port[,host:port...]/job[?lease=S]`` -> endpoints, job, lease."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "etcd":
        raise RendezvousError(f"{url!r} is not an etcd:// URL")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    user = password = None
    if userinfo:
        name, sep, secret = userinfo.partition(":")
        if not name or not sep:
            raise RendezvousError(f"{url!r}: credentials must be user:password@")
        user, password = urllib.parse.unquote(name), urllib.parse.unquote(secret)
    hosts = []
    for item in hostlist.split(","):
        one = urllib.parse.urlsplit(f"//{item}")
        if not one.hostname:
            raise RendezvousError(f"{url!r} names an empty etcd endpoint")
        try:
            hosts.append((one.hostname, one.port or DEFAULT_PORT))
        except ValueError:
            raise RendezvousError(f"{url!r} has an invalid port in {item!r}") from None
    job = parts.path.strip("/")
    if not job or "/" in job or len(job) > 256:
        raise RendezvousError(f"{url!r} must name one job (1..256 characters, no '/') as its path")
    query = urllib.parse.parse_qs(parts.query)
    unknown = set(query) - {"lease"}
    if unknown:
        raise RendezvousError(f"{url!r}: unknown option(s) {sorted(unknown)}; only 'lease' is known")
    lease = DEFAULT_LEASE
    if "lease" in query:
        raw = query["lease"][-1]
        if not raw.isdigit() or not 1 <= int(raw) <= 3600:
            raise RendezvousError(f"{url!r}: lease must be whole seconds in 1..3600, got {raw!r}")
        lease = int(raw)
    return Endpoints(tuple(hosts), user, password), job, lease
