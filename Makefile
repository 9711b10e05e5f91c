# The two entry points of the README. Both set up .venv/ first (idempotent:
# a second run takes seconds), including Horovod built from source and DeepSpeed.
PY := .venv/bin/python


.PHONY: setup demo test docs
setup:
	bash scripts/bootstrap.sh --all

# The main job: 4 worker processes over torch.distributed (gloo) training on
# sklearn's digits with 1-bit DoubleSqueeze.
demo: setup
	OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 4 examples/train_digits.py --compressor sign

# The test suite, after the linter (ruff, configured in pyproject.toml), on two pytest workers
# (pytest-xdist) that each take whole test files: a launch's ranks leave a core idle while they wait
# on each other, and the other worker fills it. Whole files, so that a module's one launch, shared by
# its tests, runs once.
test: setup
	.venv/bin/ruff check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --durations=15

# The docs site (Sphinx: furo, MyST, autodoc), warnings as errors: a reference to a
# name that does not exist fails the build. Open docs/_build/html/index.html.
docs: setup
	$(PY) -m sphinx -W -n --keep-going -q -b html docs docs/_build/html
