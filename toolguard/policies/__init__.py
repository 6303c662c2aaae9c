"""Policies: which agent may call which tool, on which resources, in which order.

A policy maps each tool call to lock keys rendered from its *validated*
arguments, and adds the rules the guard enforces before anything runs. Load it
with ``load_policy("policy.yml")`` (a file, a folder of ``*.yml``/``*.yaml``
files, or a list of either), ``Policy.from_dict(data)``, or build it in Python
with ``Policy(tools={"x": ToolPolicy(...)})``. A broken policy raises
``PolicyProblems`` (a ``PolicyError``) naming file, line and what is wrong;
``toolguard policy check FILE...`` prints every problem.

Policy file reference (version 1)
---------------------------------

.. code-block:: yaml

    version: 1                        # required in every file
    defaults:                         # inherited by every tool that does not set its own
      ttl_ms: 10000                   # lock TTL (> 0)
      wait_timeout_s: 5               # how long to wait for the locks
      after_wait_s: 5                 # how long to wait for an `after:` tool's record
      on_unknown_tool: deny           # deny | allow  (allow: runs unlocked, still audited)
      agents: ["*"]                   # who may call a tool that has no agents: of its own
      fenced: true
      idempotency_scope: thread       # thread | task: how far a tool-call id is unique
      limits:                         # bounds on raw arguments, checked before any schema
        max_bytes: 65536              # compact JSON size
        max_depth: 8                  # nested objects/lists
        max_string: 4096              # characters per string or key; digits per integer
        max_items: 256                # elements per list
        max_keys: 256                 # keys per object
    agents: [lead_enricher, intent_scorer, email_verifier, router]   # optional: known agents
    tools:
      update_lead_score:
        locks: ["lead:{lead_id}"]     # lock key templates, rendered from validated args
        agents: [intent_scorer]       # who may call it; "*" = any agent (never a call with no identity)
        args:                         # constraints on top of the tool's own schema
          score: {ge: 0, le: 100}
          note: {max_length: 500, pattern: "[^<>]*"}
          contact.country: {enum: [DE, FR, US]}     # `choices:` is the same as `enum:`
          tags: {max_items: 10}
        after: [enrich_lead]          # enrich_lead's applied record on the same resource must exist
        after_wait_s: 5               # wait that long for it, else rejected `out_of_order`
        fenced: true                  # the side effect checks fencing tokens
        idempotency_key: "{lead_id}:{score}"   # optional; default: thread/node path/call id
        idempotency_scope: thread     # or task: the default key keeps LangGraph's task ids
        redact: [email, contact.phone]         # masked in everything toolguard records
        ttl_ms: 10000
        wait_timeout_s: 5
        limits: {max_string: 1000}    # merged field by field over defaults.limits
      call_crm_api:
        locks: ["lead:{lead_id}"]
        fenced: false                 # external API: cannot check a token; relies on its
                                      # idempotency key, the lock only saves wasted calls
      tag_leads:
        locks: ["lead:{lead_ids[*]}"] # one key per list element (deduplicated)
      transfer:
        locks: ["account:{from_id}", "account:{to_id}"]
      search_leads:
        read_only: true               # changes nothing: needs no lock

Field paths (in templates, ``args:`` and ``redact:``): argument names as the
model sends them, joined by ``.``, with ``[*]`` for every element of a list;
e.g. ``contact.email``, ``items[*].sku``.

Key templates: literal text (printable ASCII, no spaces, none of ``{}*%\\``)
around ``{path}`` placeholders; two placeholders need a separator such as
``:`` between them; at most one ``[*]`` per template. Values are escaped (see
``toolguard.policies.templates``): strings keep ``A-Z a-z 0-9 _ -`` and
percent-encode every other byte; integers, floats and booleans are tagged
(``~i42``, ``~d1%2E5``, ``~t``), so ``1``, ``"1"`` and ``true`` are different
keys; an escaped value longer than 256 characters is hashed (``~h<sha256>``)
so every key fits a database index. A missing or ``null`` value is rejected.
An ``idempotency_key`` template renders one key, prefixed with the tool name.

Idempotency scope: without a template, a call's key is its thread, its
agent/node path (LangGraph's checkpoint namespace without the task ids, e.g.
``scorer|tools``) and its tool-call id (``idempotency_scope: thread``, the
default), so a call id seen again later in the thread on the same path is a
replay (same arguments) or refused (``idempotency_conflict``). ``task`` keeps
the task ids: for frameworks that reuse call ids across turns of a thread.

Redaction: values at ``redact:`` paths are ``"[redacted]"`` in the audit log's
arguments and masked wherever they appear in what toolguard records of the call
(the result kept for replays, error texts); see ``toolguard.policies.redaction``.

Constraints: ``ge gt le lt`` (numbers), ``min_length max_length pattern``
(strings; the pattern must match the whole string), ``min_items max_items``
(lists), ``enum``/``choices`` (any JSON scalars). An absent or ``null``
argument is not checked.

Rules checked at load: unknown fields (with a suggestion), invalid YAML, a
key or tool defined twice, bad templates, bad constraints (unknown name,
``ge`` > ``le``, invalid regex), ``after:`` naming an unknown tool, itself, a
tool locking no resource of the same kind, or forming a cycle; a tool that is
not ``read_only`` and has no locks; an agent missing from ``agents:`` (when
given); a redacted field used in a key template (keys are audited in clear).
``Policy.check_against(tool_schemas)`` adds: template, constraint and redact
paths that are not arguments, ``[*]`` on a non-list, a list used as a key,
constraints of the wrong kind for the argument's type, and the same resource
keyed by an integer in one tool and a string in another.
"""

from __future__ import annotations

from toolguard.errors import PolicyError, PolicyProblems
from toolguard.policies.decisions import (
    REDACTED,
    authorize,
    check_constraints,
    decided_keys,
    idempotency_key,
    lock_keys,
    lookup_tool,
    ordering_keys,
    read_keys,
    redact,
    redacted_args,
)
from toolguard.policies.loader import build_policy, load_policy, policy_files, read_policy_data
from toolguard.policies.model import (
    ANY_AGENT,
    ArgConstraint,
    Defaults,
    Location,
    Policy,
    Problem,
    ToolPolicy,
    UnknownToolMode,
    policy_problems,
    shared_resources,
)
from toolguard.policies.paths import FieldPath
from toolguard.policies.schemas import schema_problems
from toolguard.policies.strict import json_schema_of, strict_model, validate_args
from toolguard.policies.templates import KeyTemplate, escape_text, escape_value

__all__ = [
    "ANY_AGENT",
    "REDACTED",
    "ArgConstraint",
    "Defaults",
    "FieldPath",
    "KeyTemplate",
    "Location",
    "Policy",
    "PolicyError",
    "PolicyProblems",
    "Problem",
    "ToolPolicy",
    "UnknownToolMode",
    "authorize",
    "build_policy",
    "check_constraints",
    "decided_keys",
    "escape_text",
    "escape_value",
    "idempotency_key",
    "json_schema_of",
    "load_policy",
    "lock_keys",
    "lookup_tool",
    "ordering_keys",
    "policy_files",
    "policy_problems",
    "read_keys",
    "read_policy_data",
    "redact",
    "redacted_args",
    "schema_problems",
    "shared_resources",
    "strict_model",
    "validate_args",
]
