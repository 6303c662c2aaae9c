"""``toolguard keys``: fence signing keys; ``toolguard fence reset``: recover a poisoned key.

``keys new --id k2 --out fence-k2.key`` writes a private key file (mode 0600,
never over an existing file) and prints the public key line a service adds to
``TOOLGUARD_FENCE_VERIFY_KEYS``; ``keys public FILE`` prints it again.
``fence reset KEY --to N`` sets a service's fence back (see
``toolguard.fences.reset``), refused while a lease on the key is live.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from toolguard.cli._common import (
    EXIT_FAILED,
    SchemaOption,
    TimeoutOption,
    UrlOption,
    console,
    fail,
    failures,
    open_cli_store,
    redact,
    resolve_store_url,
)
from toolguard.cli.db import LockUrlOption, resolve_lock_url
from toolguard.cli.pause import ByOption, operator_name
from toolguard.errors import ToolGuardError

__all__ = ["fence_app", "keys_app"]

keys_app = typer.Typer(help="Fence signing keys: make one, print its public key.",
                       no_args_is_help=True, rich_markup_mode=None)
fence_app = typer.Typer(help="Operate on a fenced service's fences (recover a poisoned key).",
                        no_args_is_help=True, rich_markup_mode=None)


@keys_app.command("new")
def new(
    key_id: Annotated[str, typer.Option(
        "--id", metavar="KEY_ID", help="The key id claims name (1-64 of A-Z a-z 0-9 _ -); a "
                                       "new id per rotation, e.g. k2.")],
    out: Annotated[Path, typer.Option(
        "--out", metavar="FILE", help="Where to write the private key (mode 0600; never "
                                      "overwritten).")],
    hmac: Annotated[bool, typer.Option(
        "--hmac", help="An HMAC-SHA256 shared secret instead of an Ed25519 key pair: the same "
                       "file then goes to the guards and the service.")] = False,
) -> None:
    """Make a fence signing key: the guards load the file, the service the printed line."""
    from toolguard.fences.keys import fingerprint, generate_signing_key, write_signing_key

    with failures("keys new"):
        key = generate_signing_key(key_id, "hmac-sha256" if hmac else "ed25519")
        path = write_signing_key(key, out)
    err = console(stderr=True)
    if hmac:
        err.print(f"wrote the HMAC secret {key_id!r} (fingerprint {fingerprint(key)}) to {path} "
                  f"(mode 0600): give this same file to the service "
                  f"(TOOLGUARD_FENCE_VERIFY_KEYS_FILE); it signs as well as verifies",
                  markup=False, soft_wrap=True)
        return
    err.print(f"wrote the private key {key_id!r} to {path} (mode 0600): the guards load it "
              f"(TOOLGUARD_FENCE_SIGNING_KEY_FILE). The service adds this public key to "
              f"TOOLGUARD_FENCE_VERIFY_KEYS:", markup=False, soft_wrap=True)
    typer.echo(key.public().text())


@keys_app.command("public")
def public(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="A private key file.")],
) -> None:
    """Print the public key line of a private key file (for the service's keyring)."""
    from toolguard.fences.keys import load_signing_key

    with failures("keys public"):
        key = load_signing_key(file)
    if key.algorithm == "hmac-sha256":
        fail(f"{file} is an HMAC secret: it has no public half; the service needs the same "
             f"file", EXIT_FAILED)
    typer.echo(key.public().text())


@fence_app.command("reset")
def reset(
    key: Annotated[str, typer.Argument(metavar="KEY", help="The lock key, e.g. lead:L-7.")],
    to: Annotated[int, typer.Option(
        "--to", metavar="N", help="The fence's new value: a token the lock server has "
                                  "already passed (the output names one).")],
    by: ByOption = None,
    url: UrlOption = None, schema: SchemaOption = None, lock_url: LockUrlOption = None,
    timeout: TimeoutOption = 5.0,
) -> None:
    """Set the service's fence on KEY back to N (the store is the service's, --url).

    Refused while a lease on KEY is live on the lock server (--lock-url): the
    command takes the key's lock itself for the reset. Audited with who did it.
    """
    from toolguard.fences.reset import reset_fence
    from toolguard.locks import connect

    store_url, locks_url = resolve_store_url(url), resolve_lock_url(lock_url)
    with failures(redact(store_url)):
        store = open_cli_store(store_url, schema, timeout, create=False)
        try:
            locks = connect(locks_url)
            try:
                done = reset_fence(store, locks, key, to, by=operator_name(by))
            except ToolGuardError as error:
                if error.reason != "fence_reset_refused":
                    raise
                fail(str(error), EXIT_FAILED)
            finally:
                locks.close()
        finally:
            store.close()
    out = console()
    before = done.before or "none"
    out.print(f"fence of {done.key}: {before} -> {done.after} (by {done.by}, audited)",
              markup=False, soft_wrap=True)
    if done.after > done.lease_token:
        console(stderr=True).print(
            f"warning: {done.after} is above the lock's current token {done.lease_token}: "
            f"holders stay refused until the lock's tokens pass it", style="yellow",
            markup=False, soft_wrap=True)
