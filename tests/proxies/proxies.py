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
from functools import partial
from pathlib import Path

from ..servers.client import HOST

APACHE_MODULES = Path("/usr/lib/apache2/modules")
SBIN = "/usr/sbin:/usr/local/sbin"
ROOT = os.geteuid() == 0


@dataclass(frozen=True)
class Ports:
    defaults: int
    tuned: int
    backend: int


@dataclass(frozen=True)
class Proxy:
    """One proxy: `configure(workdir, ports)` writes its config and returns the arguments its
    binary runs with."""

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

    def argv(self, *args: str) -> list[str]:
        binary = self.path()
        assert binary is not None
        return [binary, *args]

    def command(self, workdir: Path, ports: Ports) -> list[str]:
        return self.argv(*self.configure(workdir, ports))

    def version(self) -> str:
        """The version line the binary prints (`nginx/1.22.1`, `HAProxy version 2.6.12 ...`)."""
        run = subprocess.run(
            self.argv(*self.version_argv), capture_output=True, text=True, timeout=10, check=False
        )
        text = (run.stdout + run.stderr).strip()
        match = re.search(r"\d+\.\d+(\.\d+)?", text)
        return match.group(0) if match else text.splitlines()[0]


def write(workdir: Path, name: str, template: str, ports: Ports, **fields: str) -> str:
    """`template` filled in (the workdir, the host, the ports, `fields`) as `workdir/name`."""
    path = workdir / name
    path.write_text(template.format(dir=workdir, host=HOST, **ports.__dict__, **fields))
    return str(path)


# -- nginx ----------------------------------------------------------------------------------------
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
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"""


def nginx(workdir: Path, ports: Ports) -> list[str]:
    # As root, nginx's workers would run as nobody, who cannot write the temp paths.
    conf = write(workdir, "nginx.conf", NGINX_CONF, ports, user="user root;" if ROOT else "")
    return ["-p", str(workdir), "-c", conf]


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
    conf = write(workdir, "haproxy.cfg", HAPROXY_CONF, ports, settings=HAPROXY_TUNED)
    return ["-db", "-f", conf]  # -db: foreground, no daemon


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
    conf = write(workdir, "Caddyfile", CADDYFILE, ports, settings=CADDY_TUNED)
    return ["run", "--config", conf, "--adapter", "caddyfile"]


# -- Apache httpd ---------------------------------------------------------------------------------
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
    ProxyPass / {scheme}://{host}:{backend}/ flushpackets=on
</VirtualHost>
"""


def apache(workdir: Path, ports: Ports, *, h2c: bool = False) -> list[str]:
    modules = ["mpm_event", "authz_core", "proxy", "proxy_http"]
    if h2c:
        modules += ["http2", "proxy_http2"]
    lines = "\n".join(
        f"LoadModule {name}_module {APACHE_MODULES}/mod_{name}.so" for name in modules
    )
    scheme = "h2c" if h2c else "http"
    conf = write(workdir, "httpd.conf", APACHE_CONF, ports, modules=lines, scheme=scheme)
    return ["-f", conf, "-DFOREGROUND"]


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
    user = "user: root" if ROOT else ""
    return ["-c", write(workdir, "h2o.conf", H2O_CONF, ports, user=user, settings=H2O_TUNED)]


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
    return [
        "-F",  # foreground
        "-f", write(workdir, "default.vcl", VARNISH_VCL, ports),
        "-a", f"{HOST}:{ports.defaults}",
        "-a", f"{HOST}:{ports.tuned}",
        "-n", str(workdir / "varnish"),
        "-s", "malloc,32m",
        "-T", "none",
        # As root: no unprivileged user, whose jail could not reach the test's temp dir.
        *(["-j", "none"] if ROOT else []),
    ]  # fmt: skip


NGINX_LABEL = "`proxy_buffering off`, `proxy_request_buffering off`, HTTP/1.1 keep-alive upstream"
NGINX = Proxy("nginx", "nginx", ("-v",), nginx, NGINX_LABEL)
HAPROXY = Proxy("haproxy", "haproxy", ("-v",), haproxy, f"`{HAPROXY_TUNED}`")
# Caddy's defaults already pass every abort; its second listener is the setting that does not.
CADDY = Proxy("caddy", "caddy", ("version",), caddy, f"`{CADDY_TUNED}`")
APACHE = Proxy("apache", "apache2", ("-v",), apache, "`flushpackets=on`")
APACHE_H2C = Proxy(
    "apache-h2c", "apache2", ("-v",), partial(apache, h2c=True), "`flushpackets=on`", h2c=True
)
H2O = Proxy("h2o", "h2o", ("-v",), h2o, f"`{H2O_TUNED}`")
VARNISH = Proxy("varnish", "varnishd", ("-V",), varnish, "`return (pipe)` in `vcl_recv`")
PROXIES = (NGINX, HAPROXY, CADDY, APACHE, APACHE_H2C, H2O, VARNISH)
