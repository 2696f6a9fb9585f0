# ddp_train: `make run` and `make test` do all set-up on a fresh Debian machine.
#   make            build ./ddp_train (with CUDA when nvcc is found; CUDA=0 for a CPU-only binary)
#   make deps       install missing Debian packages (as root) or print the command
#   make pydeps     transformers (tests/requirements-hf.txt) from PyPI into build/pydeps, for tests/test_gpt2.py
#   make data       data/fashion_mnist.h5 from Debian's dataset-fashion-mnist, data/synthetic_cifar.h5,
#                   data/fortunes.h5 (make text-data: byte-level tokens of Debian's fortunes, for configs/gpt_tiny.yaml)
#   make run        deps + build + data, then train configs/model.yaml on 2 ranks
#   make test       deps + build + data, then the whole test suite
#   make repeat     N=20 SUITES="...": the suites N times in a row, reporting any test that failed once
#   make test-asan  the unit, fault and GPU stand-in suites built with ASan + UBSan, leaks checked
#   make test-tsan  a short 2-rank run with the prefetch thread and a signal under ThreadSanitizer
#   make test-gpu   the GPU suites on real GPUs (make test runs them on the CPU stand-in, tests/gpusim)
#   make fuzz       the libFuzzer harnesses, 30 min or 10^6 executions each (make test: 30 s each)
#   make longrun    20,000 steps on 2 ranks: RSS, open fds and checkpoint files over time
#   make bench      throughput against PyTorch in the same run: on the GPU when there is one, else the CPU
#   make bench-gpt  configs/gpt_tiny.yaml's recipe on 2 ranks against its PyTorch twin, seeds 1-3: validation
#                   loss (mean of ddp_train's within 2% of PyTorch's: PASS/FAIL, the exit status), tokens/s (~25 min)
#   make bench-scaling  the all-reduce microbenchmark (build/allreduce_bench) on 2 and 4 ranks, then
#                   scripts/scaling.py's predicted step time against the measured one for configs/model.yaml
#   make install    PREFIX=/usr/local: the binary, scripts, configs and the man page

CUDA_HOME ?= /usr/local/cuda
NVCC ?= $(CUDA_HOME)/bin/nvcc
ifeq ($(origin CUDA),undefined)
  CUDA := $(if $(wildcard $(NVCC)),1,0)
endif
NP ?= 2
PYTHON ?= /usr/bin/python3
MPIRUN ?= mpirun

# Sanitizer builds (make test-asan, make test-tsan): SAN=asan or SAN=tsan builds everything in
# build/$(SAN)/; with CUDA the binaries link the GPU stand-in instead of the CUDA libraries
# (nothing can run those here anyway), so the CUDA sources and the stand-in are checked too.
SAN ?=
SAN_FLAGS_asan := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
SAN_FLAGS_tsan := -fsanitize=thread -fno-omit-frame-pointer
SAN_FLAGS := $(SAN_FLAGS_$(SAN))

DEB_PKGS := pkg-config libopenmpi-dev openmpi-bin libhdf5-dev hdf5-tools libyaml-dev libopenblas-openmp-dev \
            dataset-fashion-mnist fortunes libcmocka-dev python3-numpy python3-h5py python3-torch python3-yaml python3-matplotlib help2man slurmctld slurmd slurm-client \
            clang libclang-rt-14-dev libmicrohttpd-dev python3-prometheus-client libdnnl-dev openssh-server \
            libjs-chart.js chromium chromium-driver python3-selenium
OPENBLAS_DIR := /usr/lib/x86_64-linux-gnu/openblas-openmp
OPENBLAS_INC := /usr/include/x86_64-linux-gnu/openblas-openmp

BUILD := build/$(if $(SAN),$(SAN),$(if $(filter 1,$(CUDA)),cuda,cpu))
# libmicrohttpd by name: its .pc file requires gnutls's, which a machine with the library but no
# headers of gnutls (a GPU machine given the .debs of ../shared/device/stage.sh) lacks, and one missing
# .pc file blanks pkg-config's whole answer
PKG_CFLAGS = $(shell pkg-config --cflags ompi-c hdf5 yaml-0.1 2>/dev/null)
PKG_LIBS = $(shell pkg-config --libs ompi-c hdf5 yaml-0.1 2>/dev/null) -lmicrohttpd
ifneq ($(SAN),)
  override CFLAGS := -O1 -g $(SAN_FLAGS)
else
  CFLAGS ?= -O3 -g
endif
# format-truncation: messages are cut to bounded buffers on purpose; no-trapping-math: floating point
# never traps here (no FP exceptions enabled), so loops with a select (tanh_vec) vectorise;
# fp-contract=off: no multiply-add is fused behind our back (with -march=native), so a value that
# forward and backward both compute (batchnorm's z for the fused relu's mask) rounds the same in both;
# no-math-errno: nothing here reads errno after a math function, and sqrtf that may set it cannot
# vectorise (AdamW's update); results are the same bits
override CFLAGS += -std=gnu11 -fno-trapping-math -fno-math-errno -ffp-contract=off -Wall -Wextra -Werror -Wno-format-truncation -fopenmp -pthread $(PKG_CFLAGS) -I$(OPENBLAS_INC) -Isrc
LDLIBS = $(PKG_LIBS) -L$(OPENBLAS_DIR) -Wl,-rpath,$(OPENBLAS_DIR) -lopenblas -ldnnl -lgomp -lpthread -lm

# the CPU backend (src/cpu/): its dt_backend and op table, oneDNN's convolutions, and the ops by
# family, as kernels/*.cu
CPU_SRCS := $(addprefix cpu/,backend.c dnnl.c gemm.c conv.c norm.c elementwise.c pool.c loss.c optim.c transformer.c \
                            attention.c)
SRCS := common.c yaml_tree.c keys.c config.c model.c distill.c tokenizer.c layers.c layer_dense.c layer_conv.c layer_norm.c layer_pool.c \
        layer_activation.c layer_residual.c layer_embedding.c layer_attention.c loss.c comm.c \
        ddp.c device.c sampler.c data_hdf5.c batch.c optim.c optim_sgd.c optim_adamw.c ema.c \
        checkpoint.c log.c train.c train_step.c train_metrics.c memory.c infer.c signals.c fault.c h5util.c monitor.c $(CPU_SRCS)
# Turing (7.5, CUDA 13's oldest), Ampere (8.0; 8.6 and 8.9 run it), Hopper, and PTX that the driver
# compiles for later GPUs. The binary refuses a GPU with no code here (exit 2): gpu_build_runs_on.
CUDA_ARCH ?= -gencode arch=compute_90,code=sm_90 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_75,code=sm_75 \
             -gencode arch=compute_90,code=compute_90
comma := ,
CUDA_CODES := $(subst $(comma), ,$(subst [, ,$(subst ], ,$(CUDA_ARCH))))
CUDA_SASS := $(sort $(patsubst code=sm_%,%,$(filter code=sm_%,$(CUDA_CODES))) $(patsubst sm_%,%,$(filter sm_%,$(CUDA_CODES))))
CUDA_PTX := $(sort $(patsubst code=compute_%,%,$(filter code=compute_%,$(CUDA_CODES))) $(patsubst compute_%,%,$(filter compute_%,$(filter-out arch=%,$(CUDA_CODES)))))
NVCCFLAGS ?= -O3 -std=c++17 $(CUDA_ARCH) -Xcompiler -Wall,-Wextra,-Werror
# With CUDA the GPU code (GPU_SRCS and kernels/) is a library of its own, libddp_train_cuda.so
# beside the binary, linked against cuDNN, cuBLAS, cudart and NCCL and loaded on the first GPU use
# (src/gpu_plugin.c): a process that never uses a GPU does not load them (56 ms of every start).
# It calls back into the binary, which exports its symbols (-rdynamic).
ifeq ($(CUDA),1)
  SRCS += gpu_plugin.c
  GPU_SRCS := gpu_cuda.c $(addprefix cuda/,backend.c gemm.c conv.c ops.c) comm_nccl.c
  override CFLAGS += -I$(CUDA_HOME)/include -Ikernels -DDT_WITH_CUDA=1 '-DDT_CUDA_SASS="$(CUDA_SASS)"' '-DDT_CUDA_PTX="$(CUDA_PTX)"'
  LDLIBS += -ldl -rdynamic
  CUDA_LIBS := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudnn -lcublasLt -lcublas -lcudart -lnccl -lstdc++ -ldl
  KERNEL_OBJS := $(patsubst kernels/%.cu,$(BUILD)/kernels/%.o,$(wildcard kernels/*.cu))
  GPU_OBJS := $(GPU_SRCS:%.c=$(BUILD)/pic/%.o)
  PLUGIN := $(BUILD)/libddp_train_cuda.so
else
  SRCS += gpu_none.c
endif
# the dashboard (src/dashboard/ and Debian's Chart.js) as data in the binary: scripts/embed_dashboard.py
CHARTJS ?= /usr/share/javascript/chart.js/chart.min.js
DASHBOARD_OBJ := $(BUILD)/dashboard_assets.o
HOST_OBJS := $(SRCS:%.c=$(BUILD)/%.o) $(DASHBOARD_OBJ)
OBJS := $(HOST_OBJS)
# the GPU code linked in, for the test binaries that call it directly
DIRECT_OBJS := $(filter-out $(BUILD)/gpu_plugin.o,$(HOST_OBJS)) $(GPU_SRCS:%.c=$(BUILD)/%.o)

# The GPU stand-in (tests/gpusim): the CUDA variant of ddp_train built from the same sources, with
# kernels/*.cu compiled by the host C++ compiler and the CUDA runtime, cuBLAS, cuDNN, NCCL and NVML
# implemented on the CPU in build/sim/libgpusim.so. Only test builds link it.
SIM := $(if $(SAN),$(BUILD)/sim,build/sim)
SIM_CXXFLAGS := -O2 -g $(SAN_FLAGS) -std=c++17 -ffp-contract=off -fPIC -pthread -Wall -Wextra -Werror -I$(CUDA_HOME)/include \
                -I$(OPENBLAS_INC) -Itests/gpusim
# Kernels for the stand-in carry GCC's ThreadSanitizer instrumentation (compile only: no TSan runtime
# is linked): every load and store calls the stand-in's hook, which records the bytes each kernel
# reads and writes for its hazard checker between streams (tests/gpusim/hazard.cc). ASan cannot be
# combined with it, so the sanitizer builds check library calls and copies only.
SIM_TRACE := $(if $(SAN),,-fsanitize=thread --param tsan-instrument-func-entry-exit=0)
SIM_LIB_OBJS := $(patsubst tests/gpusim/%.cc,$(SIM)/gpusim/%.o,$(wildcard tests/gpusim/*.cc))
SIM_KERNEL_OBJS := $(patsubst kernels/%.cu,$(SIM)/kernels/%.o,$(wildcard kernels/*.cu))
SIM_HEADERS := $(wildcard tests/gpusim/*.h)
# DT_RPATH, not RUNPATH: under ASan dlopen (NVML) is called from the sanitizer runtime, where the
# executable's RUNPATH does not apply
SIM_LDLIBS = -Wl,--disable-new-dtags $(PKG_LIBS) -L$(OPENBLAS_DIR) -Wl,-rpath,$(OPENBLAS_DIR) -lopenblas -ldnnl -lgomp -lpthread -lm -L$(SIM) -lgpusim -lstdc++
SIM_BINS := $(SIM)/ddp_train $(SIM)/tests/test_gpu $(SIM)/tests/test_gpusim $(SIM)/tests/test_gpusim_nccl
ifneq ($(SAN),)
ifeq ($(CUDA),1)
  LDLIBS = $(SIM_LDLIBS) -ldl -rdynamic -Wl,-rpath,$(abspath $(SIM))
  SAN_DEPS := $(SIM)/libgpusim.so $(SIM)/libnvidia-ml.so.1
endif
endif
# the kernels and libraries of $(PLUGIN): the real ones, or the stand-in's in a sanitizer build
ifeq ($(SAN),)
  PLUGIN_KERNELS = $(KERNEL_OBJS)
  PLUGIN_LIBS = $(CUDA_LIBS)
else
  PLUGIN_KERNELS = $(SIM_KERNEL_OBJS)
  PLUGIN_LIBS = -Wl,--disable-new-dtags -L$(SIM) -lgpusim -lstdc++ -Wl,-rpath,$(abspath $(SIM))
endif

TESTS := test_config test_sampler test_model test_ops test_optim tokenize_ids $(if $(filter 1,$(CUDA)),test_gpu)
TEST_BINS := $(TESTS:%=$(BUILD)/tests/%) $(if $(filter 1,$(CUDA)),$(SIM_BINS))

# libFuzzer harnesses (tests/fuzz), built with clang, ASan and UBSan: the config reader, HDF5
# dataset validation and the checkpoint reader, over the sources they reach (no main, no backends).
FUZZ := build/fuzz
FUZZERS := config data checkpoint
FUZZ_SRCS := common.c yaml_tree.c keys.c config.c model.c layers.c layer_dense.c layer_conv.c layer_norm.c layer_pool.c \
             layer_activation.c layer_residual.c layer_embedding.c layer_attention.c loss.c sampler.c data_hdf5.c checkpoint.c h5util.c \
             optim.c optim_sgd.c optim_adamw.c comm.c
FUZZ_FLAGS := -g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
FUZZ_BINS := $(FUZZERS:%=$(FUZZ)/fuzz_%)
TEST_BINS += $(FUZZ_BINS)

.PHONY: all deps data text-data pydeps run test test-gpu test-asan test-tsan test-bins repeat fuzz longrun bench bench-gpt clean docs ddp_train install
PREFIX ?= /usr/local
all: ddp_train

# copied then renamed: a running ./ddp_train keeps its old files (no "Text file busy", no torn library);
# the copies are named by the shell's PID, so that two makes at once (test_gpu_check's parallel tests) never
# rename each other's half-written copy
ddp_train: $(BUILD)/ddp_train
	cp $< $@.tmp.$$$$ && mv -f $@.tmp.$$$$ $@
	$(if $(PLUGIN),cp $(PLUGIN) libddp_train_cuda.so.tmp.$$$$ && mv -f libddp_train_cuda.so.tmp.$$$$ libddp_train_cuda.so)

$(BUILD)/ddp_train: $(OBJS) $(BUILD)/main.o $(SAN_DEPS) $(PLUGIN)
	$(CC) $(CFLAGS) -o $@ $(filter %.o,$^) $(LDLIBS)

ifeq ($(CUDA),1)
$(PLUGIN): $(GPU_OBJS) $(PLUGIN_KERNELS) $(SAN_DEPS)
	$(CC) $(CFLAGS) -shared -o $@ $(GPU_OBJS) $(PLUGIN_KERNELS) $(PLUGIN_LIBS)
endif

$(BUILD)/pic/%.o: src/%.c src/*.h src/*/*.h kernels/kernels.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -fPIC -c -o $@ $<

# test_gpu calls the GPU code directly (not through the plugin)
ifeq ($(CUDA),1)
$(BUILD)/tests/test_gpu: tests/test_gpu.c $(DIRECT_OBJS) $(PLUGIN_KERNELS) tests/*.h $(SAN_DEPS) | $(BUILD)/tests
	$(CC) $(CFLAGS) -Itests -o $@ $< $(DIRECT_OBJS) $(PLUGIN_KERNELS) $(LDLIBS) $(if $(SAN),,$(CUDA_LIBS)) -lcmocka
endif

# an empty answer from pkg-config would surface as a missing mpi.h: say which packages it lacks instead
$(BUILD)/%.o: src/%.c src/*.h src/*/*.h kernels/kernels.h | $(BUILD)/tests
	@mkdir -p $(dir $@)
	@$(if $(strip $(PKG_CFLAGS)),true,pkg-config --print-errors --exists ompi-c hdf5 yaml-0.1; echo \
	  "Makefile: pkg-config has no answer for ompi-c hdf5 yaml-0.1 (above): run make deps as root, or set PKG_CONFIG_PATH" \
	  >&2; false)
	$(CC) $(CFLAGS) -c -o $@ $<

$(BUILD)/dashboard_assets.c: scripts/embed_dashboard.py $(wildcard src/dashboard/*) $(wildcard $(CHARTJS))
	@test -f $(CHARTJS) || { echo "Makefile: $(CHARTJS) is missing: make deps installs libjs-chart.js (or set CHARTJS)" >&2; exit 1; }
	@mkdir -p $(dir $@)
	$(PYTHON) scripts/embed_dashboard.py src/dashboard $(CHARTJS) $@

$(DASHBOARD_OBJ): $(BUILD)/dashboard_assets.c
	$(CC) -O0 -c -o $@ $<

$(BUILD)/tests/%: tests/%.c $(OBJS) tests/*.h $(SAN_DEPS) | $(BUILD)/tests
	$(CC) $(CFLAGS) -Itests -o $@ $< $(OBJS) $(LDLIBS) -lcmocka

$(BUILD)/kernels/%.o: kernels/%.cu kernels/*.h kernels/*.cuh src/hash.h src/half.h src/attention_geom.h src/optim_runs.h
	@mkdir -p $(BUILD)/kernels
	$(NVCC) $(NVCCFLAGS) -Xcompiler -fPIC -Ikernels -Isrc -c -o $@ $<

$(BUILD)/tests:
	mkdir -p $@

$(FUZZ)/%.o: src/%.c src/*.h src/*/*.h kernels/kernels.h
	@mkdir -p $(dir $@)
	clang $(FUZZ_FLAGS) -fsanitize=fuzzer-no-link -std=gnu11 -Wall -Wextra -Werror $(PKG_CFLAGS) -Isrc -c -o $@ $<

# an archive: a harness that includes a source (for its static functions) leaves that member out
$(FUZZ)/libsrc.a: $(FUZZ_SRCS:%.c=$(FUZZ)/%.o)
	rm -f $@ && ar rcs $@ $^

$(FUZZ)/fuzz_%: tests/fuzz/fuzz_%.c tests/fuzz/*.h src/*.c src/*.h $(FUZZ)/libsrc.a
	clang $(FUZZ_FLAGS) -fsanitize=fuzzer -std=gnu11 -Wall -Wextra -Werror $(PKG_CFLAGS) -Isrc -o $@ $< \
	  $(FUZZ)/libsrc.a $(PKG_LIBS) -lpthread -lm

$(SIM)/gpusim/%.o: tests/gpusim/%.cc $(SIM_HEADERS)
	@mkdir -p $(SIM)/gpusim
	$(CXX) $(SIM_CXXFLAGS) -c -o $@ $<

$(SIM)/libgpusim.so: $(SIM_LIB_OBJS)
	$(CXX) $(SAN_FLAGS) -shared -Wl,--no-undefined -o $@ $^ -L$(OPENBLAS_DIR) -Wl,-rpath,$(OPENBLAS_DIR) -lopenblas -lpthread -lrt

$(SIM)/libnvidia-ml.so.1: tests/gpusim/nvml.c $(SIM)/libgpusim.so
	$(CC) -O2 -g -fPIC -shared -Wall -Wextra -Werror -Wl,--no-undefined -o $@ $< -L$(SIM) -lgpusim

# kernels/*.cu as C++ against the device-emulation header
$(SIM)/kernels/%.o: kernels/%.cu kernels/*.h kernels/*.cuh src/hash.h src/half.h src/attention_geom.h src/optim_runs.h $(SIM_HEADERS)
	@mkdir -p $(SIM)/kernels
	$(CXX) -x c++ $(SIM_CXXFLAGS) $(SIM_TRACE) -include tests/gpusim/gpusim_device.h -Ikernels -Isrc -c -o $@ $<

$(SIM)/ddp_train: $(HOST_OBJS) $(BUILD)/main.o $(SIM)/libddp_train_cuda.so $(SIM)/libnvidia-ml.so.1
	$(CC) $(CFLAGS) -o $@ $(HOST_OBJS) $(BUILD)/main.o $(SIM_LDLIBS) -ldl -rdynamic -Wl,-rpath,'$$ORIGIN'

# the GPU code on the stand-in, loaded by $(SIM)/ddp_train as the real one is
$(SIM)/libddp_train_cuda.so: $(GPU_OBJS) $(SIM_KERNEL_OBJS) $(SIM)/libgpusim.so
	$(CC) $(CFLAGS) -shared -o $@ $(GPU_OBJS) $(SIM_KERNEL_OBJS) -Wl,--disable-new-dtags -L$(SIM) -lgpusim -lstdc++ \
	  -Wl,-rpath,'$$ORIGIN'

$(SIM)/tests/test_gpu: tests/test_gpu.c $(DIRECT_OBJS) $(SIM_KERNEL_OBJS) tests/*.h $(SIM)/libgpusim.so $(SIM)/libnvidia-ml.so.1
	@mkdir -p $(SIM)/tests
	$(CC) $(CFLAGS) -Itests -o $@ $< $(DIRECT_OBJS) $(SIM_KERNEL_OBJS) $(SIM_LDLIBS) -lcmocka -Wl,-rpath,'$$ORIGIN/..'

# the stand-in's own checks: deliberately broken kernels and call sequences beside correct ones
$(SIM)/tests/test_gpusim: tests/gpusim/test_gpusim.cu kernels/common.cuh $(SIM_HEADERS) $(SIM)/libgpusim.so
	@mkdir -p $(SIM)/tests
	$(CXX) -x c++ $(SIM_CXXFLAGS) $(SIM_TRACE) -include tests/gpusim/gpusim_device.h -Ikernels -Isrc -c -o $@.o $<
	$(CXX) $(SIM_CXXFLAGS) -o $@ $@.o -L$(SIM) -lgpusim -lcmocka -Wl,-rpath,'$$ORIGIN/..'

$(SIM)/tests/test_gpusim_nccl: tests/gpusim/test_gpusim_nccl.c $(SIM_HEADERS) $(SIM)/libgpusim.so
	@mkdir -p $(SIM)/tests
	$(CC) $(CFLAGS) -I$(CUDA_HOME)/include -o $@ $< $(PKG_LIBS) -L$(SIM) -lgpusim -Wl,-rpath,'$$ORIGIN/..'

deps:
	@missing=""; for p in $(DEB_PKGS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	  else \
	    echo "missing packages; run: sudo apt-get install --no-install-recommends$$missing"; exit 1; \
	  fi; \
	fi

data: data/fashion_mnist.h5 data/synthetic_cifar.h5 data/fortunes.h5
data/fashion_mnist.h5: scripts/make_fashion_mnist.py
	mkdir -p data
	$(PYTHON) scripts/make_fashion_mnist.py /usr/share/datasets/fashion-mnist $@
data/synthetic_cifar.h5: scripts/make_synthetic.py
	mkdir -p data
	$(PYTHON) scripts/make_synthetic.py $@

# byte-level tokens (vocab 256) of Debian's fortunes package, T = 128: /train/tokens, /val/tokens (N, 129)
text-data: deps
	$(MAKE) data/fortunes.h5
data/fortunes.h5: scripts/make_text_data.py
	mkdir -p data
	$(PYTHON) scripts/make_text_data.py /usr/share/games/fortunes $@

# transformers and what it imports, pinned, into a private directory: tests/test_gpt2.py checks GPT-2
# import and fine-tuning against a real GPT2LMHeadModel (it skips those tests when this is missing)
PYDEPS := build/pydeps
pydeps: $(PYDEPS)/.stamp
$(PYDEPS)/.stamp: tests/requirements-hf.txt
	rm -rf $(PYDEPS)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --target $(PYDEPS) \
	  -r tests/requirements-hf.txt
	PYTHONPATH=$(PYDEPS) $(PYTHON) -c "from transformers import GPT2Config, GPT2LMHeadModel"
	touch $@

export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

run: deps
	$(MAKE) ddp_train data
	$(MPIRUN) --oversubscribe -np $(NP) ./ddp_train configs/model.yaml --set checkpoint.best=true

test-bins: $(TEST_BINS)

# with CUDA, the GPU suites run on the stand-in (build/sim); test-gpu runs them on real GPUs
test: deps
	$(MAKE) ddp_train data $(TEST_BINS)
	$(MAKE) pydeps || echo "make pydeps failed (no PyPI?): tests/test_gpt2.py skips its Hugging Face tests"
	BUILD=$(BUILD) PYTHON=$(PYTHON) $(if $(filter 1,$(CUDA)),SIM=$(SIM) DDP_TRAIN_GPU_BINARY=$(SIM)/ddp_train) \
	  bash tests/run.sh

# AddressSanitizer + UndefinedBehaviorSanitizer, with leak checking at exit: the unit tests, the
# stand-in's checks and GPU suites, the fault suite (2-rank training, resume, crash, hang, NaN,
# signal, full disk), train.recompute against none and dist.zero against 0, distillation, token data and the
# tokenizer, the dashboard and report.html in the browser, every binary built with them. Reports go to
# build/asan/logs; any report fails the run. Open MPI's own leaks are suppressed by tests/sanitizers/lsan.supp; its
# components stay loaded (disable_dlclose) so that the suppressions can name them.
ASAN_SUITES := test_config test_sampler test_model test_ops test_optim gpusim gpusim_nccl test_gpu_on_gpusim \
               test_faults test_gpu_train test_gpu_faults test_recompute test_zero test_distill \
               test_sequence test_text test_dashboard
ASAN_LOGS := $(CURDIR)/build/asan/logs
test-asan: deps
	$(MAKE) SAN=asan test-bins data
	rm -rf $(ASAN_LOGS) && mkdir -p $(ASAN_LOGS)
	ASAN_OPTIONS=detect_leaks=1:allow_user_segv_handler=1:halt_on_error=1:fast_unwind_on_malloc=0:log_path=$(ASAN_LOGS)/asan \
	LSAN_OPTIONS=suppressions=$(CURDIR)/tests/sanitizers/lsan.supp:print_suppressions=0 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$(ASAN_LOGS)/ubsan \
	OMPI_MCA_mca_base_component_disable_dlclose=1 SANITIZER_LOGS=$(ASAN_LOGS) \
	BUILD=build/asan SIM=build/asan/sim DDP_TRAIN_BINARY=build/asan/sim/ddp_train \
	DDP_TRAIN_GPU_BINARY=build/asan/sim/ddp_train PYTHON=$(PYTHON) DDP_TRAIN_SUITES="$(ASAN_SUITES)" bash tests/run.sh

# ThreadSanitizer on the threads of a run (the prefetch thread, the signal flag), CPU build: one
# OpenMP and BLAS thread per rank, since libgomp is not instrumented. Open MPI's internal threads are
# suppressed by tests/sanitizers/tsan.supp.
TSAN_LOGS := $(CURDIR)/build/tsan/logs
# OMPI_MCA_pml=ob1 (what one node selects anyway): with ddp_train's default pml list (^cm) Open MPI also
# opens UCX, whose munmap hook crashes inside ThreadSanitizer's interceptors when a thread exits
test-tsan: deps
	$(MAKE) SAN=tsan CUDA=0 build/tsan/ddp_train data
	rm -rf $(TSAN_LOGS) && mkdir -p $(TSAN_LOGS)
	TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:log_path=$(TSAN_LOGS)/tsan:suppressions=$(CURDIR)/tests/sanitizers/tsan.supp \
	OMP_NUM_THREADS=1 OMPI_MCA_mca_base_component_disable_dlclose=1 OMPI_MCA_pml=ob1 SANITIZER_LOGS=$(TSAN_LOGS) BUILD=build/tsan DDP_TRAIN_BINARY=build/tsan/ddp_train \
	PYTHON=$(PYTHON) DDP_TRAIN_SUITES="test_threads" bash tests/run.sh

# the suites N times in a row (default 20), reporting every test that failed in any run
N ?= 20
repeat: deps
	$(MAKE) ddp_train data $(TEST_BINS)
	BUILD=$(BUILD) PYTHON=$(PYTHON) $(if $(filter 1,$(CUDA)),SIM=$(SIM) DDP_TRAIN_GPU_BINARY=$(SIM)/ddp_train) \
	  bash tests/repeat.sh $(N) $(SUITES)

# the fuzzers, each for 30 minutes or 10^6 executions; the corpus grows in build/fuzz/corpus
FUZZ_SECONDS ?= 1800
FUZZ_RUNS ?= 1000000
fuzz: deps
	$(MAKE) $(FUZZ_BINS)
	CORPUS_DIR=$(FUZZ)/corpus bash tests/fuzz/run.sh $(FUZZ_SECONDS) $(FUZZ_RUNS) $(FUZZERS)

# 20,000 steps of a tiny MLP on 2 ranks: RSS, open fds and the checkpoint directory over time
longrun: deps
	$(MAKE) ddp_train data
	$(PYTHON) benchmarks/longrun.py

test-gpu: deps
	$(MAKE) ddp_train data $(TESTS:%=$(BUILD)/tests/%)
	BUILD=$(BUILD) PYTHON=$(PYTHON) DDP_TRAIN_SUITES="test_gpu test_gpu_train test_gpu_faults" bash tests/run.sh

bench: deps
	$(MAKE) ddp_train data
	PYTHON=$(PYTHON) bash benchmarks/bench.sh

# the gpt_tiny recipe in ddp_train (mpirun -np $(NP)) and in PyTorch (one process, every core), one run;
# one pair per seed of BENCH_GPT_ARGS, judged on the means (~25 min; one run moves 2-3% with the seed)
BENCH_GPT_ARGS ?= --seeds 1,2,3
bench-gpt: deps
	$(MAKE) ddp_train text-data
	MPIRUN=$(MPIRUN) $(PYTHON) benchmarks/gpt_tiny_compare.py --np $(NP) $(BENCH_GPT_ARGS)

# the all-reduce microbenchmark behind scripts/scaling.py's `measured` link preset (MPI only)
build/allreduce_bench: benchmarks/allreduce_bench.c
	@mkdir -p build
	mpicc -O2 -g -std=gnu11 -Wall -Wextra -Werror -o $@ $< -lm

# scripts/scaling.py against measurement: the default CNN on 1, 2 and 4 ranks, predicted and measured step times
# (BENCH_SCALING_ARGS=--two-nodes adds 2 ranks on two network namespaces: root and sshd)
BENCH_SCALING_ARGS ?=
.PHONY: bench-scaling
bench-scaling: deps
	$(MAKE) ddp_train data build/allreduce_bench
	MPIRUN=$(MPIRUN) $(PYTHON) benchmarks/scaling_validate.py $(BENCH_SCALING_ARGS)

docs: ddp_train
	./ddp_train --config-keys > docs/config-keys.md

# the man page is generated from the same text as --help and --version
$(BUILD)/ddp_train.1: $(BUILD)/ddp_train
	help2man --no-info --no-discard-stderr --name="data-parallel neural-network trainer (MPI, HDF5, YAML)" \
	  --section=1 --output=$@ $<

install: ddp_train $(BUILD)/ddp_train.1
	install -D -m 755 ddp_train $(DESTDIR)$(PREFIX)/bin/ddp_train
	$(if $(PLUGIN),install -D -m 755 $(PLUGIN) $(DESTDIR)$(PREFIX)/lib/ddp_train/libddp_train_cuda.so)
	install -D -m 644 $(BUILD)/ddp_train.1 $(DESTDIR)$(PREFIX)/share/man/man1/ddp_train.1
	install -d $(DESTDIR)$(PREFIX)/share/ddp_train/scripts/slurm $(DESTDIR)$(PREFIX)/share/ddp_train/configs
	install -m 755 scripts/*.py $(DESTDIR)$(PREFIX)/share/ddp_train/scripts/
	install -m 644 scripts/slurm/* $(DESTDIR)$(PREFIX)/share/ddp_train/scripts/slurm/
	install -m 644 scripts/hostfile.example $(DESTDIR)$(PREFIX)/share/ddp_train/scripts/
	install -m 644 configs/*.yaml $(DESTDIR)$(PREFIX)/share/ddp_train/configs/

clean:
	rm -rf build ddp_train libddp_train_cuda.so
