"""The tests, a package: unit tests mirror the packages they test (tests/common, tests/procs/<process>),
and as modules of `tests` they neither clash by basename (tests/procs/renderer/test_tools.py,
tests/e2e/test_tools.py) nor shadow the `common` and `procs` packages they import."""
