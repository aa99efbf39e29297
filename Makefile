# dcu-forge: the front door. Every target calls the tool (scripts/forge); `make help` lists them.
# Variables: PY (python to run the tool), PROFILE, PROFILES, MODEL, IMAGE, RUN, BASELINE, BASELINE_NAME, A, B,
# BASELINE_PROFILE, DATA_DIR, TOK_S, FORCE, E2E, REFERENCE, SPEEDUP, TTFT_S, TPOT_MS, OUT, LABEL, VLLM_SRC, MAX_JOBS, BASE_IMAGE,
# THREEWAY, WHEEL_DEVICE, WARM_ARCH, E2E_ARGS, BASE (sdist | vendor | standin), VENDOR_SRC (the vendor's
# vllm_cscc checkout), INTO, FROM, CALIBRATE_ARGS, CALIBRATION, WORKERS (pytest processes for check and test, at most
# the cores), ROUND (the contest round: preliminary, the default, or final; passed as --round to serve, bench-all-tiers,
# score, sweep, predict, report and submission), TIER (the final round's tier a server is started for), TIER_ENV (the
# final round's tier-environment file forge sweep --round final writes; report and submission list it), KV_DTYPE, CARD, UTIL, AGAINST (forge plan's
# KV cache dtypes, card, --gpu-memory-utilization and the served run it checks the planner against). The yes/no variables FORCE and THREEWAY take 1 (yes), 0 or nothing (no); another value is refused.

SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV ?= .venv
# The tool runs from the project venv when there is one (host, CI); inside the DCU container
# there is none and the system python is used.
PY ?= $(shell test -x $(VENV)/bin/python && echo $(VENV)/bin/python || echo python3)
FORGE = PYTHONPATH=$(CURDIR)/scripts $(PY) -m forge
BOOT = PYTHONPATH=$(CURDIR)/scripts python3 -m forge

PROFILE ?= contest
BASE ?= sdist
WHEEL_DEVICE ?= auto
WARM_ARCH ?= gfx936
export VLLM_SRC VENDOR_SRC MAX_JOBS BASE_IMAGE DATA_DIR MODEL IMAGE

.PHONY: help venv fetch tree patches-check patches-refresh patches-lint offline-check export submission wheel image image-rehearsal \
        pin-base warm-kernels self-check rehearsal kernels-check bench-kernels calibrate serve stop bench-all-tiers import-throughput score \
        predict plan compare sweep \
        accuracy report gpu-bundle e2e-gpu lint check test clean

help: ## list the Makefile targets
	@$(BOOT) help-make Makefile

venv: ## create/update the project venv (.venv) from requirements/dev.txt
	@$(BOOT) venv --path $(VENV)

fetch: ## fetch and verify the pinned vLLM 0.18.1 source; prints the verified tree's path (VLLM_SRC=path for offline use)
	@$(FORGE) fetch

tree: ## build/vllm: pristine upstream + kernel overlay + one commit per patch (no-op when current); BASE=vendor (VENDOR_SRC=) or standin: build/vllm-BASE; FORCE=1 discards work there, THREEWAY=1 lets git am merge
	@$(FORGE) tree --base $(BASE)

patches-check: ## prove patches/ applies to every base present, matches its tree, and (vendor, stand-in) builds offline (VENDOR_SRC= adds the vendor base)
	@$(FORGE) patches-check

patches-refresh: ## write build/vllm's commits back to patches/ (messages preserved)
	@$(FORGE) patches-refresh

patches-lint: ## check every patch's review record and the contest's forbidden paths
	@$(FORGE) patches-lint

offline-check: ## fail naming file:line if a HIP build of the tree would download (BASE=; CMake FetchContent, ExternalProject, file(DOWNLOAD))
	@$(FORGE) offline-check --base $(BASE)

export: ## patched tree as a tarball + one combined diff, for a scoring repository
	@$(FORGE) export

submission: ## the repository a team pushes: vendor base, kernels, one commit per patch, the Art. 12/13 documents, and a pre-flight (VENDOR_SRC=, else the labelled stand-in; INTO=dir; ROUND=final TIER_ENV=<file>: the environment per tier)
	@$(FORGE) submission $(if $(INTO),--into $(INTO)) $(if $(ROUND),--round $(ROUND)) $(if $(TIER_ENV),--tier-env $(TIER_ENV))

wheel: ## build the vllm wheel from a clean copy of build/vllm (BASE= picks the tree; BASE=vendor: setup.py's own version; ROCm build on a DCU host; WHEEL_DEVICE=auto)
	@$(FORGE) wheel --device $(WHEEL_DEVICE) --base $(BASE)

image: ## build the DCU image from Dockerfile.rocm (BuildKit or buildah); `make -n image` prints the command
	+@$(FORGE) image $(if $(findstring n,$(firstword -$(MAKEFLAGS))),--dry-run)

pin-base: ## record the digest of the pulled base image in configs/build.yaml
	@$(FORGE) image --pin-base

image-rehearsal: venv ## build Dockerfile.rocm on a debootstrap stand-in base and run its self-check
	@$(FORGE) image-rehearsal

rehearsal: venv ## full-compile rehearsal on any Linux box: fetch, tree, wheel, install, self-tests, AOT (writes reports/rehearsal.md)
	@$(FORGE) rehearsal

warm-kernels: ## (in the image) compile our Triton kernels for ARCH into TRITON_CACHE_DIR (ARCH=WARM_ARCH, default gfx936)
	@$(FORGE) warm-kernels --arch $(WARM_ARCH)

self-check: ## (in the image) check that the installed vLLM is our wheel
	@$(FORGE) self-check

kernels-check: venv ## compile-check kernels/csrc (hipcc gfx90a, nvcc sm_90; standalone and as in vLLM's _C) and Triton AOT targets
	@$(FORGE) kernels-check

bench-kernels: ## kernel benchmarks on a GPU machine (writes reports/kernels/)
	@$(FORGE) bench-kernels

calibrate: ## check and time every kernel candidate on this device; write its table (on the card, or a GPU machine; CALIBRATE_ARGS=...; FORCE=1 calibrates into a complete folder again)
	@$(FORGE) calibrate $(CALIBRATE_ARGS) $(if $(filter 1,$(FORCE)),--force)

serve: ## start the contest server command for a profile and wait for /health (PROFILE=, MODEL=dir, IMAGE=optional image; ROUND=final TIER=<tier> for the final round)
	@$(FORGE) serve --profile $(PROFILE) $(if $(ROUND),--round $(ROUND)) $(if $(TIER),--tier $(TIER))

stop: ## stop the server `forge serve` started (and only that one)
	@$(FORGE) stop

bench-all-tiers: ## run the contest's tiers with `vllm bench serve` against the server (RUN=<run-id> resumes one; ROUND=final: the finals' client, CONCURRENCY_4_8K= etc.)
	@$(FORGE) bench-all-tiers $(if $(filter-out file,$(origin PROFILE)),--profile $(PROFILE)) $(if $(RUN),--run-id $(RUN)) $(if $(ROUND),--round $(ROUND))

score: ## the contest score of a run (or of what-if tok/s) against a baseline: RUN= or TOK_S=a,b,c, BASELINE=<run> or BASELINE_NAME=<set: team, official>; FORCE=1 replaces a recorded score
	@$(FORGE) score $(if $(RUN),--run $(RUN)) $(if $(BASELINE),--baseline $(BASELINE)) $(if $(BASELINE_NAME),--baseline-name $(BASELINE_NAME)) $(if $(TOK_S),--tok-s $(TOK_S)) $(if $(ROUND),--round $(ROUND)) $(if $(filter 1,$(FORCE)),--force)

predict: ## predict the DCU tok/s per tier and the contest score: E2E=<e2e folder> | RUN=<run> REFERENCE=<run> | CALIBRATION=<calibrate folder> | SPEEDUP="prefill_attn=10 gemv=1.45" | TTFT_S=a,b,c TPOT_MS=a,b,c [BASELINE_NAME=] [OUT=<folder>] [LABEL=<name>]
	@$(FORGE) predict $(if $(CALIBRATION),--calibration $(CALIBRATION)) $(if $(E2E),--e2e $(E2E)) $(if $(RUN),--run $(RUN)) $(if $(REFERENCE),--reference $(REFERENCE)) $(foreach s,$(SPEEDUP),--speedup $(s)) $(if $(TTFT_S),--ttft-s $(TTFT_S)) $(if $(TPOT_MS),--tpot-ms $(TPOT_MS)) $(if $(BASELINE_NAME),--baseline-name $(BASELINE_NAME)) $(if $(OUT),--out $(OUT)) $(if $(LABEL),--label $(LABEL)) $(if $(ROUND),--round $(ROUND))

import-throughput: ## the organizers' run_throughput.sh results as a run folder (score, compare, predict read it) (FROM=<their testdata folder>; FORCE=1 replaces a run folder that holds a run)
	@$(FORGE) import-throughput $(FROM) $(if $(RUN),--run-id $(RUN)) --profile $(PROFILE) $(if $(filter 1,$(FORCE)),--force)

compare: ## per-tier deltas between runs A and B, with a noise band (A=<run> B=<run>; REFERENCE=<run>: score both against it)
	@$(FORGE) compare $(if $(A),--a $(A)) $(if $(B),--b $(B)) $(if $(REFERENCE),--reference $(REFERENCE))

plan: ## the KV cache and requests resident per tier and topology (capacity planner): vLLM's reported tokens, preemption yes/no (ROUND=final, TIER=, KV_DTYPE=bf16,int8, CARD=dcu|h200, UTIL=0.95, OUT=<folder>, FORCE=1; AGAINST=<run>: checked against a served run's report)
	@$(FORGE) plan $(if $(AGAINST),--against $(AGAINST)) $(if $(ROUND),--round $(ROUND)) $(if $(TIER),--tier $(TIER)) $(if $(KV_DTYPE),--kv-dtype $(KV_DTYPE)) $(if $(CARD),--card $(CARD)) $(if $(UTIL),--gpu-memory-utilization $(UTIL)) $(if $(OUT),--out $(OUT)) $(if $(filter 1,$(FORCE)),--force)

sweep: ## serve, bench all tiers, score and stop for each profile in turn (PROFILES="a b"); ROUND=final: the search per tier (BASELINE=<final-round run> or BASELINE_PROFILE=<profile measured at the baseline>, TIER_ENV=, FORCE=1 replaces a recorded winner; more with forge sweep --help)
	@$(FORGE) sweep $(PROFILES) $(if $(ROUND),--round $(ROUND)) $(if $(BASELINE),--baseline $(BASELINE)) $(if $(BASELINE_PROFILE),--baseline-profile $(BASELINE_PROFILE)) $(if $(TIER_ENV),--tier-env $(TIER_ENV)) $(if $(filter 1,$(FORCE)),--force)

accuracy: ## accuracy sets against the running server (official script or ours): run_accuracy.sh with DATA_DIR, else our LongBench-format evaluator; resumes; FORCE=1 replaces a recorded result
	@$(FORGE) accuracy $(if $(RUN),--run-id $(RUN)) $(if $(BASELINE),--baseline $(BASELINE)) $(if $(filter 1,$(FORCE)),--force)

report: ## regenerate reports/env-vars.md, optimization-plan.md, submission-readme.md and the submission's ENVIRONMENT.md and OPTIMIZATION.md (reports/submission/) (ROUND=final TIER_ENV=<file>: the environment per tier, into reports/final-round/)
	@$(FORGE) report --profile $(PROFILE) $(if $(ROUND),--round $(ROUND)) $(if $(TIER_ENV),--tier-env $(TIER_ENV))

gpu-bundle: ## build the bundle for the end-to-end run on a GPU machine: build/gpu-bundle (patched vLLM, harness build; extra wheels, model dir, manifest)
	@$(FORGE) gpu-bundle

e2e-gpu: ## the end-to-end run on a GPU machine (serve, bench, plumbing, fault, score): the bundle installed, the profiles served side by side (E2E_ARGS=...)
	@$(FORGE) e2e-gpu $(E2E_ARGS)

lint: venv ## ruff over every tracked Python file with the project's configuration
	@$(FORGE) lint

check: venv ## the inner loop: lint, unit tests and the fault-injection suite; about 4 minutes on 2 cores; WORKERS=
	@$(FORGE) check $(if $(WORKERS),--workers $(WORKERS))

test: venv ## lint, the rehearsals and the whole test suite (what CI runs); WORKERS=
	@$(FORGE) test $(if $(WORKERS),--workers $(WORKERS))

clean: ## remove build/ and dist/ (keeps the verified source cache); refuses while a server started by forge runs or build/vllm holds work not in patches/ (FORCE=1 anyway)
	@$(FORGE) clean
