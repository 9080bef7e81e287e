"""Credentials are never written: one masking rule for everything a run writes or shows, and its inverse for the
processes that need the real thing.

A credential is (1) the password in a URI's userinfo (``scheme://user:pass@host``, any scheme), (2) a query parameter
with a secret's name (``?token=``, ``&X-Amz-Signature=``, ``&sig=``, ...), (3) the value of a secret-looking
environment variable (a name with TOKEN, SECRET, PASSWORD, KEY, CREDENTIAL; 8 characters or more) or of the Ray auth
token file. :func:`mask` puts ``***`` in place of each, anywhere in a text; :func:`mask_tree` in every string of a
JSON-like tree. Masking is idempotent and leaves everything else as it was.

What masking takes away still reaches what needs it, without being written anywhere: whoever submits a job passes the
credentialed URIs in one environment variable, ``UNBROKEN_CREDENTIALS`` (space-separated, in the job's runtime_env,
never in its spec), and :func:`reveal` puts each masked URI's secret back where scheme, user and host:port match one
of them (a query secret: where the whole URI matches). A config is revealed wherever it is loaded
(ray_jobs/config/loading.py: YAML and ``--set``, a job spec, a run record), with this process's environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

MASK = "***"
CREDENTIALS_ENV = "UNBROKEN_CREDENTIALS"
MIN_SECRET = 8  # shorter environment values are not masked as text: "true", "1", a region would mangle every line

SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL", re.IGNORECASE)
# A variable that says where a secret is kept (RAY_AUTH_TOKEN_PATH), not the secret: its value is a path, left alone.
_WHERE = re.compile(r"_(PATH|FILE|DIR)$", re.IGNORECASE)

_SCHEME = r"[A-Za-z][A-Za-z0-9+.\-]*://"
_STOP = r"\s'\"<>`"  # what ends a URI inside a longer text (quotes, brackets of markup, whitespace)
_URI = re.compile(rf"{_SCHEME}[^{_STOP}]+")
# The password runs to the last '@' before the host (an unescaped '@' in a password is common), and the host has none;
# or, where that finds none, to the first '@' whatever it holds but whitespace -- '/', '?', '#', a quote: SQLAlchemy
# reads a URL so (``[^@]*``) and a database password may hold any of them. (A URL with no password whose path holds
# an '@' after a port, ``http://h:8080/a@b``, is masked too: more hidden than needed, never less.)
_PASSWORD = rf"[^{_STOP}/?#]*|[^\s@]*"
_USERINFO = re.compile(
    rf"(?P<scheme>{_SCHEME})(?P<user>[^{_STOP}:/?#@\[\]]*):(?P<password>{_PASSWORD})@(?P<host>[^{_STOP}/?#@]*)"
)
_REST = re.compile(rf"[^{_STOP}]*")  # what follows a URI's host: its port, path and query
_QUERY = re.compile(rf"(?P<lead>[?&](?P<name>[A-Za-z0-9_.\-]+)=)(?P<value>[^{_STOP}&#]*)")
# A query parameter is a secret by a word of its name (``access_token``, ``X-Amz-Signature``, ``clientSecret``), or a
# key of some kind (``api_key``, ``AccountKey``); by the whole name for the short ones that are words elsewhere.
_PARAM_WORDS = {"password", "passwd", "pwd", "secret", "token", "signature", "sig", "credential", "credentials",
                "apikey"}  # fmt: skip
_KEY_KINDS = {"api", "access", "private", "session", "account", "secret", "shared", "master", "subscription"}
_PARAM_NAMES = {"key", "pass", "auth"}
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def secret_param(name: str) -> bool:
    """Whether a query parameter of this name holds a secret (``X-Amz-Signature``, ``access_token``, ``sig``), by
    its words: ``tokens_per_s`` or ``authSource`` is not one."""
    words = [w.lower() for w in _WORD.findall(name)]
    keyed = any(a in _KEY_KINDS and b == "key" for a, b in zip(words, words[1:], strict=False))
    return name.lower() in _PARAM_NAMES or keyed or any(w in _PARAM_WORDS for w in words)


def mask(text: str, values: Iterable[str] | None = None) -> str:
    """``text`` with every credential masked: URI passwords, secret query parameters, and ``values`` (default: this
    process's secret values, :func:`secret_values`)."""
    if not isinstance(text, str) or not text:
        return text
    if "://" in text:
        text = _USERINFO.sub(_mask_userinfo, text)
    if "=" in text:
        text = _QUERY.sub(_mask_param, text)
    for value in secret_values() if values is None else values:
        if value in text:
            text = text.replace(value, MASK)
    return text


def _mask_userinfo(m: re.Match) -> str:
    if not m["password"] or m["password"] == MASK:
        return m[0]
    return f"{m['scheme']}{m['user']}:{MASK}@{m['host']}"


def _mask_param(m: re.Match) -> str:
    if not m["value"] or m["value"] == MASK or not secret_param(m["name"]):
        return m[0]
    return m["lead"] + MASK


def mask_tree(tree: Any, values: Iterable[str] | None = None) -> Any:
    """A JSON-like tree (dicts, lists, strings) with :func:`mask` applied to every string, keys included."""
    found = secret_values() if values is None else list(values)
    if isinstance(tree, str):
        return mask(tree, found)
    if isinstance(tree, Mapping):
        return {mask_tree(k, found): mask_tree(v, found) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [mask_tree(v, found) for v in tree]
    return tree


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values that must never appear in text, longest first: secret-looking environment variables', the Ray auth
    token's, and the secrets of the URIs in ``UNBROKEN_CREDENTIALS`` (a library may quote a password on its own)."""
    env = os.environ if environ is None else environ
    values = [v for k, v in env.items() if SECRET_NAME.search(k) and not _WHERE.search(k)]
    values.append(_ray_token(env))
    values += [s for uri in env_credentials(env) for s in _secrets_of(uri)]
    return sorted({v.strip() for v in values if len(v.strip()) >= MIN_SECRET}, key=len, reverse=True)


_token_cache: dict[tuple[str, int], str] = {}


def _ray_token(env: Mapping[str, str]) -> str:
    """The Ray auth token this machine's clients send (``RAY_AUTH_TOKEN``, else its file), "" when there is none."""
    path = Path(env.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        key = (str(path), path.stat().st_mtime_ns)
    except OSError:
        return ""
    if key not in _token_cache:  # read once per version of the file: mask() runs for every log line
        with contextlib.suppress(OSError, UnicodeDecodeError):
            _token_cache.clear()
            _token_cache[key] = path.read_text().strip()
    return _token_cache.get(key, "")


def _secrets_of(uri: str) -> list[str]:
    """The secret parts of one credentialed URI: its password and its secret query values."""
    out = [m["password"] for m in _USERINFO.finditer(uri)]
    return out + [m["value"] for m in _QUERY.finditer(uri) if secret_param(m["name"])]


# -- the way back ------------------------------------------------------------------------------------------------
def credentials_in(tree: Any) -> list[str]:
    """Every URI in the strings of ``tree`` that carries a credential (what masking would change), in order; whole,
    a password holding a quote or a '/' included."""
    found: list[str] = []
    for text in _strings(tree):
        passwords = [m[0] + _rest(text, m.end()) for m in _USERINFO.finditer(text) if _masks(m)]
        queries = [u for u in _URI.findall(text) if mask(u, ()) != u]
        found += [u for u in dict.fromkeys(passwords + queries) if u not in found]
    return found


def _rest(text: str, at: int) -> str:
    """What follows a URI's host at ``at``: its port, path and query (empty when nothing does)."""
    m = _REST.match(text, at)
    return m[0] if m else ""


def _masks(m: re.Match) -> bool:
    """Whether a userinfo match holds a password masking would hide."""
    return _mask_userinfo(m) != m[0]


def _strings(tree: Any) -> Iterable[str]:
    if isinstance(tree, str):
        yield tree
    elif isinstance(tree, Mapping):
        for v in tree.values():
            yield from _strings(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from _strings(v)


def env_credentials(environ: Mapping[str, str] | None = None) -> list[str]:
    """The credentialed URIs this process was given (``UNBROKEN_CREDENTIALS``)."""
    env = os.environ if environ is None else environ
    return env.get(CREDENTIALS_ENV, "").split()


def job_env(*trees: Any) -> dict[str, str]:
    """The environment that carries the credentials of ``trees`` (a config's, say) and of this process's own
    ``UNBROKEN_CREDENTIALS`` to a job: ``{UNBROKEN_CREDENTIALS: "uri uri ..."}``, or {} when there are none."""
    found = [u for t in (*trees, env_credentials()) for u in credentials_in(t)]
    return {CREDENTIALS_ENV: " ".join(dict.fromkeys(found))} if found else {}


def reveal(text: str, credentials: Iterable[str] | None = None) -> str:
    """``text`` with each masked URI restored from ``credentials`` (default: ``UNBROKEN_CREDENTIALS``): the whole
    URI where one masks to exactly it, else the password of the one with the same scheme, user and host:port. A
    masked URI none of them matches stays masked."""
    creds = env_credentials() if credentials is None else list(credentials)
    if MASK not in text or not creds:
        return text
    whole = {mask(c, ()): c for c in creds}
    origins = {_origin(m): m["password"] for c in creds if (m := _USERINFO.match(c))}

    def restore(u: re.Match) -> str:
        if u[0] in whole:
            return whole[u[0]]
        m = _USERINFO.match(u[0])
        if m is None or m["password"] != MASK or _origin(m) not in origins:
            return u[0]
        return f"{m['scheme']}{m['user']}:{origins[_origin(m)]}@{m['host']}{u[0][m.end() :]}"

    return _URI.sub(restore, text)


def _origin(m: re.Match) -> tuple[str, str, str]:
    return m["scheme"].lower(), m["user"], m["host"].lower()


def reveal_tree(tree: Any, credentials: Iterable[str] | None = None) -> Any:
    """:func:`reveal` applied to every string of a JSON-like tree."""
    creds = env_credentials() if credentials is None else list(credentials)
    if not creds:
        return tree
    if isinstance(tree, str):
        return reveal(tree, creds)
    if isinstance(tree, Mapping):
        return {k: reveal_tree(v, creds) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [reveal_tree(v, creds) for v in tree]
    return tree


def is_masked(text: str) -> bool:
    """Whether ``text`` holds a URI whose credential is masked (what :func:`reveal` had nothing for)."""
    return any(f":{MASK}@" in u or f"={MASK}" in u for u in _URI.findall(text))


def still_masked(tree: Any, prefix: str = "") -> list[str]:
    """The dotted names of the fields of ``tree`` that hold a masked credential (what a job was not given)."""
    if isinstance(tree, Mapping):
        return [f for k, v in tree.items() for f in still_masked(v, f"{prefix}{k}.")]
    if isinstance(tree, list | tuple):
        return [f for i, v in enumerate(tree) for f in still_masked(v, f"{prefix}{i}.")]
    if isinstance(tree, str) and is_masked(tree):
        return [prefix.rstrip(".")]
    return []


def export_credentials(values: list[str]) -> list[str]:
    """``values`` masked (a command's ``--set`` overrides, say, before they become a flow run's parameters, which
    Prefect stores and shows), their credentials added to this process's ``UNBROKEN_CREDENTIALS`` so that the config
    loaded from them is revealed again."""
    found = credentials_in(values)
    if found:
        os.environ[CREDENTIALS_ENV] = " ".join(dict.fromkeys([*env_credentials(), *found]))
    return [mask(v, ()) for v in values]  # URIs only: a value masked for being an environment's is lost


class MaskedError(Exception):
    """A base of exceptions whose message is masked when made: their text becomes a flow run's state message, an
    incident in a run record, a log line, and may quote a URI (a source's, a cluster's address)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(mask(a) if isinstance(a, str) else a for a in args))


# -- what a process prints -------------------------------------------------------------------------------------
_installed: list[str] = []


def mask_logs() -> None:
    """Every log record this process makes from now on is masked, its message and the traceback it carries: the one
    hook through which a library's message quoting a URI (MLflow's "API request to http://user:pass@... failed"), the
    Prefect run logs and the console are kept clean. Idempotent."""
    if "logs" in _installed:
        return
    base = logging.getLogRecordFactory()

    def masked_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        return _masked(base(*args, **kwargs))

    logging.setLogRecordFactory(masked_record)
    _installed.append("logs")


def _masked(record: logging.LogRecord) -> logging.LogRecord:
    try:
        message = record.getMessage()
    except Exception:  # a broken format string: logging reports it itself when the record is handled
        return record
    if (clean := mask(message)) != message:
        record.msg, record.args = clean, None
    if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
        record.exc_text = mask(logging.Formatter().formatException(record.exc_info))
    return record


class _MaskedStream:
    """A text stream whose writes are masked; everything else is the stream's own."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(mask(text))
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def mask_output() -> None:
    """What a job process prints is masked too (its stdout and stderr: tracebacks, ``print``, the lines Ray forwards
    from the job's other processes), besides its log records. Idempotent."""
    mask_logs()
    if "streams" in _installed:
        return
    sys.stdout, sys.stderr = _MaskedStream(sys.stdout), _MaskedStream(sys.stderr)
    _installed.append("streams")
