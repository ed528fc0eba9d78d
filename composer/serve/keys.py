"""API keys of `composer serve`: the `--api-key` flags, the COMPOSER_API_KEY environment variable and the
`--api-keys FILE` key file, read into a `KeyRing` of `ApiKey`s (a secret, the name logs, metrics and job records use
instead, and its limits). Every error names the flag or the file's line, never the key. The file format is
documented in docs/serving.md ("API keys"); auth.py enforces the keys on the server.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from composer.errors import ConfigError
from composer.logging import get_logger

logger = get_logger(__name__)

MIN_KEY_LENGTH = 16
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # also a Prometheus label value: nothing to escape
COUNT = re.compile(r"[1-9][0-9]{0,17}")  # a limit: an integer >= 1 in ASCII digits (str.isdigit takes '²')
LIMITS = {"queued": "max_queued", "streams": "max_streams", "sessions": "max_sessions", "rpm": "rpm"}
FILE_FORMAT = "KEY NAME [queued=N] [streams=N] [sessions=N] [rpm=N]"
MAKE_ONE = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


class KeyFileError(ConfigError):
    """An API key flag or key file line the server cannot use (the message names the line, never the key)."""


@dataclass(frozen=True)
class ApiKey:
    """One client's key: its secret, the name everything else uses, and its limits (None: no limit)."""

    name: str
    key: str = field(repr=False)
    max_queued: int | None = None  # jobs queued or running at once (POST /v1/videos and the other job POSTs)
    max_streams: int | None = None  # live streams (WebSocket /v1/streams) open at once
    max_sessions: int | None = None  # sessions (/v1/sessions) open at once
    rpm: int | None = None  # requests per minute, every request counted (polls too)

    def limits_text(self) -> str:
        parts = [f"{word}={getattr(self, attr)}" for word, attr in LIMITS.items() if getattr(self, attr) is not None]
        return " ".join(parts) or "no limits"


class KeyRing:
    """The server's API keys. `match` compares in constant time, against every key, whatever the input."""

    def __init__(self, keys: Iterable[ApiKey]):
        self.keys = list(keys)
        if not self.keys:
            raise KeyFileError("no API keys given: pass --api-key KEY or --api-keys FILE, or neither (no keys)")
        self._digests = [(hashlib.sha256(k.key.encode()).digest(), k) for k in self.keys]

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def names(self) -> list[str]:
        return [k.name for k in self.keys]

    def secrets(self) -> list[str]:
        return [k.key for k in self.keys]

    def match(self, given: bytes | str | None) -> ApiKey | None:
        """The key `given` is, or None. Digests of equal length are compared with hmac.compare_digest, for every
        key (no early exit), so the time taken says nothing about how much of a key was right."""
        if given is None:
            return None
        digest = hashlib.sha256(given.encode("utf-8", "surrogateescape") if isinstance(given, str) else given).digest()
        found = None
        for known, key in self._digests:
            if hmac.compare_digest(digest, known):
                found = key
        return found


def key_ring(flag_keys: Iterable[str] = (), path: str | Path | None = None, env_key: str | None = None
             ) -> KeyRing | None:
    """The keys of `--api-key` (named key1, key2, ... in order), `--api-keys FILE` and the COMPOSER_API_KEY
    environment variable (named env); None when there are none (the server runs without authentication)."""
    entries: list[tuple[ApiKey, str]] = []  # each key with where it came from, for the duplicate messages
    for i, key in enumerate(flag_keys, 1):
        _check_key(key, f"--api-key (the {_ordinal(i)})")
        entries.append((ApiKey(f"key{i}", key), f"--api-key (the {_ordinal(i)})"))
    if env_key:
        _check_key(env_key, "COMPOSER_API_KEY")
        entries.append((ApiKey("env", env_key), "COMPOSER_API_KEY"))
    if path is not None:
        entries += read_key_file(path)
    if not entries:
        return None
    seen_keys: dict[str, str] = {}
    seen_names: dict[str, str] = {}
    for key, where in entries:
        if key.key in seen_keys:
            raise KeyFileError(f"{where}: the same key as {seen_keys[key.key]}; give each client its own key")
        if key.name in seen_names:
            raise KeyFileError(f"{where}: the name {key.name!r} is taken by {seen_names[key.name]}; names must "
                               "differ (they tell the keys apart in logs and metrics)")
        seen_keys[key.key], seen_names[key.name] = where, where
    secrets = set(seen_keys)
    for key, where in entries:
        if key.name in secrets:
            raise KeyFileError(f"{where}: its name is one of the keys; a name is shown in logs and metrics, a key "
                               "must not be")
    return KeyRing(k for k, _ in entries)


def read_key_file(path: str | Path) -> list[tuple[ApiKey, str]]:
    """The keys of a key file (`FILE_FORMAT` per line; `#` starts a comment; blank lines skipped), each with its
    "FILE line N" for messages."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise KeyFileError(f"--api-keys {path}: cannot read it ({why})") from None
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("--api-keys %s: other users of this machine can read it (mode %o); chmod 600 %s", path,
                       stat.S_IMODE(mode), path)
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if "#" in line:  # a comment: a line starting with #, or a field starting with # and the rest of the line
            fields = fields[:next((i for i, f in enumerate(fields) if f.startswith("#")), len(fields))]
        if not fields:
            continue
        where = f"--api-keys {path} line {number}"
        if len(fields) < 2:
            raise KeyFileError(f"{where}: expected {FILE_FORMAT}, got 1 field (the key's name is missing)")
        key, name, *limits = fields
        _check_key(key, where)
        if not NAME.match(name):
            raise KeyFileError(f"{where}: the name (the 2nd field) must be 1 to 64 letters, digits, '_', '.' or '-', "
                               "starting with a letter or digit")
        entries.append((ApiKey(name, key, **_limits(limits, where)), where))
    if not entries:
        raise KeyFileError(f"--api-keys {path}: no keys in it (one per line: {FILE_FORMAT})")
    return entries


def _limits(fields: list[str], where: str) -> dict[str, int]:
    values: dict[str, int] = {}
    for i, text in enumerate(fields, 3):
        word, sep, value = text.partition("=")
        if not sep or word not in LIMITS:  # the field is not echoed: a key written in the wrong place would show
            raise KeyFileError(f"{where}: field {i} is not a limit; expected queued=N, streams=N, sessions=N or rpm=N "
                               f"(line format: {FILE_FORMAT})")
        if LIMITS[word] in values:
            raise KeyFileError(f"{where}: {word} is given twice")
        if not COUNT.fullmatch(value):  # ASCII digits only: str.isdigit() also takes '²', which int() refuses
            raise KeyFileError(f"{where}: {word}: expected an integer >= 1 in the digits 0-9 (leave it out for no "
                               "limit)")
        values[LIMITS[word]] = int(value)
    return values


def _check_key(key: str, where: str) -> None:
    """A usable key: long enough to be secret, printable ASCII without spaces (it travels in a header, a
    subprotocol and a URL), not starting with # (a comment in a key file). Never echoed."""
    if len(key) < MIN_KEY_LENGTH:
        raise KeyFileError(f"{where}: the key is {len(key)} characters; a key must be at least {MIN_KEY_LENGTH} "
                           f"(make one: {MAKE_ONE})")
    if not all(33 <= ord(c) <= 126 for c in key) or key.startswith("#"):
        raise KeyFileError(f"{where}: a key must be printable ASCII without spaces, not starting with # (make one: "
                           f"{MAKE_ONE})")


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def access_note(keys: KeyRing | None, host: str, port: int) -> tuple[str, bool]:
    """What the server says at start about who may use it: (the line, whether it is a warning: no keys on an
    address other machines can reach)."""
    if keys is not None:
        return (f"API keys: on ({len(keys)} key{'s' * (len(keys) != 1)}: {', '.join(keys.names)}); every request "
                "but /health needs Authorization: Bearer KEY", False)
    open_to = f"anyone who can reach {host}:{port} can use this server"
    if is_loopback(host):
        return f"API keys: off; {open_to} (this machine only; --api-key or --api-keys to require a key)", False
    return (f"API keys: off and --host {host} is reachable from other machines: {open_to}, queue jobs and read "
            "every video; pass --api-key or --api-keys, or serve on --host 127.0.0.1", True)


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
