# sluice - build, test, run.
#   make            build/sluice (+ the CUDA backend when nvcc is found)
#   make test       every test; ends with one line "N passed, N failed"
#   make run        serve the default model on 127.0.0.1:8000
#   make deps       install missing dependencies (tools/setup.sh; the others run it when needed)
#   make model      fetch the default model into models/
#   make gpu-test   GPU tests (run on a GPU host)
#   make bench      benchmarks (CPU here; the GPU ones too on a GPU host)

CC       ?= gcc
NVCC     ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
ARCH_FLAGS ?= -march=x86-64-v3
CFLAGS   ?= -O2 -g
CFLAGS   += -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror $(ARCH_FLAGS) -fopenmp -pthread -I.
LDLIBS   += -lpcre2-8 -levent -levent_pthreads -lsqlite3 -lm -fopenmp -pthread
BUILD    := build
MODEL    := models/SmolLM2-135M-Instruct.Q4_1.gguf

# CUDA: sm_89 (RTX 4090) and sm_90 (H100/H200). CUDA=0 forces a CPU-only build.
CUDA ?= $(if $(NVCC),1,0)
NVFLAGS ?= -O3 -std=c++17 -gencode arch=compute_89,code=sm_89 -gencode arch=compute_90,code=sm_90 \
           -Xcompiler -Wall,-Wextra,-Werror -I.

LIB_SRCS := $(wildcard base/*.c model/*.c kvpool/*.c sched/*.c store/*.c) $(filter-out api/main.c,$(wildcard api/*.c))
LIB_OBJS := $(LIB_SRCS:%.c=$(BUILD)/%.o)
CU_SRCS  := $(wildcard cuda/*.cu)
CU_CSRCS := $(wildcard cuda/*.c)
# cuda/ objects are linked directly, not through the archive: they override
# weak stand-ins in model/backend.c, which an archive would never pull them for.
# The C files' objects are named .c.o: a kind's kernels (cuda/<kind>.cu) and
# its host code (cuda/<kind>.c) would otherwise both be <kind>.o (the .cu
# rule's shorter stem wins build/cuda/<kind>.o).
CUDA_OBJS :=
ifeq ($(CUDA),1)
CUDA_OBJS := $(CU_SRCS:%.cu=$(BUILD)/%.o) $(CU_CSRCS:%.c=$(BUILD)/%.c.o)
CFLAGS   += -DSLUICE_CUDA -I$(CUDA_HOME)/include
LDLIBS   += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublasLt -lcublas -lnccl -lcudart -lstdc++
endif
TEST_SRCS := $(wildcard tests/test_*.c)
TEST_BINS := $(TEST_SRCS:tests/%.c=$(BUILD)/tests/%)
# GPU tests and benchmarks (tests/gpu/): built only with CUDA, run by `make gpu-test`.
GPU_TEST_SRCS := $(wildcard tests/gpu/test_*.c)
GPU_TEST_BINS := $(GPU_TEST_SRCS:tests/%.c=$(BUILD)/tests/%)
GPU_BENCH_BINS := $(patsubst tests/%.c,$(BUILD)/tests/%,$(wildcard tests/gpu/bench_*.c))

.PHONY: all test run model gpu-test bench clean deps FORCE
all: $(BUILD)/sluice

# Dependencies. A fresh machine has none of them, so the first build runs
# tools/setup.sh (Debian packages, the openai client) before compiling anything;
# $(DEPS) records that it ran. It runs again when setup.sh changes, or when one
# of the headers or commands below is missing (a cheap check at every make: no
# process for the headers, one shell per command). DEP_INCLUDE moves the header
# check, e.g. `make -n DEP_INCLUDE=/nonexistent` shows setup being run.
DEPS        := $(BUILD)/.deps
DEP_INCLUDE ?= /usr/include
DEP_HEADERS := jsmn.h pcre2.h event2/event.h event2/thread.h sqlite3.h
DEP_CMDS    := $(CC) curl unzip python3 xz
DEPS_MISSING := $(strip $(foreach h,$(DEP_HEADERS),$(if $(wildcard $(DEP_INCLUDE)/$(h)),,$(h))) \
                $(foreach c,$(DEP_CMDS),$(if $(shell command -v $(c) 2>/dev/null),,$(c))))
$(DEPS): tools/setup.sh $(if $(DEPS_MISSING),FORCE)
	@$(if $(DEPS_MISSING),echo "missing: $(DEPS_MISSING); running tools/setup.sh",true)
	bash tools/setup.sh
	@mkdir -p $(dir $@) && touch $@
deps: $(DEPS)
FORCE:

$(BUILD)/%.o: %.c $(wildcard */*.h) | $(DEPS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@
$(BUILD)/%.c.o: %.c $(wildcard */*.h) | $(DEPS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

# the web page's files, built into webui.o by .incbin (api/webui.c)
$(BUILD)/api/webui.o: $(wildcard api/webui/*)

# attn_wg.cu's warpgroup MMA needs the arch-specific sm_90a target
comma := ,
NVFLAGS_WG ?= $(subst arch=compute_90$(comma)code=sm_90,arch=compute_90a$(comma)code=sm_90a,$(NVFLAGS))
$(BUILD)/cuda/attn_wg.o $(BUILD)/cuda/gemm_wg.o: NVFLAGS := $(NVFLAGS_WG)

$(BUILD)/cuda/%.o: cuda/%.cu $(wildcard cuda/*.h cuda/*.cuh model/*.h base/*.h) | $(DEPS)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c $< -o $@

$(BUILD)/libsluice.a: $(LIB_OBJS)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/sluice: $(BUILD)/api/main.o $(CUDA_OBJS) $(BUILD)/libsluice.a
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

# llama.cpp's tokenizer-only GGUF files (tests/data/README.md) are stored
# xz-compressed to keep the tree small; the tests read the decompressed copies
# in $(TEST_VOCAB_DIR), which every test binary and json_mask_bench depend on.
TEST_VOCAB_DIR := $(BUILD)/testdata/vocab
TEST_VOCAB := $(patsubst tests/data/vocab/%.xz,$(TEST_VOCAB_DIR)/%,$(wildcard tests/data/vocab/*.gguf.xz))
$(TEST_VOCAB_DIR)/%.gguf: tests/data/vocab/%.gguf.xz | $(DEPS)
	@mkdir -p $(dir $@)
	xz -dc $< > $@.tmp && mv $@.tmp $@
VOCAB_CFLAGS := -DTEST_VOCAB_DIR='"$(TEST_VOCAB_DIR)"'

$(BUILD)/tests/%: tests/%.c tests/test.h tests/golden.h $(CUDA_OBJS) $(BUILD)/libsluice.a | $(TEST_VOCAB)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(VOCAB_CFLAGS) $< $(CUDA_OBJS) $(BUILD)/libsluice.a -o $@ $(LDLIBS)

model: $(MODEL)
$(MODEL): | $(DEPS)
	bash tools/fetch_model.sh

test: $(BUILD)/sluice $(TEST_BINS) $(MODEL)
	@python3 -c 'import openai' 2>/dev/null || bash tools/setup.sh
	@bash tools/run_tests.sh $(TEST_BINS)

ifeq ($(CUDA),1)
gpu-test: $(BUILD)/sluice $(GPU_TEST_BINS) $(GPU_BENCH_BINS) $(BUILD)/tests/test_engine
	@BUILD=$(BUILD) bash tests/gpu/run.sh check
else
gpu-test:
	@echo "gpu-test: this build has no CUDA (nvcc not found or CUDA=0)"; exit 1
endif

# Benchmarks (numbers go to BENCHMARKS.md with the machine they ran on): the
# CPU forward pass on the default model and JSON mode's vocabulary mask; on a
# GPU host also the Llama-3.1-8B shape (dummy weights) through the backend.
$(BUILD)/json_mask_bench $(BUILD)/engine_bench: $(BUILD)/%: tools/bench/%.c $(CUDA_OBJS) $(BUILD)/libsluice.a | $(TEST_VOCAB)
	$(CC) $(CFLAGS) $(VOCAB_CFLAGS) $< $(CUDA_OBJS) $(BUILD)/libsluice.a -o $@ $(LDLIBS)

BENCH_DEPS := $(BUILD)/sluice $(BUILD)/tests/test_forward $(BUILD)/json_mask_bench $(BUILD)/engine_bench $(MODEL)
ifeq ($(CUDA),1)
BENCH_DEPS += $(GPU_BENCH_BINS)
endif
bench: $(BENCH_DEPS)
	SLUICE_BENCH=1 $(BUILD)/tests/test_forward
	$(BUILD)/json_mask_bench
	$(BUILD)/engine_bench
	@if [ -x $(BUILD)/tests/gpu/bench_gpu ] && nvidia-smi -L >/dev/null 2>&1; then \
	  BUILD=$(BUILD) bash tests/gpu/run.sh bench gpu; else echo "bench: no GPU here, GPU benchmarks skipped"; fi

# Serves the default model on 127.0.0.1:8000 (the server prints a curl line to try).
run: $(BUILD)/sluice $(MODEL)
	$(BUILD)/sluice serve $(MODEL) --host 127.0.0.1 --port 8000 --served-model-name SmolLM2-135M-Instruct \
	    --enable-prompt-tokens-details

clean:
	rm -rf $(BUILD)

# ---- sanitizers: make asan ----------------------------------------------------------------------
# The parsers and the batch store under AddressSanitizer + UndefinedBehaviorSanitizer (leaks
# included), CPU only, in their own build dir so the release build is untouched. Only the objects
# these tests link are built (a few seconds); `make test` runs them too (TEST_BINS below).
ASAN_BUILD  := build-asan
ASAN_FLAGS  := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
ASAN_CFLAGS := -O1 -g $(ASAN_FLAGS) -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror $(ARCH_FLAGS) -fopenmp -pthread -I.
ASAN_LIBS   := $(ASAN_FLAGS) -lpcre2-8 -lsqlite3 -lm -fopenmp -pthread
ASAN_BINS   := $(patsubst %,$(ASAN_BUILD)/tests/test_%,json store safetensors)
$(ASAN_BUILD)/tests/test_json: $(ASAN_BUILD)/base/json.o $(ASAN_BUILD)/base/base.o
$(ASAN_BUILD)/tests/test_store: $(ASAN_BUILD)/base/json.o $(ASAN_BUILD)/base/base.o $(patsubst %,$(ASAN_BUILD)/store/%.o,store store_file store_batch store_finish store_feed)
$(ASAN_BUILD)/tests/test_safetensors: $(ASAN_BUILD)/base/json.o $(ASAN_BUILD)/base/base.o $(patsubst %,$(ASAN_BUILD)/model/%.o,util tensor quant safetensors)

$(ASAN_BUILD)/%.o: %.c $(wildcard */*.h)
	@mkdir -p $(dir $@)
	$(CC) $(ASAN_CFLAGS) -c $< -o $@

$(ASAN_BUILD)/tests/%: tests/%.c tests/test.h
	@mkdir -p $(dir $@)
	$(CC) $(ASAN_CFLAGS) $< $(filter %.o,$^) -o $@ $(ASAN_LIBS)

.PHONY: asan
asan: $(ASAN_BINS)
	@bash tools/run_tests.sh --no-py $(ASAN_BINS)

test: $(ASAN_BINS)
TEST_BINS += $(ASAN_BINS)
