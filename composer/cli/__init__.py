"""The `composer` command line: one module per verb."""
