"""How to reach an object store (s3, gcs), and what it means when a request to one fails.

Scope: ObjectStoreOptions (endpoint, region, credentials, retries, concurrency) and what they become for
tensorstore: an s3 or gcs kvstore spec and the context holding credentials and tensorstore's own
request-retry resources (s3_request_retries / gcs_request_retries: exponential backoff on HTTP 5xx and
429, dropped, reset or truncated connections); the fail-fast check of an endpoint set explicitly
(check_endpoint: once per endpoint per process, a host that does not resolve or refuses the connection
fails within seconds, instead of after every retry, and before tensorstore's AWS credential chain logs to
stderr); and ``explain``, what a tensorstore failure means for the user: permanent (403, missing bucket:
with the fix) or transient (it outlasted every retry). Reading and writing objects is not here: that is
KvStorage's, in kv.py, which calls this module to open its kvstore and to word its StorageErrors.

A gs:// endpoint (a GCS-protocol server other than https://storage.googleapis.com: ObjectStoreOptions.endpoint,
else TENSORSTORE_GCS_HTTP_URL) has no place in tensorstore's gcs spec: its driver reads the
environment variable TENSORSTORE_GCS_HTTP_URL when a driver is opened. So a gcs kvstore with an
endpoint is opened with that variable set to it (under a lock, restored right after), in a context of
its own per endpoint, and the opened driver is kept for the process: tensorstore's driver cache then
hands that same driver to every later open of the bucket in that context (the zarr3 and Orbax arrays
opened over kvstore_spec()), whatever the variable says by then.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from flax_ckpt._src.errors import StorageError
from flax_ckpt._src.lazy import lazy

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import tensorstore as ts
else:
    ts = lazy("tensorstore", globals(), "ts")  # imported on first use (lazy.py)

_open_lock = threading.Lock()
_contexts: dict[str, Any] = {}  # one tensorstore context per resolved set of options
_ENV = {
    "max_attempts": ("FLAX_CKPT_STORAGE_MAX_ATTEMPTS", int, 10),
    "retry_delay_s": ("FLAX_CKPT_STORAGE_RETRY_DELAY", float, 0.5),
    "concurrency": ("FLAX_CKPT_STORAGE_CONCURRENCY", int, 64),
}
_S3_ONLY = ("endpoint", "region", "profile", "access_key_id", "secret_access_key", "session_token")
_ENDPOINT_VARS = ("FLAX_CKPT_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
_GCS_ENDPOINT_VAR = "TENSORSTORE_GCS_HTTP_URL"  # read by tensorstore's gcs driver when it opens one
_GCS_CREDENTIALS = (
    "Google application default credentials: GOOGLE_APPLICATION_CREDENTIALS, "
    "`gcloud auth application-default login`, or the machine's service account"
)


@dataclass(frozen=True)
class ObjectStoreOptions:
    """How to reach an object store. A field left None comes from the environment variable named
    beside it, else the default. S3 credentials, in order: explicit keys, a profile, the
    AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN variables, the AWS default chain
    (config files, ECS, EC2 metadata). gs:// takes ``endpoint`` (a GCS-protocol server; else
    TENSORSTORE_GCS_HTTP_URL, else https://storage.googleapis.com) and the last three fields; its credentials
    are Google's application default credentials."""

    endpoint: str | None = None  # s3: FLAX_CKPT_S3_ENDPOINT, AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL
    #                                gs: TENSORSTORE_GCS_HTTP_URL
    region: str | None = None  # AWS_REGION, AWS_DEFAULT_REGION; us-east-1 when an endpoint is set
    profile: str | None = None  # AWS_PROFILE
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    max_attempts: int | None = None  # FLAX_CKPT_STORAGE_MAX_ATTEMPTS (10): tries per request
    retry_delay_s: float | None = None  # FLAX_CKPT_STORAGE_RETRY_DELAY (0.5): first backoff; doubles, to 32x
    concurrency: int | None = None  # FLAX_CKPT_STORAGE_CONCURRENCY (64): requests in flight

    def __post_init__(self) -> None:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("ObjectStoreOptions: give access_key_id and secret_access_key together")
        for name in ("max_attempts", "concurrency"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"ObjectStoreOptions.{name} must be an int >= 1, got {v!r}")
        if self.retry_delay_s is not None and not self.retry_delay_s > 0:
            raise ValueError(f"ObjectStoreOptions.retry_delay_s must be > 0, got {self.retry_delay_s!r}")


def options_of(options: "ObjectStoreOptions | dict[str, Any] | None") -> ObjectStoreOptions:
    if options is None or isinstance(options, ObjectStoreOptions):
        return options or ObjectStoreOptions()
    return ObjectStoreOptions(**options)


def _env_or(value: Any, name: str) -> Any:
    if value is not None:
        return value
    var, kind, default = _ENV[name]
    raw = os.environ.get(var)
    try:
        return kind(raw) if raw else default
    except ValueError:
        raise ValueError(f"environment variable {var}={raw!r} is not a valid {kind.__name__}") from None


def _first_env(*names: str) -> str | None:
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def _request_resources(prefix: str, o: ObjectStoreOptions) -> dict[str, Any]:
    delay = float(_env_or(o.retry_delay_s, "retry_delay_s"))
    return {
        f"{prefix}_request_retries": {
            "max_retries": int(_env_or(o.max_attempts, "max_attempts")),
            "initial_delay": f"{round(delay * 1e6)}us",
            "max_delay": f"{round(32 * delay * 1e6)}us",
        },
        f"{prefix}_request_concurrency": {"limit": int(_env_or(o.concurrency, "concurrency"))},
    }


_key_files: dict[tuple[str, str, str], str] = {}


def _remove_own(folder: str, pid: int) -> None:
    """Removes ``folder`` at exit of the process that made it (a forked child, a data loader's worker,
    leaves the parent's credentials in place)."""
    if os.getpid() == pid:
        shutil.rmtree(folder, True)


def _profile_for_keys(key_id: str, secret: str, token: str | None) -> dict[str, Any]:
    """tensorstore has no inline-key credentials, so explicit keys go to a private (0600) AWS
    credentials file for this process, removed at exit, and are read through a profile."""
    ident = (key_id, secret, token or "")
    if ident not in _key_files:
        folder = tempfile.mkdtemp(prefix="flax_ckpt-aws-")
        atexit.register(_remove_own, folder, os.getpid())
        lines = ["[flax_ckpt]", f"aws_access_key_id = {key_id}", f"aws_secret_access_key = {secret}"]
        lines += [f"aws_session_token = {token}"] if token else []
        for name, text in (("credentials", "\n".join(lines)), ("config", "[profile flax_ckpt]")):
            fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text + "\n")
        _key_files[ident] = folder
    folder = _key_files[ident]
    return {
        "type": "profile",
        "profile": "flax_ckpt",
        "credentials_file": os.path.join(folder, "credentials"),
        "config_file": os.path.join(folder, "config"),
    }


def _aws_credentials(o: ObjectStoreOptions) -> tuple[dict[str, Any], str]:
    """The aws_credentials resource, and what distinguishes it for the context cache."""
    if o.access_key_id is not None:
        return _profile_for_keys(o.access_key_id, o.secret_access_key or "", o.session_token), ""
    profile = o.profile or os.environ.get("AWS_PROFILE")
    if profile:
        return {"type": "profile", "profile": profile}, ""
    if os.environ.get("AWS_ACCESS_KEY_ID"):  # read by tensorstore when the context is first used
        ident = "|".join(
            os.environ.get(v, "") for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
        )
        return {"type": "environment"}, ident
    return {"type": "default"}, ""


def _context_for(resources: dict[str, Any], ident: str = "") -> Any:
    key = json.dumps(resources, sort_keys=True) + "\0" + ident
    with _open_lock:
        if key not in _contexts:
            _contexts[key] = ts.Context(resources)
        return _contexts[key]


def s3_setup(spec: dict[str, Any], o: ObjectStoreOptions) -> tuple[dict[str, Any], Any]:
    """Fills endpoint and region from options/environment (never over what a spec already says);
    returns the spec and the context holding credentials, retries and concurrency."""
    spec = dict(spec)
    endpoint = o.endpoint or _first_env(*_ENDPOINT_VARS)
    if endpoint and "endpoint" not in spec:
        spec["endpoint"] = endpoint
    region = o.region or _first_env("AWS_REGION", "AWS_DEFAULT_REGION")
    if "aws_region" not in spec and (region or "endpoint" in spec):
        spec["aws_region"] = region or "us-east-1"  # with an endpoint, tensorstore cannot discover it
    credentials, ident = _aws_credentials(o)
    return spec, _context_for({"aws_credentials": credentials, **_request_resources("s3", o)}, ident)


def gcs_setup(spec: dict[str, Any], o: ObjectStoreOptions) -> tuple[dict[str, Any], Any, str | None]:
    """The spec, the context (retries, concurrency; one per endpoint, see the module's docstring) and
    the endpoint (None: tensorstore's default, https://storage.googleapis.com)."""
    given = [f for f in _S3_ONLY if f != "endpoint" and getattr(o, f) is not None]
    if given:
        raise ValueError(
            f"ObjectStoreOptions fields {given} apply to s3:// only, not gs:// (gs uses {_GCS_CREDENTIALS})"
        )
    endpoint = (o.endpoint or os.environ.get(_GCS_ENDPOINT_VAR) or "").rstrip("/") or None
    if endpoint and not re.match(r"https?://[^/]", endpoint):
        raise ValueError(f"gs:// endpoint {endpoint!r} must be a URL: http://host:port or https://host")
    return dict(spec), _context_for(_request_resources("gcs", o), f"gcs endpoint {endpoint or ''}"), endpoint


_gcs_open_lock = threading.Lock()
_gcs_drivers: dict[tuple[int, str], Any] = {}  # (id of the context, bucket) -> a kvstore kept open


def open_gcs(spec: dict[str, Any], context: Any, endpoint: str) -> Any:
    """Opens a gcs kvstore reaching ``endpoint``: tensorstore's driver takes its base URL from
    TENSORSTORE_GCS_HTTP_URL as it opens, so the variable says ``endpoint`` meanwhile (and is restored).
    The first driver of each bucket in this context is kept open, so that tensorstore's driver cache
    gives it (and its endpoint) to the arrays the serializers open over kvstore_spec() later."""
    with _gcs_open_lock:
        prior = os.environ.get(_GCS_ENDPOINT_VAR)
        if prior != endpoint:
            os.environ[_GCS_ENDPOINT_VAR] = endpoint
        try:
            kv = ts.KvStore.open(spec, context=context).result()
            key = (id(context), str(spec.get("bucket")))
            if key not in _gcs_drivers and set(spec) <= {"driver", "bucket", "path"}:
                _gcs_drivers[key] = ts.KvStore.open(dict(spec, path=""), context=context).result()
        finally:
            if prior != endpoint:
                if prior is None:
                    os.environ.pop(_GCS_ENDPOINT_VAR, None)
                else:
                    os.environ[_GCS_ENDPOINT_VAR] = prior
    return kv


def _short(e: Exception) -> str:
    """tensorstore's message without the HTTP response body it appends."""
    msg = re.sub(r" \[http_response_body='.*?'\](?= \[|$)", "", str(e), flags=re.S)
    return msg if len(msg) <= 600 else msg[:600] + "..."


_NO_CONNECTION = {
    "6": "the endpoint's host name did not resolve",
    "7": "no connection to the endpoint (refused or unreachable)",
}


def explain(e: Exception, driver: str | None = None, *, write: bool = False) -> str:
    """What a tensorstore failure means for the user: permanent (with the fix) or transient (gave up).
    ``driver`` ("s3", "gcs"; guessed from the message when None) picks the credential and endpoint
    hints; ``write``: the failed request was an upload (a GCS upload answered 404 means no bucket)."""
    msg = str(e)
    gcs = driver == "gcs" or (driver is None and "gs://" in msg)
    gave_up = re.search(r"All \d+ retry attempts failed", msg)
    curl = re.search(r"curl_code='(\d+)'", msg)
    if (
        "NoSuchBucket" in msg
        or "specified bucket does not exist" in msg
        or (gcs and write and "http_response_code='404'" in msg)
    ):
        why = "the bucket does not exist (create it, or fix the URL)"
    elif (
        "http_response_code='401'" in msg or "UNAUTHENTICATED" in msg
    ):  # tensorstore may say PERMISSION_DENIED
        why = "not authenticated (HTTP 401): no valid credentials were found"
        why += (
            f" or they were refused (gs:// uses {_GCS_CREDENTIALS}); not retried" if gcs else "; not retried"
        )
    elif "PERMISSION_DENIED" in msg or "http_response_code='403'" in msg:
        creds = (
            _GCS_CREDENTIALS + ") and the bucket's IAM permissions"
            if gcs
            else "ObjectStoreOptions, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and the bucket's policy"
        )
        why = f"permission denied (HTTP 403): check the credentials ({creds}; not retried"
    elif gave_up and curl and curl.group(1) in _NO_CONNECTION:
        where = (
            f"for gs://: ObjectStoreOptions.endpoint or {_GCS_ENDPOINT_VAR}"
            if gcs
            else f"for s3://: ObjectStoreOptions.endpoint or {', '.join(_ENDPOINT_VARS)}"
        )
        why = (
            f"{_NO_CONNECTION[curl.group(1)]} on every retry: check that the server is running and the "
            f"endpoint ({where})"
        )
    elif gave_up:
        why = (
            "transient errors outlasted every retry (HTTP 5xx/429, timeouts or dropped connections: the "
            "store is overloaded or the network unreliable; try again later, or raise "
            "ObjectStoreOptions.max_attempts / FLAX_CKPT_STORAGE_MAX_ATTEMPTS if it recurs)"
        )
    else:
        return _short(e)
    return f"{why}: {_short(e)}"


# ------------------------------------------------------------------- fail fast on an unreachable endpoint

_CHECK_TIMEOUT_S = 3.0  # bound on resolving the endpoint's host, and on each connect attempt
_checked: set[str] = set()  # endpoints reachable (or not provably unreachable) in this process
_check_lock = threading.Lock()
_UNREACHABLE = {
    errno.ECONNREFUSED: "refused the connection: no server is listening there",
    errno.ENETUNREACH: "is unreachable (no route to its network)",
    errno.EHOSTUNREACH: "is unreachable (no route to the host)",
    errno.EADDRNOTAVAIL: "is not an address this machine can connect to",
}


def check_endpoint(endpoint: str, url: str) -> None:
    """Raises StorageError within seconds when ``endpoint``'s host does not resolve, or refuses or cannot
    route a TCP connection: a wrong endpoint or a stopped server fails at once instead of after every
    retry. A timeout proves nothing (a slow network), so it passes and tensorstore's retries take over;
    so does an endpoint reached through a proxy. Checked once per endpoint per process."""
    with _check_lock:
        if endpoint in _checked:
            return
        why = _why_unreachable(endpoint)
        if why is None:
            _checked.add(endpoint)
            return
    gcs = url.startswith("gs://")
    raise StorageError(
        f"{url}: cannot reach the {'GCS' if gcs else 'S3'} endpoint {endpoint}: {why}. Start the "
        f"server, or fix the endpoint (it came from {_endpoint_source(endpoint, gcs)}). "
        f"Nothing was sent or retried."
    )


def _endpoint_source(endpoint: str, gcs: bool = False) -> str:
    names = (_GCS_ENDPOINT_VAR,) if gcs else _ENDPOINT_VARS
    var = next((v for v in names if (os.environ.get(v) or "").rstrip("/") == endpoint.rstrip("/")), None)
    if var:
        return f"the environment variable {var}"
    return "ObjectStoreOptions.endpoint" if gcs else "ObjectStoreOptions.endpoint or the kvstore spec"


def _why_unreachable(endpoint: str) -> str | None:
    """Why ``endpoint`` is certainly unreachable, or None (reachable, or not provably unreachable)."""
    u = urlparse(endpoint)
    try:
        host, port = u.hostname, u.port or {"http": 80, "https": 443}.get(u.scheme)
    except ValueError:  # a malformed port: tensorstore's own error says so
        return None
    if not host or not port or _proxied(u.scheme, host):
        return None
    addresses = _resolve(host, port)
    if addresses is None or isinstance(addresses, str):
        return addresses
    return _connect_any(addresses, host, port)


def _proxied(scheme: str, host: str) -> bool:
    """Whether curl would go through a proxy (http_proxy, https_proxy, all_proxy, no_proxy)."""
    proxies = urllib.request.getproxies()
    return bool(proxies.get(scheme) or proxies.get("all")) and not urllib.request.proxy_bypass(host)


def _resolve(host: str, port: int) -> list[tuple] | str | None:
    """The host's addresses; why it does not resolve; or None if the resolver took too long. A name
    under .invalid never resolves (RFC 6761), so the resolver is not asked about one."""
    if host.rstrip(".").lower().rsplit(".", 1)[-1] == "invalid":
        return f"its host name {host!r} does not resolve (names under .invalid never do)"
    found: dict[str, Any] = {}

    def lookup() -> None:
        try:
            found["addresses"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as e:  # UnicodeError: a label too long or empty
            found["error"] = e

    worker = threading.Thread(target=lookup, name="flax_ckpt-resolve", daemon=True)
    worker.start()
    worker.join(_CHECK_TIMEOUT_S)
    if "error" in found:
        e = found["error"]
        return f"its host name {host!r} does not resolve ({getattr(e, 'strerror', None) or e})"
    return found.get("addresses")


def _connect_any(addresses: list[tuple], host: str, port: int) -> str | None:
    """None once one address accepts a TCP connection (or one attempt is inconclusive), else why not."""
    why = ""
    for family, kind, proto, _, address in addresses:
        try:
            with socket.socket(family, kind, proto) as s:
                s.settimeout(_CHECK_TIMEOUT_S)
                s.connect(address)
            return None
        except OSError as e:
            if e.errno not in _UNREACHABLE:  # a timeout, or anything else that proves nothing
                return None
            at = host if address[0] == host else f"{host} ({address[0]})"
            why = f"{at} port {port} {_UNREACHABLE[e.errno]}"
    return why or None
