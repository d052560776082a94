.PHONY: setup demo test
setup:
	bash scripts/setup.sh
demo: setup
	.venv/bin/taper demo
test:
	bash scripts/test.sh
