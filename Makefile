# idpool — the commands a newcomer needs: `make run`, `make test`.
SHELL := /bin/bash
export DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/idpool
export REDIS_URL ?= redis://127.0.0.1:6379

.PHONY: help run test spec-map flake-hunt mutants lint sqlx-prepare openapi services services-down clean-test-data bench bench-quick bench-build sdk-tools ha-tools test-tools

help:
	@echo "make run            start Postgres/Redis if needed, then idpool on 127.0.0.1:8080 (no API keys)"
	@echo "make test           install what the tests need if missing, start Postgres/Redis if needed, then the whole suite"
	@echo "make spec-map       which tests check each SPEC promise and bound (fails on an unmapped one)"
	@echo "make flake-hunt     the whole suite N times (RUNS=5) with one core kept busy; failures per test"
	@echo "make mutants        mutation testing of the fast unit-tested modules; caught, missed, survivors"
	@echo "make bench          release build, then every performance scenario (own Postgres/Redis/idpool)"
	@echo "make bench-quick    the same scenarios at about a tenth of the size"
	@echo "make lint           rustfmt, ARCHITECTURE.md names only code that exists, no import up a layer, clippy (warnings as errors), unused and denied dependencies, .sqlx/ current"
	@echo "make sqlx-prepare   rewrite .sqlx/ after changing a query or a migration"
	@echo "make openapi        regenerate openapi/openapi.json"
	@echo "make services-down  stop the Postgres/Redis that make started (never others)"

services:
	@scripts/dev-services.sh up

services-down:
	@scripts/dev-services.sh down

# Local development: no API keys (idpool says so in its first log line and
# refuses this anywhere but a loopback address).
run: services
	IDPOOL_AUTH=off IDPOOL_LISTEN=127.0.0.1:8080 cargo run --release -- serve

# Every test makes its own database (idpool_test_*) and Redis prefix; this
# removes what test runs left (no psql or redis-cli needed).
clean-test-data: services
	@cargo run -q --example clean_test_data

# The SPEC promises and bounds, each with the tests that check it
# (tests/README.md); fails when one has none.
spec-map:
	@python3 scripts/spec-map.py

# The client tools the tests drive (pinned; a venv and node_modules in the
# tool cache, installed once per machine, linked under target/sdk).
sdk-tools:
	@scripts/sdk-tools.sh

# Patroni, etcd and HAProxy (Debian's packages) for the HA test, which
# starts its own on free ports.
ha-tools:
	@scripts/dev-services.sh ha-tools

# All make test needs from Debian: the above, openssl, python3-venv, npm.
test-tools:
	@scripts/dev-services.sh test-tools

# A failing test ends with its panic message, not a backtrace of tokio's
# frames above it (TEST_BACKTRACE=1 brings them back).
# nextest (pinned, installed if missing) groups the heavy tests and ends a
# test that runs over 4 minutes (.config/nextest.toml). What the tests left
# on the shared servers is removed after the run, failed or not.
test: test-tools services sdk-tools
	@python3 scripts/spec-map.py --quiet
	@cargo run -q --example clean_test_data
	@export RUST_BACKTRACE=$${TEST_BACKTRACE:-0} PATH="$$(scripts/nextest.sh):$$PATH"; \
	status=0; cargo nextest run --workspace --all-targets $(NEXTEST_ARGS) || status=$$?; \
	cargo run -q --example clean_test_data; exit $$status

# Mutation testing of the fast unit-tested modules (.cargo/mutants.toml);
# prints caught, missed, timed out, unviable, and what was missed.
mutants:
	@TESTS="$(TESTS)" scripts/mutants.sh $(FILES)

# The whole suite RUNS times with one core kept busy (stress-ng); prints
# the failures per test.
flake-hunt:
	@scripts/flake-hunt.sh $(RUNS)

# cargo deny reads every crate of Cargo.lock, those of other platforms
# too: cargo fetch brings them from the registry (the advisories stay
# offline, from .ci/advisory-db).
# The query macros build from the committed .sqlx/ (.cargo/config.toml sets
# SQLX_OFFLINE); these two describe every query again against a scratch
# database migrated from migrations/, and write or compare .sqlx/.
lint: services
	cargo fmt --all -- --check
	@python3 scripts/architecture-paths.py
	@python3 scripts/layers.py
	cargo clippy --workspace --all-targets -- -D warnings
	@bin=$$(scripts/cargo-machete.sh) && PATH="$$bin:$$PATH" cargo machete
	@cargo fetch --locked --quiet
	@bin=$$(scripts/cargo-deny.sh) && PATH="$$bin:$$PATH" cargo deny --offline check
	@bin=$$(scripts/sqlx-cli.sh) && export PATH="$$bin:$$PATH" DATABASE_URL="$${DATABASE_URL%/*}/idpool_sqlx_check" \
	  && sqlx database reset -y --source migrations >/dev/null \
	  && cargo sqlx prepare --check --workspace -- --all-targets

sqlx-prepare: services
	@bin=$$(scripts/sqlx-cli.sh) && export PATH="$$bin:$$PATH" DATABASE_URL="$${DATABASE_URL%/*}/idpool_sqlx_check" \
	  && sqlx database reset -y --source migrations >/dev/null \
	  && cargo sqlx prepare --workspace -- --all-targets

# The bench starts its own Postgres, Redis and idpool on free ports and stops
# them; it never touches servers it did not start. Results: target/bench/latest.json
bench-build:
	@scripts/dev-services.sh tools
	cargo build --release --workspace

bench: bench-build
	target/release/idpool-bench

bench-quick: bench-build
	target/release/idpool-bench --quick

openapi:
	cargo run -q -- openapi > openapi/openapi.json
