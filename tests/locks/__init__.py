"""Lock contract tests (a package so its module names never clash with other test folders)."""
