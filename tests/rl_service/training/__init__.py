"""A package (not a plain folder) so that `shared_pool` in conftest.py ends with these tests: a package-scoped
fixture of a folder without `__init__.py` lives until the session ends, holding its Ray CPU from the tests
after it."""
