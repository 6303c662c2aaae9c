"""``toolguard mcp``: the MCP gateway (``proxy``), its policy check (``check``), the example.

``proxy`` serves stdio (a desktop client launches it) or streamable HTTP
(``--listen``) in front of one upstream MCP server, a command after ``--`` or
``--upstream URL``; locks and store default to the embedded SQLite files, as
for ``toolguard demo``. Off loopback, ``--listen`` needs ``--token`` or OAuth
(``--jwks-url``); every listening gateway checks Host and Origin and the
credential before any MCP processing (``toolguard.gateway.door``). Start-up
problems (a schema toolguard cannot enforce, a policy template naming an
argument the upstream lacks, an unreachable upstream) exit 2 with one line
each. Needs the ``mcp`` extra. See docs/gateway.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from toolguard.cli._common import EXIT_FAILED, EXIT_USAGE, console, fail, failures, redact
from toolguard.runtime.extras import install_hint

#: Where ``--token`` is read from when not given (kept in step with ``toolguard.gateway.server``).
TOKENS_ENV = "TOOLGUARD_GATEWAY_TOKENS"
#: The least time between two JWKS fetches for an unknown key id (seconds, default 30).
JWKS_REFRESH_ENV = "TOOLGUARD_GATEWAY_JWKS_REFRESH_S"

if TYPE_CHECKING:
    from toolguard.gateway import Identity, Upstream
    from toolguard.gateway.door import Door
    from toolguard.gateway.oauth import OAuthSettings

__all__ = ["mcp_app"]

mcp_app = typer.Typer(name="mcp", no_args_is_help=True, pretty_exceptions_enable=False,
                      help="The MCP gateway: toolguard in front of any MCP server.")

PolicyOption = Annotated[Path, typer.Option(
    "--policy", metavar="FILE", exists=True, readable=True, show_default=False,
    help="The policy file (or folder) that decides every tools/call.")]
UpstreamOption = Annotated[str | None, typer.Option(
    "--upstream", metavar="URL", show_default=False,
    help="A streamable-HTTP upstream (http://host:port/mcp) instead of a command after --.")]
CommandArgument = Annotated[list[str] | None, typer.Argument(
    metavar="-- COMMAND...", show_default=False,
    help="The upstream MCP server's command (stdio), after --.")]
StoreOption = Annotated[str | None, typer.Option(
    "--store", metavar="URL", envvar="TOOLGUARD_DATABASE_URL", show_default=False,
    help="The guarded store (audit log, idempotency, approvals): postgresql:// or sqlite:///. "
         "Default: ./.toolguard/store.db.")]
LocksOption = Annotated[str | None, typer.Option(
    "--locks", metavar="URL", show_default=False,
    help="The lock backend: redis://, postgresql://, etcd:// or sqlite:///. Default: "
         "TOOLGUARD_LOCK_URL / TOOLGUARD_REDIS_URL, else ./.toolguard/locks.db.")]
AgentOption = Annotated[str | None, typer.Option(
    "--agent", metavar="NAME", show_default=False,
    help="The agent every call through this gateway runs as (a stdio client's identity).")]
TokenOption = Annotated[list[str] | None, typer.Option(
    "--token", metavar="AGENT:TOKEN", envvar=TOKENS_ENV, show_envvar=True,
    show_default=False,
    help="With --listen: a bearer token and the agent it identifies (16 characters or more). "
         "Repeatable. With tokens, a request without a known token is answered 401 before "
         "any MCP processing.")]
ListenOption = Annotated[str | None, typer.Option(
    "--listen", metavar="HOST:PORT", show_default=False,
    help="Serve streamable HTTP at http://HOST:PORT/mcp instead of stdio.")]
AllowHostOption = Annotated[list[str] | None, typer.Option(
    "--allow-host", metavar="NAME", envvar="TOOLGUARD_GATEWAY_ALLOWED_HOSTS", show_envvar=True,
    show_default=False,
    help="With --listen: another Host name to answer (a DNS name, a reverse proxy's; "
         "*.example.com works). Repeatable. By default only the listen address and, on "
         "loopback, localhost: a request for any other Host is refused 421 (DNS rebinding).")]
AllowOriginOption = Annotated[list[str] | None, typer.Option(
    "--allow-origin", metavar="ORIGIN", envvar="TOOLGUARD_GATEWAY_ALLOWED_ORIGINS",
    show_envvar=True, show_default=False,
    help="With --listen: a browser origin allowed to call the gateway "
         "(https://app.example.com). Repeatable. Any other Origin than the request's own "
         "is refused 403.")]
JwksOption = Annotated[str | None, typer.Option(
    "--jwks-url", metavar="URL", envvar="TOOLGUARD_GATEWAY_JWKS_URL", show_envvar=True,
    show_default=False,
    help="With --listen: accept OAuth access tokens signed by the keys published at this "
         "JWKS URL (the authorization server's jwks_uri). Needs --issuer and --audience.")]
IssuerOption = Annotated[str | None, typer.Option(
    "--issuer", metavar="ISS", envvar="TOOLGUARD_GATEWAY_ISSUER", show_envvar=True,
    show_default=False, help="With --jwks-url: the tokens' issuer (iss), exactly.")]
TokenAudienceOption = Annotated[str | None, typer.Option(
    "--audience", metavar="AUD", envvar="TOOLGUARD_GATEWAY_AUDIENCE", show_envvar=True,
    show_default=False,
    help="With --jwks-url: the audience (aud) tokens must be issued for: this gateway.")]
AgentClaimOption = Annotated[str | None, typer.Option(
    "--agent-claim", metavar="CLAIM", envvar="TOOLGUARD_GATEWAY_AGENT_CLAIM", show_envvar=True,
    show_default=False,
    help="With --jwks-url: the claim naming the agent a call runs as (default: sub).")]
AlgorithmOption = Annotated[str | None, typer.Option(
    "--jwt-algorithm", metavar="ALG", envvar="TOOLGUARD_GATEWAY_JWT_ALGORITHM",
    show_envvar=True, show_default=False,
    help="With --jwks-url: the one signature algorithm accepted (default RS256; ES256, "
         "EdDSA...; never none or HS*).")]
ResourceOption = Annotated[str | None, typer.Option(
    "--resource-url", metavar="URL", envvar="TOOLGUARD_GATEWAY_RESOURCE_URL", show_envvar=True,
    show_default=False,
    help="With --listen: the gateway's public URL of /mcp, as clients reach it behind a "
         "proxy (default http://HOST:PORT/mcp); its host is answered too.")]
HideOption = Annotated[bool, typer.Option(
    "--hide-unlisted", help="List only the tools the policy lets this agent call.")]
AudienceOption = Annotated[str | None, typer.Option(
    "--sign-for", metavar="AUDIENCE", show_default=False,
    help="Sign the fences forwarded upstream for this audience (the upstream service's name, "
         "as its ClaimVerifier has it), for an upstream in signed mode. The key: --signing-key, "
         "else TOOLGUARD_FENCE_SIGNING_KEY or TOOLGUARD_FENCE_SIGNING_KEY_FILE.")]
SigningKeyOption = Annotated[Path | None, typer.Option(
    "--signing-key", metavar="FILE", show_default=False,
    help="With --sign-for: the private key file `toolguard keys new` wrote (mode 0600).")]
ElicitOption = Annotated[bool, typer.Option(
    "--elicit/--no-elicit",
    help="Ask the person through MCP elicitation when a call needs approval and the client "
         "supports it (else the call is refused approval_required, with an id for "
         "`toolguard approve`).")]


def _need_extra() -> None:
    try:
        import fastmcp  # noqa: F401
    except ImportError as error:
        fail(f"toolguard mcp needs the mcp extra ({error.name} is missing): {install_hint('mcp')}",
             EXIT_USAGE)


def _upstream(command: list[str] | None, url: str | None) -> Upstream:
    from toolguard.gateway import Upstream

    with failures("upstream"):
        return Upstream(command=tuple(command or ()), url=url)


def _listen_address(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        fail(f"--listen takes HOST:PORT (e.g. 127.0.0.1:8931), got {listen!r}", EXIT_USAGE)
    return host.strip("[]"), int(port)


def _identity(agent: str | None, tokens: list[str] | None, listen: str | None,
              oauth: OAuthSettings | None = None) -> Identity:
    from toolguard.gateway import Identity
    from toolguard.gateway.door import is_loopback
    from toolguard.gateway.identity import parse_token

    with failures("identity"):
        mapping: dict[str, str] = {}
        for text in tokens or ():
            named, secret = parse_token(text)
            mapping[secret] = named
        identity = Identity(agent=agent, tokens=mapping, oauth=oauth)
    if identity.credentials and listen is None:
        fail("--token and OAuth identify HTTP clients: give --listen HOST:PORT too (a stdio "
             "client is named with --agent)", EXIT_USAGE)
    if identity.credentials and agent is not None:
        fail("--agent names the one client of a gateway without credentials; with --token or "
             "OAuth each request's agent comes from its credential", EXIT_USAGE)
    if agent is None and not identity.credentials:
        fail("give --agent NAME (or --listen with --token AGENT:TOKEN or OAuth): without an "
             "agent identity every call would be refused", EXIT_USAGE)
    if listen is not None and not identity.credentials \
            and not is_loopback(_listen_address(listen)[0]):
        fail(f"{listen} is not a loopback address: anyone who reaches it would call the upstream "
             f"as {agent!r}. Give --token AGENT:TOKEN or OAuth, or listen on 127.0.0.1.",
             EXIT_USAGE)
    return identity


def _oauth(jwks_url: str | None, issuer: str | None, audience: str | None,
           agent_claim: str | None, algorithm: str | None) -> OAuthSettings | None:
    """The OAuth settings, when --jwks-url is given (None otherwise)."""
    if jwks_url is None:
        given = [name for name, value in (("--issuer", issuer), ("--audience", audience),
                                          ("--agent-claim", agent_claim)) if value]
        if given:
            fail(f"{', '.join(given)} configure OAuth: give --jwks-url URL too", EXIT_USAGE)
        return None
    from toolguard.gateway.oauth import OAuthSettings

    refresh = os.environ.get(JWKS_REFRESH_ENV)
    with failures("oauth"):
        try:
            refresh_s = float(refresh) if refresh else 30.0
        except ValueError:
            fail(f"{JWKS_REFRESH_ENV} takes seconds, got {refresh!r}", EXIT_USAGE)
        return OAuthSettings(jwks_url=jwks_url, issuer=issuer or "", audience=audience or "",
                             agent_claim=agent_claim or "sub", algorithm=algorithm or "RS256",
                             jwks_refresh_s=refresh_s)


def _say(text: str) -> None:
    """Status lines go to stderr: over stdio, stdout is the MCP connection."""
    console(stderr=True).print(text, markup=False, soft_wrap=True)


def _signer(audience: str | None, key_file: Path | None) -> Any:
    """The gateway's ``FenceSigner`` (None: fences go upstream unsigned); a key that cannot
    be read is a ``FenceKeyError`` (exit 2, one line), before anything starts."""
    if audience is None:
        if key_file is not None:
            fail("--signing-key signs for an audience: give --sign-for AUDIENCE too", EXIT_USAGE)
        return None
    from toolguard.fences import FenceSigner, load_signing_key

    return FenceSigner(load_signing_key(key_file), audience=audience)


def _door(listen: str | None, allow_host: list[str] | None,
          allow_origin: list[str] | None, resource_url: str | None = None) -> Door | None:
    """Where and for whom the gateway listens (None: stdio)."""
    from toolguard.gateway.door import Door, split_list

    if listen is None:
        if allow_host or allow_origin or resource_url:
            fail("--allow-host, --allow-origin and --resource-url are for a gateway that "
                 "listens: give --listen HOST:PORT too", EXIT_USAGE)
        return None
    host, port = _listen_address(listen)
    with failures("listen"):
        return Door(host, port, allowed_hosts=split_list(allow_host),
                    allowed_origins=split_list(allow_origin), resource_url=resource_url)


async def _serve(policy_path: Path, upstream: Upstream, identity: Identity, *, store: str | None,
                 locks: str | None, door: Door | None, hide_unlisted: bool,
                 elicit: bool, signer: Any = None) -> None:
    from toolguard.gateway import open_gateway
    from toolguard.guard import ToolGuard
    from toolguard.locks import connect_async
    from toolguard.policies import load_policy
    from toolguard.store import open_async_store

    policy = load_policy(policy_path)
    guard = ToolGuard(policy, async_locks=connect_async(locks),
                      async_store=open_async_store(store, install=True))
    try:
        server = await open_gateway(guard, upstream, identity=identity,
                                    hide_unlisted=hide_unlisted, elicit=elicit, signer=signer,
                                    resource_url=door.url if door is not None else None)
        shown_store = redact(store) if store else "./.toolguard/store.db"
        if door is None:
            _say(f"toolguard gateway: stdio in front of {upstream.label} · policy {policy_path} "
                 f"· store {shown_store}")
            await server.run_async(transport="stdio", show_banner=False)
            return
        _say(f"toolguard gateway: {door.url} in front of {upstream.label} · "
             f"policy {policy_path} · store {shown_store} · Ctrl-C stops it")
        await door.serve(server)
    finally:
        await _close(guard)


async def _close(guard: Any) -> None:
    for edge in (guard.async_store, guard.async_locks):
        close = getattr(edge, "aclose", None) or getattr(edge, "close", None)
        if close is None:
            continue
        try:
            result = close()
            if asyncio.iscoroutine(result):
                await result
        except Exception as error:  # closing on the way out: say it, never hide the real exit
            _say(f"toolguard gateway: closing {type(edge).__name__}: {error}")


def _run(policy: Path, upstream: Upstream, identity: Identity, **options: Any) -> None:
    with failures("toolguard mcp"), contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(policy, upstream, identity, **options))


@mcp_app.command("proxy")
def proxy(policy: PolicyOption, command: CommandArgument = None, upstream: UpstreamOption = None,
          store: StoreOption = None, locks: LocksOption = None, agent: AgentOption = None,
          token: TokenOption = None, listen: ListenOption = None,
          allow_host: AllowHostOption = None, allow_origin: AllowOriginOption = None,
          jwks_url: JwksOption = None, issuer: IssuerOption = None,
          audience: TokenAudienceOption = None, agent_claim: AgentClaimOption = None,
          jwt_algorithm: AlgorithmOption = None, resource_url: ResourceOption = None,
          hide_unlisted: HideOption = False,
          elicit: ElicitOption = True, sign_for: AudienceOption = None,
          signing_key: SigningKeyOption = None) -> None:
    """Serve an MCP server in front of UPSTREAM: every tools/call guarded by the policy."""
    _need_extra()
    target = _upstream(command, upstream)
    oauth = _oauth(jwks_url, issuer, audience, agent_claim, jwt_algorithm)
    identity = _identity(agent, token, listen, oauth)
    door = _door(listen, allow_host, allow_origin, resource_url)
    with failures("toolguard mcp"):
        signer = _signer(sign_for, signing_key)
    _run(policy, target, identity, store=store, locks=locks, door=door,
         hide_unlisted=hide_unlisted, elicit=elicit, signer=signer)


@mcp_app.command("example")
def example(listen: ListenOption = None, agent: Annotated[str, typer.Option(
        "--agent", metavar="NAME", help="The agent the calls run as.")] = "example",
        store: StoreOption = None, locks: LocksOption = None,
        allow_host: AllowHostOption = None, allow_origin: AllowOriginOption = None) -> None:
    """The gateway in front of the bundled example server (a ticket board), with its policy."""
    _need_extra()
    from toolguard.gateway.example import POLICY_PATH, SERVER_MODULE

    target = _upstream([sys.executable, "-m", SERVER_MODULE], None)
    identity = _identity(agent, None, listen)
    door = _door(listen, allow_host, allow_origin)
    _run(POLICY_PATH, target, identity, store=store, locks=locks, door=door,
         hide_unlisted=False, elicit=True)


@mcp_app.command("check")
def check(policy: PolicyOption, command: CommandArgument = None,
          upstream: UpstreamOption = None) -> None:
    """Check a policy against an upstream's live tool list: missed tools, unknown arguments."""
    _need_extra()
    from toolguard.gateway import check_upstream, list_upstream_tools
    from toolguard.policies import load_policy

    target = _upstream(command, upstream)
    with failures("toolguard mcp check"):
        loaded = load_policy(policy)
        tools = asyncio.run(list_upstream_tools(target))
    report = check_upstream(loaded, tools)
    out = console()
    for name in report.missed:
        fate = ("runs unguarded (on_unknown_tool: allow)" if report.allow_unknown
                else "every call is refused unknown_tool")
        out.print(f"missed: {name}: listed by the upstream, not in the policy; {fate}",
                  markup=False, soft_wrap=True)
    for name in report.absent:
        out.print(f"absent: {name}: in the policy, not listed by the upstream", markup=False,
                  soft_wrap=True)
    for problem in report.problems:
        out.print(f"error: {problem}", markup=False, soft_wrap=True)
    for problem in report.unjudgeable:
        out.print(f"error: {problem}", markup=False, soft_wrap=True)
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)
    out.print(f"ok {policy}: {len(tools)} upstream tools, all covered by the policy",
              markup=False, soft_wrap=True)
