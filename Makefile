# Two commands on a fresh machine with python3 and make: `make demo`, `make test`.
# Each bootstraps .venv from the project's own files.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit e2e e2e-deps soak bench profile pilot protos clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gpu-fraction-plugin demo

test: lint typecheck unit

lint: $(STAMP)
	$(BIN)/ruff check deviceplugin tests hack
	$(BIN)/ruff format --check deviceplugin tests hack
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest -q -m 'not soak and not e2e and not cluster'
	@$(MAKE) --no-print-directory e2e

# The runtime end-to-end suite (tests/e2e): podman with runc, as root. Skipped, with one line
# saying why, where it cannot run; `make e2e-deps` installs what it needs.
e2e: $(STAMP)
	@if why="$$($(BIN)/python -m tests.e2e.requirements)"; then \
	  $(BIN)/pytest -q -m e2e tests/e2e; \
	else \
	  echo "e2e suite: skipped ($$why)"; \
	fi

E2E_PACKAGES := podman runc busybox-static

# Idempotent: asks apt only for what dpkg does not already have installed.
e2e-deps:
	@command -v dpkg-query >/dev/null || { echo "e2e-deps: needs Debian or Ubuntu (apt)"; exit 1; }
	@missing=""; for p in $(E2E_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' \
	    || missing="$$missing $$p"; \
	done; \
	if [ -z "$$missing" ]; then echo "e2e-deps: $(E2E_PACKAGES) already installed"; exit 0; fi; \
	sudo=""; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
	echo "e2e-deps: installing$$missing"; \
	$$sudo apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq $$missing

soak: $(STAMP)
	$(BIN)/pytest -q -m soak -p no:cacheprovider -o addopts=''

bench: $(STAMP)
	$(BIN)/python hack/bench.py
	$(BIN)/python -m tests.cluster.figures

profile: $(STAMP)
	$(BIN)/python hack/callprofile.py

pilot: $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,pilot]'
	$(BIN)/python hack/pilot/run.py

protos: $(STAMP)
	PYTHON=$(BIN)/python hack/gen-protos.sh

clean:
	rm -rf $(VENV) build *.egg-info

# ---- A real single-node cluster (hack/cluster, DESIGN section 11) ----
.PHONY: cluster-deps cluster-up cluster-down cluster-reboot

# Builds the Kubernetes, etcd, containerd and runc binaries that are missing into a cache
# outside the tree (hack/cluster/README.md); installs the Debian packages the cluster needs.
cluster-deps:
	@hack/cluster/deps.sh

# A hermetic single node in namespaces of its own (root); K8S=1.36.3 for the older release.
cluster-up:
	@hack/cluster/up.sh $(K8S)

cluster-down:
	@hack/cluster/down.sh

# The node goes down hard and comes back (the control plane stays): hack/cluster/reboot.sh.
cluster-reboot:
	@hack/cluster/reboot.sh

# The real-cluster suite (tests/cluster): the real plugin on a real single node built by
# `make cluster-deps`, once per release. Skipped, with one line saying why, where it cannot run.
K8S_RELEASES := 1.37.2 1.36.3
.PHONY: test-cluster
test-cluster: $(STAMP)
	@for v in $(K8S_RELEASES); do \
	  if why="$$($(BIN)/python -m tests.cluster.requirements $$v)"; then \
	    GPUFRAC_K8S=$$v $(BIN)/pytest -q -m cluster tests/cluster || exit 1; \
	  else \
	    echo "cluster suite (Kubernetes $$v): skipped ($$why)"; \
	  fi; \
	done

# ---- the image and the Helm chart (docs/upgrade.md, README "Install") ----
.PHONY: image image-deps helm chart-docs

IMAGE_PACKAGES := mmdebstrap podman runc

# The node agent's image with no registry (hack/image/build.sh): a Debian base from mmdebstrap,
# the wheels, then the Dockerfile with podman; saved to build/image/ for `ctr images import`.
image: $(STAMP)
	hack/image/build.sh

# Idempotent: asks apt only for what dpkg does not already have installed.
image-deps:
	@command -v dpkg-query >/dev/null || { echo "image-deps: needs Debian or Ubuntu (apt)"; exit 1; }
	@missing=""; for p in $(IMAGE_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' \
	    || missing="$$missing $$p"; \
	done; \
	if [ -z "$$missing" ]; then echo "image-deps: $(IMAGE_PACKAGES) already installed"; exit 0; fi; \
	sudo=""; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
	echo "image-deps: installing$$missing"; \
	$$sudo apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq $$missing

# helm from its Go module into the cluster components' cache: built once (minutes), then a
# no-op. The chart tests in `make unit` use it; without Go they skip, saying so.
helm:
	@if command -v go >/dev/null; then hack/helm.sh >/dev/null; \
	else echo "helm: Go not found, not built; the chart tests will skip"; fi

unit: helm

# The chart's values schema (its `config` part) and README's values table, regenerated.
chart-docs: $(STAMP)
	$(BIN)/python hack/gen-chart-docs.py
