"""How toolguard runs anywhere: cleanup that survives cancellation, typed connection errors,
telemetry, optional extras and text that is safe to show.

The modules are imported one by one; importing the package loads nothing else.
"""
