"""The validation step (pure): envelope, input limits, schema, policy judgements, keys.

``prepare(intent, policy, models, enforcement)`` returns the ``Prepared`` call
or raises the refusal: ``InvalidIntent``, ``UnknownTool``, ``InvalidArguments``,
``NotAuthorized``, ``IntentRejected(missing_idempotency_key)``.

The policy's own judgements (unknown tool, who may call, ``args:``
constraints) run under the call's ``Enforcement``: in ``mode: shadow`` a
would-be refusal is recorded there and the call goes on. The envelope, input
limits, the tool's schema and the keys are never shadowed. ``facts_of`` gives
the later steps (approvals, quotas) what they decide on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from toolguard.call.envelope import envelope_problem
from toolguard.call.facts import CallFacts
from toolguard.call.intent import Intent, args_hash, bounded_key, check_limits, json_args
from toolguard.call.recording import storable, storable_text
from toolguard.controls.shadow import Enforcement, lookup_in_mode, mode_of
from toolguard.errors import IntentRejected, InvalidArguments, InvalidIntent
from toolguard.policies import (
    Policy,
    authorize,
    check_constraints,
    decided_keys,
    idempotency_key,
    lock_keys,
    ordering_keys,
    read_keys,
    redacted_args,
    validate_args,
)
from toolguard.policies.redaction import scrub, secrets_of
from toolguard.steps.prepared import Prepared
from toolguard.store.base import IntentRecord
from toolguard.store.reads import caller_of

__all__ = ["facts_of", "prepare"]

_NO_ID = ("invalid tool call: id: missing; a model's tool call needs an id, or the tool's policy "
          "an idempotency_key template, so that a call sent twice is applied once")


def prepare(intent: Intent, policy: Policy, models: Mapping[str, type[BaseModel]],
            enforcement: Enforcement | None = None) -> Prepared:
    """Every pure check of ``intent`` under ``policy``; the call's facts, or the refusal.

    ``enforcement`` (the guard's, kept for the call) gets the tool's mode once the
    envelope is valid, and records what a shadowed judgement would have refused.
    """
    problem = envelope_problem(intent)
    if problem is not None:
        raise InvalidIntent(f"invalid tool call: {problem}")
    enforcement = enforcement if enforcement is not None else Enforcement("enforce")
    enforcement.mode = mode_of(policy, intent.tool)  # known once the name is known to be text
    rule = lookup_in_mode(policy, intent.tool, enforcement)
    if not intent.call_id and intent.origin == "model" and rule.idempotency_key is None:
        raise InvalidIntent(_NO_ID)
    check_limits(intent.args, rule.limits)
    schema = models.get(intent.tool)
    model: BaseModel | None = None
    args: dict[str, Any]
    if schema is not None:
        model = validate_args(schema, intent.args)
        args = json_args(model)
    elif isinstance(intent.args, Mapping):
        args = json_args(intent.args)
    else:
        raise InvalidArguments("args: expected an object of named arguments")
    with enforcement.step("authorize"):
        authorize(rule, intent.agent)
    with enforcement.step("constraints"):
        check_constraints(rule, args)
    keys = () if rule.read_only else lock_keys(rule, args)
    reads = read_keys(rule, args) if rule.reads else ()
    decides = tuple(k for k in decided_keys(rule, args) if k not in keys) if keys else ()
    key = idempotency_key(intent, rule, args, key_fn=policy.key_fn)
    if key is None:
        if not rule.fenced:
            msg = ("an unfenced tool needs a stable idempotency key (a tool-call id with a "
                   "thread or run id, or an idempotency_key template in its policy)")
            raise IntentRejected(msg, reason="missing_idempotency_key")
        key = bounded_key(f"intent:{intent.id}")  # no stable identity: this call alone
    secrets = secrets_of(rule, args)
    audited = redacted_args(rule, args) if rule.redact else args
    flow = intent.workflow
    record = IntentRecord(
        tool=intent.tool, idempotency_key=key, args_hash=args_hash(args),
        agent=storable_text(intent.agent), workflow=storable_text(flow.thread_id or flow.run_id),
        keys=keys or reads, intent_id=storable_text(intent.call_id or intent.id),
        args=storable(scrub(audited, secrets)), node_attempt=intent.node_attempt,
        policy_version=policy.digest)
    after = tuple((earlier, ordering_keys(rule, policy.tools[earlier], args))
                  for earlier in rule.after)
    conversation = flow.conversation if flow.conversation is not None else (
        flow.thread_id or flow.run_id)
    caller = caller_of(intent.agent, conversation)
    return Prepared(rule, args, model, keys, record, after, secrets, reads=reads,
                    decides=decides, caller=caller)


def facts_of(intent: Intent, prepared: Prepared) -> CallFacts:
    """What approvals and quotas decide on: validated args, keys, host identity, this attempt."""
    record = prepared.record
    assert record.idempotency_key is not None and record.args_hash is not None
    return CallFacts(tool=intent.tool, agent=intent.agent, args=prepared.args,
                     idempotency_key=record.idempotency_key, args_hash=record.args_hash,
                     attempt=intent.id, policy_digest=record.policy_version or "",
                     keys=prepared.keys, workflow=record.workflow,
                     redacted_args=record.args if prepared.rule.redact or prepared.secrets
                     else None)
