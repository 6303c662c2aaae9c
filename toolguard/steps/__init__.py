"""The steps of one guarded call, each in its own module; ``toolguard.guard`` runs them in order.

``pause`` (kill switch) -> ``validate`` (envelope, limits, schema, policy
judgements, keys) -> ``approval`` -> ``quota`` -> ``order`` (``after:`` wait)
-> lock + ``execute`` (the fenced body) -> audit. The sync and asyncio edges
of a step sit side by side in its module; what they decide is shared.
"""
