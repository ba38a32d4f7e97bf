// A CUPTI kernel tracer loaded into a process through CUDA_INJECTION64_PATH: it records the
// start and duration of every kernel (graph nodes included) while tracing is on, and writes
// them as CSV ("Start (ns),Duration (ns),Name", the columns `ncu_step.py --trace` reads) to
// $DS4_TRACE_OUT at exit. Tracing starts off; ds4_trace_on() / ds4_trace_off() (ncu_step.py
// --cupti calls them through ctypes) bracket the steps to measure. For GPU machines without
// Nsight Systems. Build (KREC: the kernel record type of the installed CUPTI, the fields used
// are in every version: CUpti_ActivityKernel10 with the CUDA 13 of our H200 machine, whose CUPTI
// headers and library are in the toolkit's include and lib64; older toolkits keep them in
// extras/CUPTI):
//
//   nvcc -shared -Xcompiler -fPIC -DKREC=CUpti_ActivityKernel10 -I$CUDA/extras/CUPTI/include \
//       -o /tmp/kernel_trace.so kernel_trace.cpp -L$CUDA/extras/CUPTI/lib64 -lcupti \
//       -Xlinker -rpath=$CUDA/extras/CUPTI/lib64
#include <cupti.h>

#include <cstdio>
#include <cstdlib>

static FILE* out = nullptr;

static void CUPTIAPI buffer_requested(uint8_t** buf, size_t* size, size_t* max_records) {
    *size = 16u << 20;
    *buf = (uint8_t*)aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buf, size_t, size_t valid) {
    CUpti_Activity* r = nullptr;
    while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
        if (out && (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || r->kind == CUPTI_ACTIVITY_KIND_KERNEL)) {
            const KREC* k = (const KREC*)r;
            fprintf(out, "%llu,%llu,%s\n", (unsigned long long)k->start, (unsigned long long)(k->end - k->start),
                    k->name);
        }
    }
    free(buf);
}

static void finish() {
    cuptiActivityFlushAll(1);
    if (out) {
        fclose(out);
        out = nullptr;
    }
}

extern "C" int InitializeInjection() {
    const char* path = getenv("DS4_TRACE_OUT");
    out = fopen(path ? path : "kernel_trace.csv", "w");
    if (!out) {
        return 0;
    }
    fprintf(out, "Start (ns),Duration (ns),Name\n");
    cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    atexit(finish);
    return 1;
}

extern "C" void ds4_trace_on() {
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
}

extern "C" void ds4_trace_off() {
    cuptiActivityFlushAll(1);
    cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
}
