"""The access token: with one, nothing but the stylesheet is readable without it."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from review.helpers import fetch, serving
from toolguard.errors import ConfigurationError
from toolguard.review import create_app
from toolguard.review.security import COOKIE_NAME, TokenGate, cookie_value
from toolguard.store import GuardedStore, open_store

TOKEN = "s3cret-review-token-0123456789"


@pytest.fixture(scope="module")
def site(demo_home: dict) -> Iterator[str]:
    store = open_store(demo_home["url"])
    try:
        with serving(create_app(store, token=TOKEN)) as base:
            yield base
    finally:
        store.close()


@pytest.mark.parametrize("path", ["/", "/?decision=all", "/entry/1", "/entry/999999", "/nowhere"])
def test_without_the_token_every_page_is_a_login_form(site: str, path: str) -> None:
    reply = fetch(site, path)
    assert reply.status == 401
    assert 'action="/login"' in reply.body and 'type="password"' in reply.body
    assert "stale_fencing_token" not in reply.body and "lead_enricher" not in reply.body
    assert reply.headers["content-security-policy"].startswith("default-src 'none'")


@pytest.mark.parametrize("header", [f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", "Bearer ",
                                    f"Basic {TOKEN}", TOKEN, f"Bearer {TOKEN.upper()}"])
def test_a_wrong_bearer_is_refused(site: str, header: str) -> None:
    assert fetch(site, headers={"Authorization": header}).status == 401


def test_the_bearer_header_opens_every_page(site: str) -> None:
    for path in ("/", "/entry/1"):
        reply = fetch(site, path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert reply.status == 200, path
    assert "stale_fencing_token" in fetch(site, headers={"Authorization": f"bearer {TOKEN}"}).body


def test_login_sets_a_cookie_that_is_not_the_token_and_drops_it_from_the_url(site: str) -> None:
    wrong = fetch(site, "/login?token=guess-guess-guess-guess")
    assert wrong.status == 401 and "not this page" in wrong.body and "set-cookie" not in wrong.headers
    assert fetch(site, "/login").status == 401
    login = fetch(site, f"/login?token={TOKEN}")
    assert login.status == 303 and login.headers["location"] == "/"
    cookie = login.headers["set-cookie"]
    assert TOKEN not in cookie
    assert re.fullmatch(rf"{COOKIE_NAME}=[0-9a-f]{{64}}; Path=/; HttpOnly; SameSite=Lax", cookie), cookie
    value = cookie.split(";", 1)[0]
    assert fetch(site, headers={"Cookie": value}).status == 200
    assert fetch(site, headers={"Cookie": f"other=1; {value}"}).status == 200
    assert fetch(site, headers={"Cookie": f"{COOKIE_NAME}={TOKEN}"}).status == 401
    assert fetch(site, headers={"Cookie": f"{COOKIE_NAME}={cookie_value(TOKEN + 'x')}"}).status == 401
    assert fetch(site, headers={"Cookie": 'bad"cookie;;=='}).status == 401


def test_behind_a_local_tls_proxy_the_cookie_is_secure(site: str) -> None:
    login = fetch(site, f"/login?token={TOKEN}", headers={"X-Forwarded-Proto": "https"})
    assert login.status == 303 and login.headers["set-cookie"].endswith("; SameSite=Lax; Secure")


def test_the_stylesheet_needs_no_token(site: str) -> None:
    reply = fetch(site, "/static/review.css")
    assert reply.status == 200 and "text/css" in reply.headers["content-type"]


def test_with_a_token_any_host_name_may_be_used(site: str) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    assert fetch(site, headers=headers, host="review.internal.example:8765").status == 200
    assert fetch(site, host="review.internal.example:8765").status == 401


@pytest.mark.parametrize("token", ["", "short", "x" * 15])
def test_a_short_token_is_refused_when_the_app_is_built(demo_store: GuardedStore, token: str) -> None:
    with pytest.raises(ConfigurationError, match="at least 16 characters"):
        create_app(demo_store, token=token)
    with pytest.raises(ConfigurationError):
        TokenGate(lambda *a: None, token=token)  # type: ignore[arg-type]
