"""The vocabulary of one call: its intent, envelope, facts, context, decision and audit entry.

The modules are imported one by one; importing the package loads nothing else.
"""
