# Conveniences over tools/dev (which installs what it needs, idempotently).
.PHONY: install serve test stubs lint

install:
	bash tools/dev install

serve:
	bash tools/dev serve

test:
	bash tools/dev test

stubs:
	.venv/bin/python -m omnifabric.tools.gen_stubs --force

lint:
	cd proto && ../.tools/node_modules/.bin/buf lint
