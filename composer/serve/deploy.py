"""Several `composer serve` replicas behind nginx: writes the nginx.conf (docs/deploy.md has the recipe).

    python -m composer.serve.deploy --replica a=127.0.0.1:8001 --replica b=127.0.0.1:8002 --listen 8000 > nginx.conf
    nginx -p "$PWD" -c nginx.conf -g 'daemon off;'

Each replica runs `composer serve --replica NAME`, so its job ids read `video_NAME-<hex>` and its session ids
`sess_NAME-<hex>`. The config sends

- new work (POST /v1/videos, /edits, /extensions, /v1/sessions, /v1/sessions/resume, a text model's
  completions) to the replicas in turn, passing over one that answers 503 (loading) or 429 (queue or sessions
  full): those answers created nothing, so the next replica gets the request as it was;
- a request naming a job or session (/v1/videos/<id>..., /v1/sessions/<id>...) to the replica its id names (an
  nginx `map` on the URI), 404 when no replica has that name;
- WebSocket streams (/v1/streams) upgraded, unbuffered, with hour-long timeouts: a stream is one connection and
  stays on its replica by nature;
- /replicas/NAME/<path> to replica NAME (its /health, /metrics, its own job list);
- the rest (/health, the web page, /docs, /metrics, the lists) to the replicas in turn.

nginx OSS has no active health checks: for the rest, a replica that refuses connections, times out or answers
503 is left out for a while (`max_fails` within `fail_timeout`); new work passes over busy or loading replicas
request by request. When no replica can answer, the proxy answers 503 with Retry-After.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

from composer.errors import ConfigError
from composer.serve.jobs import check_replica

MAX_BODY_SIZE = "1g"  # nginx's bound on a body; each replica answers 413 past its own, smaller limit
STREAM_TIMEOUT_S = 3600  # a live stream's connection may be quiet this long (a paused client) before nginx ends it
REQUEST_TIMEOUT_S = 1800  # a session extend answers when its blocks are made: as long as the server's timeout
CREATE_TIMEOUT_S = 300  # a POST that creates a job answers at once; past this the replica is taken as stuck
# what the replicas see of the client (set again in every location that sets its own headers)
FORWARDED = ("Host $http_host", "X-Real-IP $remote_addr", "X-Forwarded-For $proxy_add_x_forwarded_for",
             "X-Forwarded-Proto $scheme")
# the requests that make something new on whichever replica takes them, and whether they answer at once (a text
# model's completions answer when the text is made, and may stream it)
CREATE_PATHS = (("/v1/videos", True), ("/v1/videos/edits", True), ("/v1/videos/extensions", True),
                ("/v1/sessions", True), ("/v1/sessions/resume", True), ("/v1/completions", False),
                ("/v1/chat/completions", False))


# What each value written into the config may be: nginx reads `;`, `{`, `}`, `#`, quotes and whitespace as syntax,
# so a value is parsed into its type (a name, a host, a port, a size, a count, a path) and never written as given.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*")  # RFC 1123 names; IPv4 addresses match too
SIZE = re.compile(r"([0-9]{1,19})([kKmMgG]?)")  # nginx's sizes: bytes, or k, m, g
SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}
USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")  # a POSIX user name
PATH = re.compile(r"[A-Za-z0-9_./-]{1,4096}")  # a file path nginx reads without quoting
MAX_WORKERS = 1024
MAX_FAILS = 1000
MAX_FAIL_TIMEOUT_S = 86400


def parse_port(text: str, what: str) -> int:
    """A TCP port, 1 to 65535, in the digits 0-9 (`str.isdigit` would take '²', which int() refuses)."""
    if not re.fullmatch(r"[0-9]{1,5}", text) or not 1 <= int(text) <= 65535:
        raise ConfigError(f"{what}: the port {text!r} is not a number in [1, 65535]")
    return int(text)


def parse_host(text: str, what: str, wildcard: bool = False) -> str:
    """A host nginx can reach or listen on: a DNS name, an IPv4 address, or an IPv6 address in brackets ([::1]);
    with `wildcard`, also `*` (every address)."""
    import ipaddress

    if wildcard and text == "*":
        return text
    if text.startswith("[") and text.endswith("]"):
        try:
            return f"[{ipaddress.IPv6Address(text[1:-1]).compressed}]"
        except ValueError:
            pass
    elif HOSTNAME.fullmatch(text):
        if re.fullmatch(r"[0-9.]+", text):  # digits and dots: an IPv4 address or nothing
            try:
                return str(ipaddress.IPv4Address(text))
            except ValueError:
                pass
        else:
            return text.lower()
    raise ConfigError(f"{what}: the host {text!r} is not a host name, an IPv4 address or an IPv6 address in "
                      "brackets ([::1])")


def parse_address(text: str, what: str, wildcard: bool = False) -> str:
    """HOST:PORT, as nginx is given it (an IPv6 host in brackets: [::1]:8001)."""
    host, colon, port = text.rpartition(":")
    if not colon or not host:
        raise ConfigError(f"{what}: expected HOST:PORT (e.g. 127.0.0.1:8001), got {text!r}")
    return f"{parse_host(host, what, wildcard)}:{parse_port(port, what)}"


def parse_size(text: str, what: str = "--max-body-size") -> str:
    """An nginx size: a whole number of bytes, or of k, m or g (1g, 512m); 0 lifts nginx's bound."""
    match = SIZE.fullmatch(text) if isinstance(text, str) else None
    if match is None or int(match[1]) * SIZE_UNITS[match[2].lower()] >= 2**63:
        raise ConfigError(f"{what} {text!r}: expected a size as nginx writes it, a whole number with an optional "
                          "unit k, m or g (e.g. 1g, 512m)")
    return f"{int(match[1])}{match[2].lower()}"


def parse_count(text: str | int, what: str, low: int, high: int) -> int:
    """A whole number in [low, high] (from the command line: digits 0-9 only)."""
    if isinstance(text, str) and re.fullmatch(r"[0-9]{1,9}", text):
        text = int(text)
    if isinstance(text, bool) or not isinstance(text, int) or not low <= text <= high:
        raise ConfigError(f"{what} {text!r}: expected a whole number in [{low}, {high}]")
    return text


def parse_workers(text: str | int) -> str:
    """nginx's worker_processes: `auto` (one per CPU) or a count."""
    if text == "auto":
        return text
    return str(parse_count(text, "--workers", 1, MAX_WORKERS))


def parse_user(text: str) -> str:
    """nginx's `user`: a POSIX user name."""
    if not isinstance(text, str) or not USER.fullmatch(text):
        raise ConfigError(f"--user {text!r}: expected a user name (letters, digits, _ . -; starting with a letter or "
                          "_, at most 32)")
    return text


def parse_path(text: str, what: str) -> str:
    """A file path written into the config: letters, digits and _ . / - only (nothing nginx reads as syntax)."""
    if not isinstance(text, str) or not PATH.fullmatch(text):
        raise ConfigError(f"{what} {text!r}: expected a path of letters, digits and _ . / - only")
    return text


@dataclass(frozen=True)
class Replica:
    """One `composer serve --replica NAME` and the address nginx reaches it at (checked when made)."""

    name: str
    address: str  # host:port

    def __post_init__(self) -> None:
        check_replica(self.name)
        object.__setattr__(self, "address", parse_address(self.address, f"replica {self.name!r}"))


def parse_replica(text: str) -> Replica:
    """`NAME=HOST:PORT` as given to --replica."""
    name, sep, address = text.partition("=")
    if not sep or not address:
        raise ConfigError(f"--replica {text!r}: expected NAME=HOST:PORT, e.g. a=127.0.0.1:8001")
    try:
        return Replica(name, address)
    except ConfigError as exc:
        raise ConfigError(f"--replica {text!r}: {str(exc).removeprefix(f'replica {name!r}: ')}") from None


def listen_address(text: str) -> str:
    """--listen as nginx's `listen`: a port (on every address), or HOST:PORT (HOST `*`: every address)."""
    if isinstance(text, str) and ":" not in text:
        return str(parse_port(text, "--listen"))
    return parse_address(text, "--listen", wildcard=True)


def _json_error(status: int, message: str, param: str | None = "id") -> str:
    """nginx's `return` of the server's OpenAI-style error body (`message`: no quotes or backslashes)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    field = "null" if param is None else f'"{param}"'
    body = f'{{"error": {{"message": "{message}", "type": "{kind}", "param": {field}, "code": {status}}}}}'
    return f"return {status} '{body}\\n';"


def http_config(replicas: list[Replica], listen: str, max_body_size: str = MAX_BODY_SIZE, max_fails: int = 2,
                fail_timeout: int = 10, access_log: str = "/var/log/nginx/composer-access.log") -> str:
    """What goes in nginx's `http {}` block: the upstreams, the id map and the server (a conf.d snippet)."""
    if not replicas:
        raise ConfigError("no --replica given: name at least one, NAME=HOST:PORT")
    if not all(isinstance(r, Replica) for r in replicas):
        raise ConfigError("replicas: expected Replica values (parse_replica reads NAME=HOST:PORT)")
    names = [r.name for r in replicas]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"--replica {twice[0]!r} is given twice: each replica needs its own name")
    listen = listen_address(listen)
    max_body_size = parse_size(max_body_size)
    max_fails = parse_count(max_fails, "--max-fails", 0, MAX_FAILS)
    fail_timeout = parse_count(fail_timeout, "--fail-timeout", 1, MAX_FAIL_TIMEOUT_S)
    access_log = parse_path(access_log, "access log")
    pool = "\n".join(f"    server {r.address} max_fails={max_fails} fail_timeout={fail_timeout}s;" for r in replicas)
    new = "\n".join(f"    server {r.address} max_fails=0;" for r in replicas)
    singles = "\n".join(f"upstream composer_{r.name} {{\n    server {r.address};\n    keepalive 4;\n}}"
                        for r in replicas)
    routes = "\n".join(f"    {r.name} composer_{r.name};" for r in replicas)
    known = ", ".join(names)
    no_replica = _json_error(404, "this id names no replica: behind this proxy job ids read video_NAME-... and "
                             f"session ids sess_NAME-..., NAME one of {known}")
    unknown = _json_error(404, f"no replica named $composer_named behind this proxy (its replicas: {known})")
    unavailable = _json_error(503, "no replica behind this proxy could answer (down, loading, or their queues "
                              "full); retry later", None)
    forwarded = "\n".join(f"    proxy_set_header {h};" for h in FORWARDED)
    stream_forwarded = "\n".join(f"        proxy_set_header {h};" for h in FORWARDED)
    creating = "\n".join(
        f"    location = {path} {{\n        proxy_pass http://composer_new;\n"
        f"        proxy_next_upstream error timeout http_502 http_503 http_429 non_idempotent;\n"
        f"        proxy_read_timeout {CREATE_TIMEOUT_S if at_once else REQUEST_TIMEOUT_S}s;\n"
        + ("" if at_once else "        proxy_buffering off;  # streamed answers (server-sent events)\n")
        + "    }" for path, at_once in CREATE_PATHS)
    return f"""\
# composer serve: {len(replicas)} replica(s) behind nginx. Written by `python -m composer.serve.deploy`
# (docs/deploy.md); regenerate it rather than edit it.

# what names no job or session: the replicas in turn; one that refuses connections, times out or answers 503
# (loading) is left out for {fail_timeout} s after {max_fails} such answers (nginx OSS has passive checks only)
upstream composer_pool {{
{pool}
    keepalive 16;
}}

# new work: the replicas in turn, each request passing over those that refuse it (503 loading, 429 full), but
# nobody is left out for it: a full queue is not a fault, and with every replica busy for a moment the pool
# above would refuse all work for {fail_timeout} s
upstream composer_new {{
{new}
    keepalive 16;
}}

# each replica alone: the requests naming its jobs and sessions (one server: never marked down)
{singles}

# the replica a request names: `video_NAME-...` / `sess_NAME-...` ids, or /replicas/NAME/...
map $uri $composer_named {{
    default "";
    "~^/v1/(?:videos/video|sessions/sess)_(?<composer_id_replica>[a-z0-9]+)-" $composer_id_replica;
    "~^/replicas/(?<composer_path_replica>[a-z0-9]+)/" $composer_path_replica;
}}

map $composer_named $composer_upstream {{
    default "";
{routes}
}}

map $http_upgrade $composer_connection {{
    default upgrade;
    "" "";
}}

# the path without its query: a WebSocket client may send its key as ?api_key=..., which must not reach a log
log_format composer_serve '$remote_addr [$time_local] "$request_method $uri" $status $body_bytes_sent '
                          '$request_time upstream=$upstream_addr $upstream_status';

server {{
    listen {listen};
    access_log {access_log} composer_serve;
    # uploads: an outer bound; each replica answers 413 past its own body limit, naming it
    client_max_body_size {max_body_size};
    default_type application/json;

    proxy_http_version 1.1;
    proxy_set_header Connection "";  # keep-alive connections to the replicas
{forwarded}
    # Authorization (the API keys) passes through as every other request header does
    proxy_connect_timeout 5s;
    proxy_read_timeout {REQUEST_TIMEOUT_S}s;
    proxy_send_timeout {REQUEST_TIMEOUT_S}s;
    add_header X-Composer-Upstream $upstream_addr always;

    # no replica could answer (all down, or all skipped after 503/429): a retryable 503, not a 502
    error_page 502 504 = @composer_unavailable;
    location @composer_unavailable {{
        add_header Retry-After 5 always;
        {unavailable}
    }}

    # new work: any replica that can take it (its 503 or 429 created nothing, so the next one gets the request as
    # it was). GET /v1/videos and GET /v1/sessions list one replica's (each lists its own: /replicas/NAME/...)
{creating}

    # a job or session by id: the replica its id names (its status, content, remix, cancel, extend, fork, ...)
    location ~ ^/v1/(?:videos|sessions)/. {{
        if ($composer_named = "") {{
            {no_replica}
        }}
        if ($composer_upstream = "") {{
            {unknown}
        }}
        proxy_pass http://$composer_upstream;
    }}

    # live streams: one WebSocket each, on the replica it opened on
    location = /v1/streams {{
        proxy_pass http://composer_pool;
        proxy_set_header Upgrade $http_upgrade;
        proxy_set_header Connection $composer_connection;
{stream_forwarded}
        proxy_buffering off;
        proxy_read_timeout {STREAM_TIMEOUT_S}s;
        proxy_send_timeout {STREAM_TIMEOUT_S}s;
    }}

    # one replica by name: /replicas/NAME/health, /replicas/NAME/metrics, /replicas/NAME/v1/videos
    location ~ ^/replicas/[a-z0-9]+/ {{
        if ($composer_upstream = "") {{
            {unknown}
        }}
        rewrite ^/replicas/[a-z0-9]+(/.*)$ $1 break;
        proxy_pass http://$composer_upstream;
    }}

    # the rest (/health: 200 while any replica is ready, the web page, /docs, /metrics of one replica)
    location / {{
        proxy_pass http://composer_pool;
        proxy_next_upstream error timeout http_502 http_503;
    }}
}}
"""


def nginx_config(replicas: list[Replica], listen: str, workers: str = "auto", user: str | None = None,
                 **options) -> str:
    """A whole nginx.conf for `nginx -p DIR -c nginx.conf`: its pid, logs and temporary files in DIR."""
    workers = parse_workers(workers)
    user = None if user is None else parse_user(user)
    text = http_config(replicas, listen, access_log="access.log", **options)
    body = "\n".join(("    " + line) if line else "" for line in text.splitlines())
    user_line = f"user {user};\n" if user else ""
    return f"""\
# nginx -p DIR -c nginx.conf -g 'daemon off;'   (relative paths below are in DIR)
{user_line}worker_processes {workers};
pid nginx.pid;
error_log error.log warn;

events {{
    worker_connections 1024;
}}

http {{
    client_body_temp_path client_body_temp;
    proxy_temp_path proxy_temp;
    fastcgi_temp_path fastcgi_temp;
    uwsgi_temp_path uwsgi_temp;
    scgi_temp_path scgi_temp;

{body}
}}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m composer.serve.deploy", description=__doc__.splitlines()[0])
    parser.add_argument("--replica", action="append", default=[], metavar="NAME=HOST:PORT",
                        help="a replica (`composer serve --replica NAME --port PORT`); once per replica")
    parser.add_argument("--listen", default="8000", help="nginx's port, or HOST:PORT (default: 8000)")
    parser.add_argument("--max-body-size", default=MAX_BODY_SIZE, help="nginx's client_max_body_size (default: "
                        f"{MAX_BODY_SIZE}; each replica answers 413 past its own, smaller limit)")
    parser.add_argument("--max-fails", default="2", help="failed answers (refused, timeout, 503, 429) "
                        "within --fail-timeout that take a replica out of turn (default: 2; 0: never)")
    parser.add_argument("--fail-timeout", default="10", help="seconds a failing replica stays out of turn "
                        "(default: 10)")
    parser.add_argument("--workers", default="auto", help="nginx worker_processes (default: auto)")
    parser.add_argument("--user", default=None, help="nginx's `user` (only when nginx starts as root; default: "
                        "nginx's own, nobody)")
    parser.add_argument("--snippet", action="store_true", help="only what goes in `http {}` (for "
                        "/etc/nginx/conf.d/composer.conf under the distribution's nginx.conf)")
    args = parser.parse_args(argv)
    try:
        replicas = [parse_replica(r) for r in args.replica]
        options = {"max_body_size": args.max_body_size, "max_fails": args.max_fails,
                   "fail_timeout": args.fail_timeout}
        listen = listen_address(args.listen)
        workers = parse_workers(args.workers)  # checked with --snippet too, where they are not written
        user = None if args.user is None else parse_user(args.user)
        text = (http_config(replicas, listen, **options) if args.snippet
                else nginx_config(replicas, listen, workers, user, **options))
    except ConfigError as exc:  # one line (values are shown as repr: a newline in one stays escaped), as the CLI
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
