# Keel: `make run` sets everything up and serves; `make test` runs the whole suite, `make test-fast`
# all but the tests marked slow or e2e (pyproject.toml's markers); `make lint` checks the code style.
SHELL := /bin/bash
PY := .venv/bin/python
PIP := .venv/bin/pip
PROTOS := $(shell find protos -name '*.proto')
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: run test test-fast lint venv proto model gate vocab kernels adapters syspkgs setup node peer bench-deps certs lock clean audit

run: setup
	$(PY) -m keelctl up --demo $(if $(MODEL),--model $(MODEL),)

# The whole suite must stay under 20 minutes on 2 cores: its log ends with the 25 slowest tests.
test: setup peer
	$(PY) -m pytest tests --durations=25

test-fast: setup peer
	$(PY) -m pytest tests -m "not slow and not e2e"

# ruff, configured in pyproject.toml (line length, import order, unused names, pyflakes).
lint: venv
	$(PY) -m ruff check .

# What `make run` needs; the tests add the llama.cpp peer (`peer`, a ~4 min build).
setup: syspkgs venv proto model vocab kernels node

venv: .venv/.stamp
.venv/.stamp: requirements.lock pyproject.toml
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip==26.3
	$(PIP) install -q --no-deps $(FIND_LINKS) -r <(grep -v -e '# bench-only' -e 'llama.cpp peer' requirements.lock)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $@

proto: gen/.stamp
gen/.stamp: $(PROTOS) .venv/.stamp
	rm -rf gen && mkdir -p gen
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=gen --pyi_out=gen --grpc_python_out=gen $(PROTOS)
	echo "$(CURDIR)/gen" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/keel-gen.pth"
	touch $@

# The served model's prepared folder under var/models/ (MODEL=PATH: another GGUF or Hugging Face folder;
# kept while the model's bytes are unchanged, docs/models.md).
model: .venv/.stamp
	$(PY) -m services.inference.model.modelcache $(if $(MODEL),--model $(MODEL),)

# The LoRA adapters the tests and the demo register (training/adapters.py: PEFT on the model, fixed
# seeds; cached under var/adapters-src, kept while their inputs match). About 10 CPU-minutes the first
# time, so not part of setup: tests/e2e/test_lora_mesh.py makes them on first use.
adapters: model
	$(PY) -m training.adapters --out var/adapters-src

# Quality gate of every weight format on the model (~2 min on 2 cores): engine.format auto only picks
# formats with a passing result under var/gate/, and an explicit non-float32 format needs one. The
# stage runs it itself at its first start with auto (formats.gate_at_start); this pays it ahead.
gate: model
	$(PY) -m services.inference.formats.gate

# Keel's C++ kernel of the gguf weight format (services/inference/model/kernels), built once per source hash
# under build/kernels/ (~20 s). A host that cannot build it still sets up: the inference stage then
# serves another format and says why (the leading '-').
kernels: .venv/.stamp
	-$(PY) -m services.inference.model.kernels

# The served model's compiled vocabulary (var/models/<key>/vocab.kvoc); the compiler skips the work when
# it already matches the model and the format version.
vocab: .venv/.stamp
	$(PY) -m services.tokenizer.compiler $(if $(MODEL),--gguf $(MODEL),)

# Debian packages the mesh and the tests run for real: redis-server (quarantine), prometheus (promtool
# for the rule tests, the prometheus server for the rotation e2e test), prometheus-alertmanager (amtool,
# and the alertmanager of the rotation e2e test), node and npm (the Node client test, tests/node);
# postgresql (the feedback database's tests; Debian keeps its binaries off PATH, hence the full path);
# g++ and ninja-build (torch.utils.cpp_extension builds the gguf kernel with them).
SYSPKGS := redis-server:redis-server prometheus:promtool prometheus-alertmanager:prometheus-alertmanager \
	nodejs:node npm:npm postgresql:/usr/lib/postgresql/15/bin/pg_ctl g++:g++ ninja-build:ninja
# Debian's packages of a list of package:file whose file (a command or a path) is missing.
define apt-need
@need=""; for p in $(1); do { command -v $${p#*:} || [ -e $${p#*:} ]; } >/dev/null || need="$$need $${p%%:*}"; done; \
if [ -n "$$need" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$need; fi
endef
syspkgs:
	$(call apt-need,$(SYSPKGS))

# The Node client test's packages, exactly as tests/node/package-lock.json pins them.
node: tests/node/node_modules/.stamp
tests/node/node_modules/.stamp: tests/node/package.json tests/node/package-lock.json
	npm ci --prefix tests/node --no-audit --no-fund --ignore-scripts
	touch $@

# TLS inside the mesh: then `KEEL_MESH_TLS_DIR=var/certs make run` (see shared/tls.py).
certs: .venv/.stamp
	$(PY) -m keelctl certs --out var/certs

# The llama.cpp peer of the model and tokenizer tests (llama-cpp-python, compiled once, ~4 min): built with
# the SIMD extensions this CPU has named one by one, AMX off (testing/llamacpp_flags.py says why).
peer: .venv/.peer-stamp
.venv/.peer-stamp: .venv/.stamp testing/llamacpp_flags.py
	CMAKE_ARGS="$$($(PY) -m testing.llamacpp_flags)" $(PIP) install -q --no-deps -r <(grep 'llama.cpp peer' requirements.lock)
	touch $@

# The gRPC C++ toolchain that bench/lib/native_loadgen.py builds its load generator with.
BENCH_SYSPKGS := g++:g++ pkg-config:pkg-config protobuf-compiler-grpc:grpc_cpp_plugin \
	libgrpc++-dev:/usr/include/grpcpp/grpcpp.h libprotobuf-dev:/usr/include/google/protobuf/message.h
bench-deps: .venv/.stamp peer
	$(PIP) install -q --no-deps -r <(grep '# bench-only' requirements.lock)
	$(call apt-need,$(BENCH_SYSPKGS))

# Known vulnerabilities of every pin in the lock (pip-audit queries PyPI's vulnerability data, so it
# needs the network; --strict fails when any pin could not be checked: no silent pass offline).
audit: .venv/.stamp
	$(PY) -m pip_audit --strict --no-deps --disable-pip --progress-spinner off \
		-r <(sed 's/ *#.*//' requirements.lock | grep -v '^$$')

lock:
	$(PIP) freeze --exclude-editable | sed 's/+cpu$$//' > requirements.lock.new
	@echo "review requirements.lock.new (keep the header and the dev-only and bench-only marks), then move it over requirements.lock"

clean:
	rm -rf gen var .venv
