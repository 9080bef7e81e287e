"""Credentials never written (ray_jobs/secrets.py): one masking rule for every URI, query and environment secret, its
inverse from ``UNBROKEN_CREDENTIALS``, and what a process prints or logs."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from ray_jobs import secrets
from ray_jobs.secrets import CREDENTIALS_ENV, mask, mask_tree, reveal, reveal_tree

# (what a run might hold, what it may write of it)
MASKED = [
    ("postgresql://user:pass@db/mlflow", "postgresql://user:***@db/mlflow"),
    ("http://alice:s3cr3t@mlflow:5000", "http://alice:***@mlflow:5000"),
    ("https://u:p@ss@host:443/x?y=1", "https://u:***@host:443/x?y=1"),  # an unescaped '@' in the password
    ("mysql+pymysql://root:hunter2@127.0.0.1:3306/db", "mysql+pymysql://root:***@127.0.0.1:3306/db"),
    ("mongodb+srv://u:p@c.x.net/?authSource=admin", "mongodb+srv://u:***@c.x.net/?authSource=admin"),
    ("sftp://me:pw@[::1]:22/data", "sftp://me:***@[::1]:22/data"),
    ("https://b.s3.amazonaws.com/d.jsonl?X-Amz-Date=1&X-Amz-Signature=abc&X-Amz-Credential=AK/1",
     "https://b.s3.amazonaws.com/d.jsonl?X-Amz-Date=1&X-Amz-Signature=***&X-Amz-Credential=***"),
    ("https://acct.blob.core.windows.net/c/f?sv=2022&sig=Zm9v", "https://acct.blob.core.windows.net/c/f?sv=2022&sig=***"),
    ("http://h/x?access_token=t1&api_key=k2&password=p3&client_secret=s4&page=2",
     "http://h/x?access_token=***&api_key=***&password=***&client_secret=***&page=2"),
    ("connecting to 'http://a:b@h1/x' and ftp://c:d@h2:21, then postgresql://e:f@h3",
     "connecting to 'http://a:***@h1/x' and ftp://c:***@h2:21, then postgresql://e:***@h3"),
    ("API request to http://alice:pw@127.0.0.1:9/api/2.0/mlflow/x failed",
     "API request to http://alice:***@127.0.0.1:9/api/2.0/mlflow/x failed"),
    # passwords SQLAlchemy takes as written (it reads up to the first '@'): '/', '?', '#', quotes
    ("postgresql://u:p/ss@db/mlflow", "postgresql://u:***@db/mlflow"),
    ("postgresql://u:p?ss@db:5432/x", "postgresql://u:***@db:5432/x"),
    ("mysql://u:p#ss@db/x", "mysql://u:***@db/x"),
    ("postgresql://u:pa'ss@db/x", "postgresql://u:***@db/x"),
    ('postgresql://u:pa"ss@db/x', "postgresql://u:***@db/x"),
    ("postgresql://u:a/b?c#d'e\"f@db:5432/mlflow?sslmode=require", "postgresql://u:***@db:5432/mlflow?sslmode=require"),
    ("MLflow at 'postgresql://u:p/q#r@db/m' failed", "MLflow at 'postgresql://u:***@db/m' failed"),
]  # fmt: skip
UNCHANGED = ["plain text", "/tmp/storage/runs/r/run.json", "s3://bucket/prefix/run.json", "http://host:8080/p?q=1",
             "ssh://git@github.com/org/repo", "user@example.com", "a=b&monkey=1", "key: value", "", "http://a:***@h",
             "sqlite:////tmp/s/mlflow.db", "https://h/x?tokens_per_s=3"]  # fmt: skip


@pytest.mark.parametrize(("text", "masked"), MASKED)
def test_a_credential_is_masked_wherever_it_is_and_masking_twice_changes_nothing(text: str, masked: str) -> None:
    assert mask(text, ()) == masked
    assert mask(masked, ()) == masked


@pytest.mark.parametrize("text", UNCHANGED)
def test_text_without_credentials_is_left_as_it_was(text: str) -> None:
    assert mask(text, ()) == text


@pytest.mark.parametrize(("text", "masked"), MASKED)
def test_the_credentials_given_reveal_what_masking_hid(text: str, masked: str) -> None:
    creds = secrets.credentials_in(text)
    assert creds and all(mask(c, ()) != c for c in creds)
    assert reveal(masked, creds) == text
    assert reveal(text, creds) == text, "revealing what is not masked changes nothing"


def test_a_password_is_revealed_only_for_the_same_scheme_user_and_host() -> None:
    creds = ["postgresql://user:pass@db:5432", "http://alice:s3cr3t@mlflow:5000"]
    assert reveal("postgresql://user:***@db:5432/other_db", creds) == "postgresql://user:pass@db:5432/other_db"
    for other in ("postgresql://user:***@db2:5432/x", "postgresql://bob:***@db:5432", "mysql://user:***@db:5432",
                  "postgresql://user:***@db:5433", "http://alice:***@mlflow:5001"):  # fmt: skip
        assert reveal(other, creds) == other, other
    # a query secret only where the whole URI matches: it belongs to that URL, not to its host
    assert reveal("https://h/a?sig=***", ["https://h/b?sig=x"]) == "https://h/a?sig=***"


def test_secret_environment_values_and_the_ray_token_are_masked(tmp_path, monkeypatch) -> None:
    token = tmp_path / "auth_token"
    token.write_text("ray-token-0123456789\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))  # names where the token is: its value is left alone
    monkeypatch.setenv("MY_SERVICE_API_TOKEN", "tok-abcdefgh")
    monkeypatch.setenv("SOME_KEY", "short")  # under 8 characters: masking it would mangle every line
    monkeypatch.setenv(CREDENTIALS_ENV, "http://u:pw-0123456789@h")
    text = f"token ray-token-0123456789 at {token}, tok-abcdefgh, short, pw-0123456789 alone"
    assert mask(text) == f"token *** at {token}, ***, short, *** alone"


def test_a_tree_is_masked_in_every_string_and_nothing_else() -> None:
    tree = {"a": ["x http://u:p@h y", 3, None, {"http://k:v@h": 1.5}], "b": True, "c": ("s3://b/k",)}
    assert mask_tree(tree, ()) == {"a": ["x http://u:***@h y", 3, None, {"http://k:***@h": 1.5}], "b": True,
                                   "c": ["s3://b/k"]}  # fmt: skip
    assert reveal_tree(mask_tree(tree, ()), secrets.credentials_in(tree))["a"][0] == tree["a"][0]


def test_a_jobs_environment_carries_the_credentials_of_its_config_and_of_its_submitter(monkeypatch) -> None:
    monkeypatch.setenv(CREDENTIALS_ENV, "https://r:x@ray.example.com")
    env = secrets.job_env({"tracking": "postgresql://u:p@db/m", "data": ["s3://b/k", "postgresql://u:p@db/m"]})
    assert env == {CREDENTIALS_ENV: "postgresql://u:p@db/m https://r:x@ray.example.com"}
    monkeypatch.delenv(CREDENTIALS_ENV)
    assert secrets.job_env({"storage": "/tmp/s"}) == {}


def test_overrides_are_masked_and_their_credentials_kept_in_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(CREDENTIALS_ENV, "http://a:b@c")
    out = secrets.export_credentials(["train.max_steps=5", "tracking.mlflow.tracking_uri=http://u:p@h:5000"])
    assert out == ["train.max_steps=5", "tracking.mlflow.tracking_uri=http://u:***@h:5000"]
    assert secrets.env_credentials() == ["http://a:b@c", "http://u:p@h:5000"]


def test_the_fields_a_job_was_not_given_are_named() -> None:
    tree = {"tracking": {"mlflow": {"tracking_uri": "http://u:***@h"}}, "data": {"train": ["https://h/f?sig=***"]},
            "storage": "/tmp/s"}  # fmt: skip
    assert secrets.still_masked(tree) == ["tracking.mlflow.tracking_uri", "data.train.0"]


def test_a_log_record_is_masked_with_the_traceback_it_carries() -> None:
    try:
        raise ConnectionError("API request to http://alice:pw@h:9/api failed")
    except ConnectionError:
        record = logging.LogRecord("x", logging.WARNING, __file__, 1, "tracker %s: %s", ("mlflow", "http://a:b@h"),
                                   sys.exc_info())  # fmt: skip
    out = logging.Formatter().format(secrets._masked(record))
    assert "tracker mlflow: http://a:***@h" in out and "http://alice:***@h:9/api" in out
    assert ":pw@" not in out and ":b@" not in out


def test_what_a_job_prints_is_masked() -> None:
    out = io.StringIO()
    stream = secrets._MaskedStream(out)
    assert stream.write('UNBROKEN_FAILURE {"message": "http://u:pw@h: refused"}\n') > 0
    stream.writelines(["see sftp://a:b@h\n"])
    assert out.getvalue() == 'UNBROKEN_FAILURE {"message": "http://u:***@h: refused"}\nsee sftp://a:***@h\n'
    assert stream.getvalue() == out.getvalue(), "everything else is the stream's own"
