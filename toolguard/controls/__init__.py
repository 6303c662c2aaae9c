"""Production controls and their records: approvals, the kill switch, shadow mode, quotas.

The modules are imported one by one; importing the package loads nothing else.
"""
