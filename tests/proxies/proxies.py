"""Each reverse proxy under test: the config the test writes, and the command that runs it in the
foreground on 127.0.0.1 (never the system service).

One proxy process listens on two ports in front of one app server: `defaults` is the proxy as
installed (a bare `proxy_pass` or its equivalent), `tuned` adds the settings a user reaches for
to keep a stream and a client's abort flowing (`Proxy.tuned` names them; for Caddy, whose
defaults pass every abort, it is the setting that stops them). docs/proxies.md quotes them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..servers.client import HOST

APACHE_MODULES = Path("/usr/lib/apache2/modules")
SBIN = "/usr/sbin:/usr/local/sbin"


@dataclass(frozen=True)
class Ports:
    defaults: int
    tuned: int
    backend: int


@dataclass(frozen=True)
class Proxy:
    """One proxy: `configure(workdir, ports)` writes its config and returns its command line."""

    name: str
    binary: str
    version_argv: tuple[str, ...]
    configure: Callable[[Path, Ports], list[str]]
    tuned: str  # what the second listener sets, for the table
    h2c: bool = False  # speaks HTTP/2 (h2c) to the app server, which must then speak it too

    def __str__(self) -> str:
        return self.name

    def path(self) -> str | None:
        return shutil.which(self.binary) or shutil.which(self.binary, path=SBIN)

    def version(self) -> str:
        """The version line the binary prints (`nginx/1.22.1`, `HAProxy version 2.6.12 ...`)."""
        binary = self.path()
        assert binary is not None
        run = subprocess.run(
            [binary, *self.version_argv], capture_output=True, text=True, timeout=10, check=False
        )
        text = (run.stdout + run.stderr).strip()
        match = re.search(r"\d+\.\d+(\.\d+)?", text)
        return match.group(0) if match else text.splitlines()[0]


# -- nginx ----------------------------------------------------------------------------------------
NGINX_TUNED = """\
proxy_http_version 1.1;
proxy_set_header Connection "";
proxy_buffering off;
proxy_request_buffering off;"""

NGINX_CONF = """\
daemon off;
master_process on;
worker_processes 1;
{user}
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream app {{ server {host}:{backend}; keepalive 8; }}
    server {{
        listen {host}:{defaults};
        location / {{ proxy_pass http://{host}:{backend}; }}
    }}
    server {{
        listen {host}:{tuned};
        location / {{
            proxy_pass http://app;
{settings}
        }}
    }}
}}
"""


def nginx(workdir: Path, ports: Ports) -> list[str]:
    settings = "\n".join(" " * 12 + line for line in NGINX_TUNED.splitlines())
    # As root, nginx's workers would run as nobody, who cannot write the temp paths.
    user = "user root;" if os.geteuid() == 0 else ""
    conf = workdir / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(user=user, dir=workdir, host=HOST, settings=settings, **ports.__dict__)
    )
    return [_binary("nginx"), "-p", str(workdir), "-c", str(conf)]


# -- HAProxy --------------------------------------------------------------------------------------
HAPROXY_TUNED = "option abortonclose"

HAPROXY_CONF = """\
global
    maxconn 256
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
frontend defaults
    bind {host}:{defaults}
    default_backend app
frontend tuned
    bind {host}:{tuned}
    default_backend app_tuned
backend app
    server app {host}:{backend}
backend app_tuned
    {settings}
    server app {host}:{backend}
"""


def haproxy(workdir: Path, ports: Ports) -> list[str]:
    conf = workdir / "haproxy.cfg"
    conf.write_text(HAPROXY_CONF.format(host=HOST, settings=HAPROXY_TUNED, **ports.__dict__))
    return [_binary("haproxy"), "-db", "-f", str(conf)]  # -db: foreground, no daemon


# -- Caddy ----------------------------------------------------------------------------------------
CADDY_TUNED = "flush_interval -1"

CADDYFILE = """\
{{
    admin off
    auto_https off
}}
http://{host}:{defaults} {{
    reverse_proxy {host}:{backend}
}}
http://{host}:{tuned} {{
    reverse_proxy {host}:{backend} {{
        {settings}
    }}
}}
"""


def caddy(workdir: Path, ports: Ports) -> list[str]:
    conf = workdir / "Caddyfile"
    conf.write_text(CADDYFILE.format(host=HOST, settings=CADDY_TUNED, **ports.__dict__))
    return [_binary("caddy"), "run", "--config", str(conf), "--adapter", "caddyfile"]


# -- Apache httpd ---------------------------------------------------------------------------------
APACHE_TUNED = "ProxyPass / http://{host}:{backend}/ flushpackets=on"
APACHE_H2C_TUNED = "ProxyPass / h2c://{host}:{backend}/ flushpackets=on"

APACHE_CONF = """\
ServerRoot {dir}
ServerName {host}
PidFile {dir}/httpd.pid
DefaultRuntimeDir {dir}
ErrorLog {dir}/error.log
LogLevel warn
User www-data
Group www-data
Timeout 60
{modules}
Listen {host}:{defaults}
Listen {host}:{tuned}
<VirtualHost {host}:{defaults}>
    ProxyPass / {scheme}://{host}:{backend}/
</VirtualHost>
<VirtualHost {host}:{tuned}>
    {settings}
</VirtualHost>
"""


def _apache(workdir: Path, ports: Ports, *, h2c: bool) -> list[str]:
    modules = ["mpm_event", "authz_core", "proxy", "proxy_http"]
    if h2c:
        modules += ["http2", "proxy_http2"]
    lines = "\n".join(
        f"LoadModule {name}_module {APACHE_MODULES}/mod_{name}.so" for name in modules
    )
    settings = (APACHE_H2C_TUNED if h2c else APACHE_TUNED).format(host=HOST, **ports.__dict__)
    conf = workdir / "httpd.conf"
    conf.write_text(
        APACHE_CONF.format(
            dir=workdir,
            host=HOST,
            modules=lines,
            scheme="h2c" if h2c else "http",
            settings=settings,
            **ports.__dict__,
        )
    )
    return [_binary("apache2"), "-f", str(conf), "-DFOREGROUND"]


def apache(workdir: Path, ports: Ports) -> list[str]:
    return _apache(workdir, ports, h2c=False)


def apache_h2c(workdir: Path, ports: Ports) -> list[str]:
    return _apache(workdir, ports, h2c=True)


# -- h2o ------------------------------------------------------------------------------------------
H2O_TUNED = "proxy.timeout.keepalive: 0"

H2O_CONF = """\
{user}
pid-file: {dir}/h2o.pid
error-log: {dir}/error.log
num-threads: 1
hosts:
  "defaults":
    listen: {{host: {host}, port: {defaults}}}
    paths:
      "/":
        proxy.reverse.url: "http://{host}:{backend}/"
  "tuned":
    listen: {{host: {host}, port: {tuned}}}
    paths:
      "/":
        proxy.reverse.url: "http://{host}:{backend}/"
        {settings}
"""


def h2o(workdir: Path, ports: Ports) -> list[str]:
    conf = workdir / "h2o.conf"
    user = "user: root" if os.geteuid() == 0 else ""
    conf.write_text(
        H2O_CONF.format(user=user, dir=workdir, host=HOST, settings=H2O_TUNED, **ports.__dict__)
    )
    return [_binary("h2o"), "-c", str(conf)]


# -- Varnish --------------------------------------------------------------------------------------

VARNISH_VCL = """\
vcl 4.1;
import std;
backend app {{ .host = "{host}"; .port = "{backend}"; }}
sub vcl_recv {{
    if (std.port(server.ip) == {tuned}) {{
        return (pipe);
    }}
}}
"""


def varnish(workdir: Path, ports: Ports) -> list[str]:
    vcl = workdir / "default.vcl"
    vcl.write_text(VARNISH_VCL.format(host=HOST, **ports.__dict__))
    return [
        _binary("varnishd"),
        "-F",  # foreground
        "-f", str(vcl),
        "-a", f"{HOST}:{ports.defaults}",
        "-a", f"{HOST}:{ports.tuned}",
        "-n", str(workdir / "varnish"),
        "-s", "malloc,32m",
        "-T", "none",
        # As root: no unprivileged user, whose jail could not reach the test's temp dir.
        *(["-j", "none"] if os.geteuid() == 0 else []),
    ]  # fmt: skip


def _binary(name: str) -> str:
    return shutil.which(name) or shutil.which(name, path=SBIN) or name


NGINX = Proxy(
    "nginx",
    "nginx",
    ("-v",),
    nginx,
    "`proxy_buffering off`, `proxy_request_buffering off`, HTTP/1.1 keep-alive upstream",
)
HAPROXY = Proxy("haproxy", "haproxy", ("-v",), haproxy, f"`{HAPROXY_TUNED}`")
# Caddy's defaults already pass every abort; its second listener is the setting that does not.
CADDY = Proxy("caddy", "caddy", ("version",), caddy, f"`{CADDY_TUNED}`")
APACHE = Proxy("apache", "apache2", ("-v",), apache, "`flushpackets=on`")
APACHE_H2C = Proxy("apache-h2c", "apache2", ("-v",), apache_h2c, "`flushpackets=on`", h2c=True)
H2O = Proxy("h2o", "h2o", ("-v",), h2o, f"`{H2O_TUNED}`")
VARNISH = Proxy("varnish", "varnishd", ("-V",), varnish, "`return (pipe)` in `vcl_recv`")
PROXIES = (NGINX, HAPROXY, CADDY, APACHE, APACHE_H2C, H2O, VARNISH)
