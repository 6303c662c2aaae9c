"""Policy, intent and key-template tests (a package so module names never clash)."""
