"""Who is at the browser: the owner token that makes sessions theirs, and the optional server token.

Each browser keeps a random secret, its owner token, in a cookie (`layerscope_owner`, a year, SameSite=Strict).
A session records the sha256 of it (`session.model.owner_hash`), never the token, and is editable only by the
browser holding it (`Session.editable_by`); the Sessions page lists that browser's sessions only. A cookie is
read when the browser connects (`st.context.cookies`), so a new browser gets its token in its first run and
keeps it in `st.session_state` until the cookie comes back with the next page load.

`LAYERSCOPE_TOKEN`, when set, is a password for the whole server: the app asks for it before anything else and
then remembers the browser (a cookie holding a hash of it, so the token itself never sits in a cookie).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets

import streamlit as st

from layerscope.session.model import owner_hash

OWNER_COOKIE = "layerscope_owner"
AUTH_COOKIE = "layerscope_auth"
OWNER_KEY = "ls_owner_token"        # st.session_state: this browser's owner token
AUTH_KEY = "ls_authorized"          # st.session_state: this tab gave the server token
TOKEN_ENV = "LAYERSCOPE_TOKEN"
TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{32,128}")
COOKIE_AGE_S = 365 * 24 * 3600


def owner_token() -> str:
    """This browser's owner token: kept in the tab, else its cookie, else a new one (which `remember` stores)."""
    token = st.session_state.get(OWNER_KEY)
    if not token:
        token = _cookie(OWNER_COOKIE)
        if not (isinstance(token, str) and TOKEN_RE.fullmatch(token)):
            token = secrets.token_urlsafe(32)
        st.session_state[OWNER_KEY] = token
    return token


def _cookie(name: str) -> str | None:
    """A cookie the browser sent when it connected (None when it sent none, or outside a browser)."""
    value = st.context.cookies.get(name)
    return value if isinstance(value, str) else None


def me() -> str:
    """The owner hash of this browser: what its sessions record."""
    return owner_hash(owner_token())


# ---------------------------------------------------------------------------- the server token

def server_token() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


def token_ok(given: str, expected: str) -> bool:
    """Whether a typed token is the server's (compared in constant time)."""
    return hmac.compare_digest(_digest(given), _digest(expected))


def auth_cookie_value(expected: str) -> str:
    """What the auth cookie holds for a server token: a hash of it, so the cookie never carries the token."""
    return hashlib.sha256(f"layerscope-auth:{expected}".encode()).hexdigest()


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def authorized() -> bool:
    """No server token, or this tab gave it, or this browser's auth cookie holds its hash."""
    expected = server_token()
    if expected is None or st.session_state.get(AUTH_KEY):
        return True
    if hmac.compare_digest(_cookie(AUTH_COOKIE) or "", auth_cookie_value(expected)):
        st.session_state[AUTH_KEY] = True
        return True
    return False


def gate() -> None:
    """With LAYERSCOPE_TOKEN set, ask for it before anything else: nothing of any session shows until it is given."""
    if authorized():
        return
    st.title("LayerScope")
    st.caption("This server asks for its access token (LAYERSCOPE_TOKEN) before it opens.")
    with st.form("ls_access"):
        typed = st.text_input("Access token", type="password", key="ls_access_token")
        sent = st.form_submit_button("Open LayerScope", type="primary")
    if sent:
        if token_ok(typed, server_token()):
            st.session_state[AUTH_KEY] = True
            st.rerun()
        st.error("**That is not this server's access token.** Ask whoever runs it for the token.")
    st.stop()


# ---------------------------------------------------------------------------- cookies

def remember() -> None:
    """Store this browser's tokens in its cookies while the browser does not send them yet (its first visit,
    or right after the access token was given)."""
    wanted = {OWNER_COOKIE: owner_token()}
    expected = server_token()
    if expected is not None and st.session_state.get(AUTH_KEY):
        wanted[AUTH_COOKIE] = auth_cookie_value(expected)
    missing = {k: v for k, v in wanted.items() if _cookie(k) != v}
    if missing:
        st.html(cookie_script(missing), unsafe_allow_javascript=True)


def cookie_script(cookies: dict[str, str]) -> str:
    """A script that sets each cookie for the whole app (values are URL-safe tokens and hex: no escaping needed)."""
    for v in cookies.values():
        if not re.fullmatch(r"[A-Za-z0-9_-]+", v):
            raise ValueError("cookie values are tokens")
    lines = "".join(f"document.cookie = '{k}={v}; path=/; max-age={COOKIE_AGE_S}; SameSite=Strict' + secure;\n"
                    for k, v in cookies.items())
    return f"<script>\nconst secure = location.protocol === 'https:' ? '; Secure' : '';\n{lines}</script>"
