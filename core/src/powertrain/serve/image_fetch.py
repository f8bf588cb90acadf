"""Fetching remote images, for a server whose operator allows it (``[server.images]``).

A client naming a URL makes the server send a request where the client says: a
server-side request forgery risk. So fetching is off by default, and when on:
- only ``http`` and ``https`` URLs of hosts on the operator's allow-list, at every
  redirect too (at most ``MAX_REDIRECTS``, each checked like the first URL);
- the host's addresses are resolved here and checked (private, loopback, link-local,
  multicast and reserved addresses are refused unless ``fetch_private_addresses``), and
  the connection goes to the checked address, so a second DNS answer cannot swap it
  (the request keeps the host name in ``Host`` and, for https, in SNI and the
  certificate check);
- at most ``fetch_max_bytes``, refused from the Content-Length or as soon as more arrive;
- all of it within ``fetch_timeout_s``.
The media type is the response's Content-Type; the protocol adapter then checks that
the bytes are that type, as for inline data.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urljoin, urlsplit

import httpx

from powertrain.config import ImagesConfig

MAX_REDIRECTS = 3


class ImageFetchError(Exception):
    """A remote image the server did not fetch: ``path`` names its field in the request."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """Whether ``host`` is on the allow-list: named exactly, or under a ``.domain`` entry."""
    host = host.lower().rstrip(".")
    for entry in allowed:
        entry = entry.lower().rstrip(".")
        if entry.startswith("."):
            if host.endswith(entry):
                return True
        elif host == entry:
            return True
    return False


def public_address(address: str) -> bool:
    """Whether ``address`` is a public unicast address (IPv4-mapped IPv6 judged as IPv4)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


class ImageFetcher:
    """Fetches remote images under ``config``'s rules; one HTTP client for the server's life."""

    def __init__(self, config: ImagesConfig) -> None:
        self.config = config
        # trust_env=False: no proxy from the environment may carry the request elsewhere.
        self._client = httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=config.fetch_timeout_s)

    async def fetch(self, url: str, path: str) -> tuple[bytes, str]:
        """The bytes at ``url`` and the media type the server sent them as."""
        timeout = self.config.fetch_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await self._fetch(url, path)
        except TimeoutError:
            raise ImageFetchError(
                path, f"fetching {url} took longer than {timeout:g} s; send the image inline"
            ) from None
        except httpx.HTTPError as exc:
            raise ImageFetchError(path, f"fetching {url} failed: {type(exc).__name__}: {exc}") from None

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _fetch(self, url: str, path: str) -> tuple[bytes, str]:
        for _ in range(MAX_REDIRECTS + 1):
            request = await self._request(url, path)
            response = await self._client.send(request, stream=True)
            try:
                if response.is_redirect:
                    location = response.headers.get("location", "")
                    if not location:
                        raise ImageFetchError(path, f"{url} answered {response.status_code} without a Location")
                    url = urljoin(url, location)
                    continue
                if response.status_code != 200:
                    raise ImageFetchError(path, f"{url} answered {response.status_code}, not an image")
                media_type = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
                return await self._body(response, url, path), media_type
            finally:
                await response.aclose()
        raise ImageFetchError(path, f"{url}: more than {MAX_REDIRECTS} redirects")

    async def _request(self, url: str, path: str) -> httpx.Request:
        """A GET of ``url``, checked, addressed to a checked address of its host."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ImageFetchError(path, f"{url}: only http and https image URLs are fetched")
        host = parts.hostname
        if not host:
            raise ImageFetchError(path, f"{url}: the URL has no host")
        if parts.username or parts.password:
            raise ImageFetchError(path, f"{url}: image URLs must not carry credentials")
        if not host_allowed(host, self.config.fetch_hosts):
            raise ImageFetchError(
                path,
                f"{url}: host {host!r} is not one this server fetches images from "
                f"({', '.join(self.config.fetch_hosts)}); send the image inline as a data URL",
            )
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise ImageFetchError(path, f"{url}: the port is not a number from 0 to 65535") from None
        address = await self._address(host, port, url, path)
        literal = f"[{address}]" if ":" in address else address
        target = parts._replace(netloc=f"{literal}:{port}").geturl()
        extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
        host_header = parts.netloc.rsplit("@", 1)[-1]
        return self._client.build_request(
            "GET",
            target,
            headers={"Host": host_header, "Accept": "image/*", "Accept-Encoding": "identity"},
            extensions=extensions,
        )

    async def _address(self, host: str, port: int, url: str, path: str) -> str:
        """The first address ``host`` resolves to, once every one of them is checked."""
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ImageFetchError(path, f"{url}: host {host!r} does not resolve ({exc})") from None
        addresses = [str(info[4][0]) for info in infos]
        if not self.config.fetch_private_addresses:
            private = [a for a in addresses if not public_address(a)]
            if private:
                raise ImageFetchError(
                    path,
                    f"{url}: host {host!r} resolves to the non-public address {private[0]}, which this server "
                    "does not fetch from ([server.images] fetch_private_addresses)",
                )
        return addresses[0]

    async def _body(self, response: httpx.Response, url: str, path: str) -> bytes:
        """The response body, refused past ``fetch_max_bytes`` before it is all read."""
        limit = self.config.fetch_max_bytes
        declared = response.headers.get("content-length", "")
        too_large = f"{url}: the image is larger than this server's limit of {limit} bytes; send a smaller image"
        if declared.isdigit() and int(declared) > limit:
            raise ImageFetchError(path, too_large)
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > limit:
                raise ImageFetchError(path, too_large)
            chunks.append(chunk)
        return b"".join(chunks)
