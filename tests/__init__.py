"""The test suite, a package so that its shared helpers import by one name everywhere
(`tests.kernel_helpers`, `tests.kv_transfer_helpers`, `tests.e2e_helpers`): for pytest,
mypy and ruff alike, with no test editing sys.path."""
