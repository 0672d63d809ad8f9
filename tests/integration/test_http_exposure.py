"""A server safe to expose: API keys, TLS, CORS and the body limit, on a real process.

One server for most tests: ``--api-key`` twice, HTTPS with a self-signed certificate made here with the
``openssl`` CLI, one allowed CORS origin, a 1 MB body limit and debug logging (so the test can check that
no key reaches the log at any level, and no prompt at info level).  Clients: the ``openai`` SDK for the key
checks, ``httpx`` for raw preflights and TLS.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from harness.proc import DynamoRun, run_cli

pytestmark = pytest.mark.timeout(120)

KEYS = ("sk-first-0123456789", "sk-second-abcdefghij")
ORIGIN = "https://app.example.com"
SECRET_PROMPT = "the-secret-prompt-words"


class ExposedRun(DynamoRun):
    """``DynamoRun`` that knows it may be HTTPS and that /v1/models needs a key: readiness from /live."""

    def __init__(self, *args: str, ca: Path | None = None, **kw) -> None:
        self.ca = ca
        super().__init__(*args, **kw)

    @property
    def base_url(self) -> str:
        scheme = "https" if self.ca else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def _serving(self) -> bool:
        try:
            return httpx.get(self.base_url + "/live", verify=self.verify, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def verify(self) -> ssl.SSLContext | bool:
        return ssl.create_default_context(cafile=str(self.ca)) if self.ca else True


def make_certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=30,
    )
    return cert, key


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def server(tls_files: tuple[Path, Path]) -> Iterator[ExposedRun]:
    cert, key = tls_files
    with ExposedRun("out=echo_full", "--model-name", "echo", "--api-key", KEYS[0], "--api-key", KEYS[1],
                    "--tls-cert-path", str(cert), "--tls-key-path", str(key), "--allowed-origins", ORIGIN,
                    ca=cert, env={"DYN_LOG": "debug", "DYN_HTTP_BODY_LIMIT_MB": "1"}) as srv:
        yield srv


def sdk(server: ExposedRun, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key=key, max_retries=0, timeout=30,
                         http_client=httpx.Client(verify=server.verify))


def http(server: ExposedRun) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, verify=server.verify, timeout=30)


# -- API keys ---------------------------------------------------------------------------------------------


def test_every_configured_key_works_over_https(server: ExposedRun):
    for key in KEYS:
        r = sdk(server, key).chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content == "hi"


def test_a_wrong_key_is_an_authentication_error(server: ExposedRun):
    client = sdk(server, "sk-wrong")
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model="echo", messages=[{"role": "user", "content": SECRET_PROMPT}])
    err = info.value.body
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    assert "sk-wrong" not in err["message"]  # what was sent is not echoed
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    with pytest.raises(openai.AuthenticationError):
        client.embeddings.create(model="echo", input="x")
    with pytest.raises(openai.AuthenticationError):
        client.responses.create(model="echo", input="x")
    # a prefix of a real key, or a key with something appended, is just as wrong
    for near in (KEYS[0][:-1], KEYS[0] + "x"):
        with pytest.raises(openai.AuthenticationError):
            sdk(server, near).models.list()


def test_no_key_is_401_on_every_api_route_but_operational_ones_stay_open(server: ExposedRun):
    with http(server) as c:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                             ("POST", "/v1/embeddings"), ("POST", "/v1/responses"), ("POST", "/tokenize"),
                             ("POST", "/detokenize"), ("GET", "/v1/no-such-route")):
            r = c.request(method, path, json={})
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
        r = c.get("/v1/models", headers={"Authorization": f"Basic {KEYS[0]}"})  # the wrong scheme
        assert r.status_code == 401
        for path in ("/health", "/live", "/metrics"):
            assert c.get(path).status_code == 200, path
        r = c.get("/v1/models", headers={"Authorization": f"Bearer {KEYS[1]}"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "echo"


def test_keys_and_prompts_never_reach_the_log(server: ExposedRun):
    sdk(server, KEYS[0]).chat.completions.create(model="echo", messages=[{"role": "user", "content": SECRET_PROMPT}])
    with pytest.raises(openai.AuthenticationError):
        sdk(server, "sk-wrong-logged?").models.list()
    log = server.stderr_text()
    assert "listening on https://" in log
    assert "wrong API key" in log  # the rejection is logged ...
    for secret in (*KEYS, "sk-wrong-logged?"):  # ... but no key, at any level (the server logs at debug)
        assert secret not in log
    info_and_up = [line for line in log.splitlines() if " DEBUG " not in line and " TRACE " not in line]
    assert not [line for line in info_and_up if SECRET_PROMPT in line]  # and no prompt text at info level


# -- TLS --------------------------------------------------------------------------------------------------


def test_tls_certificate_is_served_and_plain_http_is_refused(server: ExposedRun, tls_files):
    cert, _ = tls_files
    with httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=10) as c:
        assert c.get(f"https://localhost:{server.port}/live").status_code == 200  # the name in the cert
    with pytest.raises(httpx.ConnectError):  # not trusted without the CA
        httpx.get(server.base_url + "/live", timeout=10)
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets no HTTP answer
        httpx.get(f"http://127.0.0.1:{server.port}/live", timeout=10)


# -- CORS -------------------------------------------------------------------------------------------------


def preflight(c: httpx.Client, path: str, origin: str, method: str = "POST",
              headers: str = "authorization,content-type") -> httpx.Response:
    return c.request("OPTIONS", path, headers={"Origin": origin, "Access-Control-Request-Method": method,
                                               "Access-Control-Request-Headers": headers})


def test_cors_preflight_for_an_allowed_origin(server: ExposedRun):
    with http(server) as c:
        r = preflight(c, "/v1/chat/completions", ORIGIN)  # no key: browsers send none on a preflight
        assert r.status_code == 204, r.text
        assert r.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert "POST" in r.headers["Access-Control-Allow-Methods"]
        assert r.headers["Access-Control-Allow-Headers"] == "authorization,content-type"
        assert int(r.headers["Access-Control-Max-Age"]) > 0
        assert "Origin" in r.headers["Vary"]
        r = preflight(c, "/v1/models", ORIGIN, method="GET")
        assert r.status_code == 204 and "GET" in r.headers["Access-Control-Allow-Methods"]
        # the actual request carries the header too, streamed or not, and so does a 401
        r = c.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEYS[0]}"})
        assert r.headers["Access-Control-Allow-Origin"] == ORIGIN
        body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=body,
                      headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEYS[0]}"}) as r:
            assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
            r.read()
        r = c.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 401 and r.headers["Access-Control-Allow-Origin"] == ORIGIN


def test_cors_refuses_other_origins_methods_and_paths(server: ExposedRun):
    with http(server) as c:
        r = preflight(c, "/v1/chat/completions", "https://evil.example.com")
        assert r.status_code == 403 and "Access-Control-Allow-Origin" not in r.headers
        r = c.get("/live", headers={"Origin": "https://evil.example.com"})
        assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers
        assert preflight(c, "/v1/chat/completions", ORIGIN, method="DELETE").status_code == 405
        assert preflight(c, "/v1/nothing-here", ORIGIN).status_code == 404


def test_no_cors_unless_asked(full_server: DynamoRun):
    with httpx.Client(base_url=full_server.base_url, timeout=10) as c:
        r = preflight(c, "/v1/chat/completions", ORIGIN)
        assert r.status_code == 405 and "Access-Control-Allow-Origin" not in r.headers
        r = c.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers


# -- body limit -------------------------------------------------------------------------------------------


def test_body_limit_from_the_environment(server: ExposedRun):
    big = "x" * (1024 * 1024 + 10)
    with http(server) as c:
        r = c.post("/v1/chat/completions", json={"model": "echo", "messages": [{"role": "user", "content": big}]},
                   headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert r.status_code == 413
        assert str(1024 * 1024) in r.json()["error"]["message"]
        small = "y" * (512 * 1024)
        r = c.post("/v1/completions", json={"model": "echo", "prompt": small, "max_tokens": 1},
                   headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert r.status_code == 200


# -- DYN_API_KEY and start-up errors ------------------------------------------------------------------------


def test_keys_from_the_environment():
    with ExposedRun("out=echo_full", "--model-name", "echo", env={"DYN_API_KEY": "env-a,env-b"}) as srv:
        for key in ("env-a", "env-b"):
            assert [m.id for m in sdk(srv, key).models.list()] == ["echo"]
        with pytest.raises(openai.AuthenticationError):
            sdk(srv, "env-a,env-b").models.list()


@pytest.mark.parametrize("args, env, message", [
    (["--tls-cert-path", "{cert}"], {}, "--tls-cert-path and --tls-key-path go together"),
    (["--tls-cert-path", "{key}", "--tls-key-path", "{key}"], {}, "cannot use --tls-cert-path"),
    (["--tls-cert-path", "{cert}", "--tls-key-path", "/nonexistent.pem"], {}, "no such file"),
    (["--api-key", ""], {}, "must not be empty"),
    (["--allowed-origins", "app.example.com"], {}, "is not an origin"),
    ([], {"DYN_HTTP_BODY_LIMIT_MB": "lots"}, "DYN_HTTP_BODY_LIMIT_MB"),
])
def test_bad_exposure_settings_are_one_line_errors(tls_files, args, env, message):
    cert, key = tls_files
    argv = ["in=http", "out=echo_full"] + [a.format(cert=cert, key=key) for a in args]
    r = run_cli(argv, env=env)
    assert r.returncode != 0
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_exposure_flags_need_in_http():
    r = run_cli(["in=stdin", "out=echo_full", "--api-key", "k"], input="hi")
    assert r.returncode != 0 and "only for in=http" in r.stderr and "Traceback" not in r.stderr
