"""One short script per way in, each the code its guide in docs/guides/ shows
(``literalinclude``): tests/test_quickstart.py runs every one under its real
launcher, so a guide's code cannot go stale."""
